"""Which FFN projection each adapter target is: the registry's naming schemes, applied to the base tensor names an
adapter's targets are (``Lora.target``). Where a target is decides how it splits, fuses, stacks and unstacks:
the same declared forms and gate/up layouts ``split-gateup`` and ``fuse-gateup`` move base weights between."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..detect import _matches, choose_scheme
from ..errors import SchemeError
from ..registry import Form, Group, Scheme


@dataclass(frozen=True)
class Place:
    """Where one target sits: its FFN (layer, expert, the group's kind) and stored role in one form of its group.

    ``expert`` is None for a dense or shared FFN and for a stacked target (which holds every expert of its layer).
    """

    group: Group
    form_name: str
    role: str  # "gate", "up", "down" or "gate_up"
    layer: int
    expert: int | None

    @property
    def form(self) -> Form:
        return self.group.forms[self.form_name]

    def key(self) -> tuple:
        """The FFN this target belongs to (its group, layer, expert): gate and up of one FFN share it."""
        return (self.group.kind, self.group.name, self.layer, self.expert)

    def name_in(self, form_name: str, role: str, expert: int | None = None) -> str:
        """The tensor name of ``role`` of this FFN in another form of its group (``expert``: for a stacked
        target's experts one at a time)."""
        template = getattr(self.group.forms[form_name], role)
        return template.format(layer=self.layer, expert=self.expert if expert is None else expert)


def places(targets: Iterable[str], config: Mapping | None, scheme: Scheme | None = None) -> dict[str, Place]:
    """target -> its Place, for the targets that are FFN projections of a known scheme (others are absent: an
    attention projection, an embedding).

    Args:
        targets: base tensor names.
        config: the base's config.json (its model_type picks among schemes that fit the names alike), or None.
        scheme: a scheme given by the user (--scheme and friends), else chosen from the names.
    """
    names = list(targets)
    try:
        chosen = choose_scheme(names, config, within=scheme)
    except SchemeError:
        return {}
    out: dict[str, Place] = {}
    for (gi, _stacked, layer, expert), forms in _matches(names, chosen).items():
        group = chosen.groups[gi]
        for form_name, roles in forms.items():
            for role, name in roles.items():
                out.setdefault(name, Place(group, form_name, role, layer, expert))
    return out
