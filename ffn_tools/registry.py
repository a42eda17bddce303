"""Where FFN tensors live, declared as data: naming schemes with ``{layer}`` / ``{expert}`` templates.

A ``Scheme`` is a naming family (Hugging Face Llama-style, Meta-native, Mixtral, Qwen-MoE, ...). It has one
``Group`` per kind of FFN it contains (dense MLPs, routed experts, the shared expert), and each group lists
the *forms* its tensors can take, so that splitting and fusing move between forms of the same scheme:

    separate          gate, up, down per FFN
    fused             gate_up (layout: ``Group.layout``) and down per FFN
    stacked           experts stacked on dim 0: gate_up (E, 2I, H) and down (E, H, I), transformers v5
    stacked-separate  experts stacked on dim 0, separate: gate, up (E, I, H) and down (E, H, I), MLX
    flat-separate     experts flattened into dim 0 of 2-D tensors: gate, up (E*I, H), down (E*H, I) (or, stored
                      (in, out), (E*I, H)), DBRX; E is read from the config key the form names

Weights are PyTorch (out, in). A bias is named like its weight with ``.weight`` -> ``.bias`` (or, for a
name without ``.weight``, with ``_bias`` appended, as GPT-OSS stores stacked expert biases).

The schemes themselves are data: ``schemes/families.json``, in the form a user's ``--scheme-file`` takes,
read by ``families`` (the one reader of scheme JSON, which holds the built-in ``SCHEMES`` and ``LIBRARY``);
this module holds the classes they are read into.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field

from .errors import SchemeError
from .layouts import CONCAT, GateUpLayout

KINDS = ("dense", "expert", "shared")
FORMS = ("separate", "fused", "stacked", "stacked-separate", "flat-separate")
UNFUSED = ("separate", "flat-separate")  # where split-gateup writes (a group's first of these)

# The roles of an FFN's tensors: one table, for every module that names them.
PROJECTIONS = ("gate", "up", "down")  # canonical weights, PyTorch (out, in): gate, up (I, H), down (H, I)
FUSED = "gate_up"  # gate and up stored in one tensor, arranged as the group's GateUpLayout says
ROLES: tuple[str, ...] = (*PROJECTIONS, FUSED)  # what a form's templates name: the stored weights
# Canonical weights and their biases (``FFN.names`` keys a weight's bias "<role>_bias"; see ``bias_name``).
CANONICAL_ROLES = (*PROJECTIONS, *(f"{r}_bias" for r in PROJECTIONS))
# The roles each form names, in the order scheme files write them.
FORM_ROLES = {"separate": PROJECTIONS, "fused": (FUSED, "down"), "stacked": (FUSED, "down"),
              "stacked-separate": PROJECTIONS, "flat-separate": PROJECTIONS}
PLACEHOLDERS = ("layer", "expert")


@dataclass(frozen=True)
class Form:
    """Tensor-name templates of one FFN in one storage form (unused roles are None).

    ``transposed``: the weights are stored (in, out), as GPT-OSS, Llama-4 and Aria store stacked experts:
    gate_up (E, H, 2I) with the layout's ``columns`` axis, down (E, I, H). Readers transpose them back.
    ``turned``: only these roles are stored (in, out) (DBRX's flattened ``w2``); ``transposed`` is all of them.
    ``flat``: the experts are flattened into dim 0 (``flat-separate``), expert e's stored matrix being rows
    ``e * n : (e + 1) * n``; ``experts`` is the config.json key (dotted for a nested one) holding E.
    ``separate_biases``: a fused form whose gate and up biases stay apart, named as its group's separate form
    names them (transformers' HRM converter fuses ``gate_up_proj.weight`` only): ``Group.bias_names``.
    """

    gate: str | None = None
    up: str | None = None
    down: str | None = None
    gate_up: str | None = None
    stacked: bool = False
    transposed: bool = False
    turned: tuple[str, ...] = ()
    flat: bool = False
    experts: str | None = None
    separate_biases: bool = False

    @property
    def fused(self) -> bool:
        return self.gate_up is not None

    def templates(self) -> dict[str, str]:
        """role -> weight-name template, for the roles this form has."""
        return {r: t for r in ROLES if (t := getattr(self, r)) is not None}

    def placed(self, prefix: str) -> "Form":
        """This form with ``{prefix}`` in its templates replaced by the layer prefix ``prefix``."""
        def put(t: str | None) -> str | None:
            return t.replace("{prefix}", prefix) if t is not None else None

        return dataclasses.replace(self, gate=put(self.gate), up=put(self.up), down=put(self.down),
                                   gate_up=put(self.gate_up))

    def turns(self, role: str) -> bool:
        """Whether weight ``role`` (a canonical or stored role: gate, up, down, gate_up) is stored (in, out)."""
        stored = FUSED if role in ("gate", "up") and self.fused else role
        return self.transposed or stored in self.turned

    def rows(self, role: str, d_model: int, d_ffn: int) -> int:
        """Dim 0 of one expert's stored ``role`` (a weight or ``<role>_bias``): its block in a flat tensor."""
        base = role.removesuffix("_bias")
        n = {"gate": d_ffn, "up": d_ffn, FUSED: 2 * d_ffn, "down": d_model}[base]
        if not role.endswith("_bias") and self.turns(base):
            n = d_model if base != "down" else d_ffn  # (in, out): dim 0 is the input
        return n

    def expert_part(self, t, role: str, index: int | None, d_model: int, d_ffn: int):
        """Expert ``index``'s part of a stored tensor of this form (``t`` itself when ``index`` is None): the
        slice of a stack, the row block of a flat tensor. A view, as stored (not yet transposed)."""
        if index is None:
            return t
        if self.flat:
            n = self.rows(role, d_model, d_ffn)
            return t[index * n:(index + 1) * n]
        return t[index]


@dataclass(frozen=True)
class Group:
    """One kind of FFN in a scheme and the forms its tensors take.

    ``name`` says where the group lives relative to its layer (``mlp.experts``); a checkpoint's FFNs are
    the union of the groups that match it (see ``detect``), named after the family that holds them all.
    """

    kind: str
    forms: dict[str, Form]
    layout: GateUpLayout = CONCAT
    name: str = ""
    prefix: str = ""  # the layer prefix its templates start with (``model.layers.{layer}``), for messages
    first_expert: str | None = None  # config key: its experts are numbered from there (after the routed ones)
    first_layer: str | None = None  # config key: its layers are numbered from there (a second stack of layers)

    def __hash__(self) -> int:
        return hash((self.kind, self.name, self.prefix, tuple(sorted(self.forms.items())), self.layout,
                     self.first_expert, self.first_layer))

    def bias_names(self, form: Form, layer: int, expert: int | None) -> dict[str, str]:
        """Bias role -> tensor name of the FFN at (``layer``, ``expert``) as numbered in the tensor names, where
        ``form`` names them apart from its weights' (``Form.separate_biases``); empty otherwise."""
        if not form.separate_biases:
            return {}
        own = self.forms["separate"].templates()
        return {f"{r}_bias": bias_name(own[r].format(layer=layer, expert=expert)) for r in ("gate", "up")}

    @property
    def unfused(self) -> str | None:
        """The form split-gateup writes: the group's first declared form of ``UNFUSED``."""
        return next((n for n in self.forms if n in UNFUSED), None)

    def offsets(self, config) -> tuple[int, int]:
        """(layer, expert) numbers of its FFNs minus those in their tensor names (``first_layer``,
        ``first_expert`` read from ``config``).

        Raises:
            SchemeError: the config lacks a key the group reads, or holds no whole number there.
        """
        return tuple(0 if key is None else config_int(config, key, f"group {self.name!r}")  # type: ignore[return-value]
                     for key in (self.first_layer, self.first_expert))


@dataclass(frozen=True)
class Scheme:
    """A naming family. ``model_types`` are config.json ``model_type`` values that select it."""

    name: str
    description: str
    groups: tuple[Group, ...]
    model_types: tuple[str, ...] = field(default=())
    by_model_type_only: bool = False  # its names also mean something ungated (fc1/fc2): match only when selected
    ungated: tuple[str, ...] = ()  # templates of tensors its modeling code holds that look like FFN projections
    # but are no gated FFN (a router's MLP, a gated norm's low-rank MLP): outside the FFNs, not "unmatched"
    own_forms: tuple[tuple[str, tuple[str, ...]], ...] = ()  # model_type -> the forms its modeling class loads its
    # dense and shared FFNs in, where that is not each group's first form (Phi-3's fused MLP in the hf family)

    def held_forms(self, model_type: str | None, group: Group) -> tuple[str, ...] | None:
        """The forms the modeling class of ``model_type`` (one of this family's) loads ``group``'s FFNs in: its
        ``own_forms`` entry, else the group's first form. None where the family does not say: routed experts
        (loaders convert between their forms family by family), a model_type or a group not of this family."""
        if model_type not in self.model_types or group not in self.groups or group.kind == "expert":
            return None
        return dict(self.own_forms).get(model_type) or (next(iter(group.forms)),)


def config_int(config, key: str, who: str) -> int:
    """``config[key]`` (a dotted key reads nested objects: ``ffn_config.moe_num_experts``), a whole number.

    Raises:
        SchemeError: the key is missing or its value is not a whole number (naming ``who`` needs it).
    """
    value = config or {}
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SchemeError(f"{who} reads config.json key {key!r} (a whole number); found {value!r}: is config.json "
                          "beside the weights?")
    return value


def bias_name(weight_name: str) -> str:
    """The bias tensor that belongs to a weight tensor."""
    return weight_name[: -len("weight")] + "bias" if weight_name.endswith(".weight") else weight_name + "_bias"


@functools.lru_cache(maxsize=None)
def compile_template(template: str) -> re.Pattern:
    """A regex matching the tensor names of a template, with named groups for its placeholders.

    Cached: detection and verify match every template against every tensor name.

    Raises:
        SchemeError: the template has no {layer}, or an unknown {placeholder}.
    """
    unknown = set(re.findall(r"\{(\w*)\}", template)) - set(PLACEHOLDERS)
    if unknown or "{layer}" not in template:
        raise SchemeError(f"template {template!r}: needs {{layer}} and may use {{expert}}; "
                          f"unknown placeholders: {', '.join(sorted(unknown)) or 'none'}")
    pattern = re.escape(template)
    for p in PLACEHOLDERS:
        pattern = pattern.replace(re.escape("{" + p + "}"), f"(?P<{p}>[0-9]+)")
    return re.compile(pattern)
