"""The plan of an expert surgery: every tensor copied but the MoE layers' experts and routers, whose kept
experts are renamed (per expert) or taken from their stacks in the new order (``Unstack``, ``Take``, ``Stack``:
pure byte moves, so each entry's bytes are copied as runs of the input's, ``plan.Entry.pieces``)."""

from __future__ import annotations

from ..ops import Op, Reshape, Stack, Take, Unstack
from ..plan import Entry, Plan, copy_entry, source
from ..specs import spans
from .layers import MoELayer
from .selection import Chosen


def taken_ops(shape: tuple[int, ...], experts: int, keep: tuple[int, ...], flat: bool) -> tuple[Op, ...]:
    """THE definition of a stacked tensor's kept experts: experts ``keep`` of a stack of ``experts`` along dim
    0 (``flat``: E blocks of rows), in that order."""
    if not flat:
        return Unstack(experts), Take(keep), Stack(len(keep))
    n = shape[0] // experts
    block = (n, *shape[1:])
    return (Reshape((experts, *block), shape), Unstack(experts), Take(keep), Stack(len(keep)),
            Reshape((len(keep) * n, *shape[1:]), (len(keep), *block)))


def _taken(ckpt, name: str, m: MoELayer, keep: tuple[int, ...], flat: bool, what: str) -> Entry:
    info = ckpt.info(name)
    shape = tuple(info.shape)
    if keep == tuple(range(m.experts)):
        return copy_entry(ckpt, name)
    rows = shape[0] // m.experts
    out = (len(keep) * rows, *shape[1:])
    return Entry(name, info.st_dtype, out, (name,), taken_ops(shape, m.experts, keep, flat),
                 sources=(source(ckpt, name),), text=f"{what} rows of experts {_said(keep)} of {m.experts}")


def _said(keep: tuple[int, ...]) -> str:
    return spans(keep) if list(keep) == sorted(keep) else ",".join(map(str, keep))


def plan_surgery(ckpt, layers: dict[int, MoELayer], chosen: Chosen) -> list[Entry]:
    """Every output tensor of ``ckpt`` with each MoE layer's experts ``chosen`` (new order), in input order."""
    made: dict[str, list[Entry]] = {}
    for layer, m in layers.items():
        keep = chosen[layer]
        new_of = {src: new for new, src in enumerate(keep)}
        for src, names in m.tensors.items():
            for n in names:
                if src in new_of:
                    new = m.heads[new_of[src]] + n[len(m.heads[src]):]
                    made[n] = [copy_entry(ckpt, n, new)]
                else:
                    made[n] = []  # dropped
        for n, flat in m.stacks.items():
            made[n] = [_taken(ckpt, n, m, keep, flat, "the stack's")]
        for n in m.routers:
            made[n] = [_taken(ckpt, n, m, keep, False, "the router's")]
    return [e for n in ckpt for e in made.get(n) or ([] if n in made else [copy_entry(ckpt, n)])]


def surgery_plan(ckpt, layers: dict[int, MoELayer], chosen: Chosen, config: dict | None,
                 changes: list[str]) -> Plan:
    entries = plan_surgery(ckpt, layers, chosen)
    dropped = sum(m.experts - len(chosen[k]) for k, m in layers.items())
    moved = sum(1 for k, m in layers.items() for new, src in enumerate(chosen[k]) if new != src)
    return Plan(ckpt, entries, config, changes, {"experts_dropped": dropped, "experts_moved": moved})
