"""Which tensor of an FFN's fused form is which of its separate form: the one definition split-gateup reads from
the fused side (each fused tensor cut into its two counterparts, or renamed) and fuse-gateup from the separate side
(the two made into their fused tensor, or renamed back). An FP8 scale follows its weight (``Pair.scaled``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .. import mtp
from ..ffn import FFN
from ..registry import Form, bias_name

# A fused form's role -> the separate form's roles it holds: two (cut in two by split, fused from them by fuse), or
# one (renamed either way). ``gate_bias``/``up_bias`` are a fused form's that keeps them apart (``separate_biases``).
COUNTERPARTS: dict[str, tuple[str, ...]] = {
    "gate_up": ("gate", "up"), "gate_up_bias": ("gate_bias", "up_bias"), "gate_bias": ("gate_bias",),
    "up_bias": ("up_bias",), "down": ("down",), "down_bias": ("down_bias",)}


def name_in(template: str, f: FFN, config) -> str:
    """``template`` filled with the numbers in ``f``'s tensor names (its ref's, less the group's offsets)."""
    first_layer, first_expert = f.group.offsets(mtp.numbering(config))  # an MTP module numbered after the model
    return template.format(layer=f.ref.layer - first_layer, expert=f.ref.expert - first_expert)


def out_names(f: FFN, target: Form, config) -> dict[str, str]:
    """Role -> name of every tensor ``f`` has in form ``target``: its weights (the form's templates) and their
    biases (``bias_name``); a fused form that keeps gate's and up's biases apart (``Form.separate_biases``) names
    those as its group's separate form does, and has no ``gate_up_bias``."""
    names = {r: name_in(t, f, config) for r, t in target.templates().items()}
    names.update({f"{r}_bias": bias_name(n) for r, n in list(names.items())})
    if target.separate_biases:
        own = f.group.forms["separate"].templates()
        del names["gate_up_bias"]
        names.update({f"{r}_bias": bias_name(name_in(own[r], f, config)) for r in ("gate", "up")})
    return names


@dataclass(frozen=True)
class Pair:
    """A tensor of the fused form (``role``, ``fused``) and its counterparts in the separate form (``apart``: gate's
    and up's, or one name)."""

    role: str
    fused: str
    apart: tuple[str, ...]

    @property
    def cut(self) -> bool:
        """Gate and up in one tensor (split cuts it, fuse makes it), not a rename."""
        return len(self.apart) == 2

    @property
    def bias(self) -> bool:
        return self.role.endswith("_bias")

    def scaled(self, suffix: str) -> Pair:
        """The pair of these weights' scales (an FP8 ``suffix`` after each name)."""
        return Pair(self.role, self.fused + suffix, tuple(n + suffix for n in self.apart))


def pairs(fused: Mapping[str, str], apart: Mapping[str, str]) -> list[Pair]:
    """The pairs (``COUNTERPARTS``) of an FFN's tensors named in its fused form (role -> name) and in its separate
    form, for the roles both name: split passes the input's names as ``fused`` and ``out_names`` of its target as
    ``apart``, fuse the other way round."""
    return [Pair(role, fused[role], tuple(apart[r] for r in rs)) for role, rs in COUNTERPARTS.items()
            if role in fused and all(r in apart for r in rs)]
