"""Exact re-layouts of an adapter's factors, the adapter counterpart of ``split-gateup`` / ``fuse-gateup``.

    fused -> separate   B's rows split with the group's gate/up layout (the same ``layouts.split`` as the base
                        weight's), A shared by both halves (copied): each half's delta is the fused delta's rows
    stacked -> experts  one (A, B) per expert, the expert's slice of each factor
    separate -> fused   gate and up with the same A (bytes) and scale: that A, B fused as the weight is; otherwise
                        ranks concatenated into a block structure, A = [A_gate; A_up] and B = [[B_gate, 0], [0, B_up]],
                        whose delta's gate and up rows are exactly B_gate·A_gate and B_up·A_up
    experts -> stacked  factors stacked on a new dim 0; ranks padded with zero rows of A / columns of B where they
                        differ, an expert with no factors given zero ones (its delta is zero either way)

Every step moves, copies or zero-pads factor entries, never computes with them, so each FFN's delta is the same
``scale · B · A`` before and after (tested by computing it both sides). Targets outside the FFNs pass unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from ..layouts import fuse as fuse_rows
from ..layouts import split as split_rows
from .model import Adapter, AdapterError, Lora
from .places import Place, places


def _supported(p: Place, target: str) -> None:
    if p.form.transposed or p.form.turned or p.form.flat:
        raise AdapterError(f"{target}: a LoRA of {p.form_name} {p.group.name or 'FFN'} tensors stored "
                           f"{'(in, out)' if p.form.transposed or p.form.turned else 'flattened'} is not re-laid out "
                           "by ffn-tools yet; convert it as it is")


def split(adapter: Adapter, scheme=None) -> tuple[Adapter, list[str]]:
    """Fused gate_up LoRAs into gate and up LoRAs, stacked expert LoRAs into per-expert ones.

    Raises:
        AdapterError: nothing to split, or a form not handled (say what).
    """
    where = places(adapter.loras, adapter.config, scheme)
    out: dict[str, Lora] = {}
    fused = stacked = 0
    for target, lora in adapter.loras.items():
        p = where.get(target)
        if p is None or (p.role != "gate_up" and not p.form.stacked):
            out[target] = lora
            continue
        _supported(p, target)
        unfused = p.group.unfused
        if unfused is None:
            raise AdapterError(f"{target}: its FFN group has no separate form to split into")
        pieces = [(e, lora.expert(e, target)) for e in range(lora.experts or 0)] if p.form.stacked else [(None, lora)]
        stacked += p.form.stacked
        for e, one in pieces:
            if p.role != "gate_up":  # a stacked down (or a stacked-separate gate, up): its experts apart
                name = p.name_in(unfused, p.role, e)
                out[name] = replace(one, target=name, a=one.a.contiguous(), b=one.b.contiguous())
                continue
            gate_b, up_b = split_rows(one.b, p.group.layout, name=f"{target} lora B")
            for role, b, a in (("gate", gate_b, one.a.contiguous()), ("up", up_b, one.a.clone())):
                name = p.name_in(unfused, role, e)
                out[name] = replace(one, target=name, a=a, b=b)
            fused += 1
    if not fused and not stacked:
        raise AdapterError(f"{adapter.path}: no fused gate_up or stacked expert LoRA to split")
    changes = [f"{fused} fused gate_up LoRAs split into gate and up (B's rows, A shared)"] if fused else []
    changes += [f"{stacked} stacked expert LoRAs split per expert"] if stacked else []
    return adapter.with_loras(out), changes


def pad(lora: Lora, rank: int) -> Lora:
    """The same delta at a higher rank: zero rows of A, zero columns of B."""
    import torch

    if lora.rank == rank:
        return lora
    a = torch.cat([lora.a, lora.a.new_zeros((*lora.a.shape[:-2], rank - lora.rank, lora.a.shape[-1]))], -2)
    b = torch.cat([lora.b, lora.b.new_zeros((*lora.b.shape[:-1], rank - lora.rank))], -1)
    return replace(lora, a=a, b=b)


def _same_bytes(x, y) -> bool:
    import torch

    return x.dtype == y.dtype and x.shape == y.shape and \
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def _fuse_pair(name: str, gate: Lora | None, up: Lora | None, layout) -> tuple[Lora, str | None]:
    """gate and up LoRAs of one FFN as one gate_up LoRA (see the module docstring); a missing half gets zero B
    rows. Returns it and a note where it is not the plain case."""
    import torch

    present = [x for x in (gate, up) if x is not None]
    first = present[0]
    if len({x.scale for x in present}) > 1:
        raise AdapterError(f"{name}: gate and up LoRAs have different scales ({' and '.join(str(x.scale) for x in present)}"
                           "); one fused LoRA has one scale, and folding the ratio into B would round")
    if len({(x.a.dtype, x.b.dtype) for x in present}) > 1:
        raise AdapterError(f"{name}: gate and up LoRAs are stored in different dtypes; one fused LoRA has one, and "
                           "casting would round")
    if gate is not None and up is not None and _same_bytes(gate.a, up.a):
        return replace(first, target=name, a=gate.a.contiguous(), b=fuse_rows(gate.b, up.b, layout, name=name)), None
    if len(present) == 1:
        zero = first.b.new_zeros(first.b.shape)
        b = fuse_rows(first.b, zero, layout, name=name) if gate is not None else fuse_rows(zero, first.b, layout, name=name)
        half = "up" if gate is not None else "gate"
        return replace(first, target=name, a=first.a.contiguous(), b=b), \
            f"{name}: {half} has no LoRA; its rows of B are zeros"
    assert gate is not None and up is not None
    a = torch.cat([gate.a, up.a], -2)
    gb = torch.cat([gate.b, gate.b.new_zeros((*gate.b.shape[:-1], up.rank))], -1)
    ub = torch.cat([up.b.new_zeros((*up.b.shape[:-1], gate.rank)), up.b], -1)
    alpha = None if gate.alpha is None else gate.alpha * (gate.rank + up.rank) / gate.rank
    return replace(gate, target=name, a=a, b=fuse_rows(gb, ub, layout, name=name), alpha=alpha), \
        f"{name}: gate and up have different A; fused at rank {gate.rank}+{up.rank} (block structure)"


def fuse(adapter: Adapter, stack_experts: bool = False, scheme=None) -> tuple[Adapter, list[str]]:
    """gate and up LoRAs into gate_up LoRAs; with ``stack_experts``, per-expert LoRAs into stacked ones.

    Raises:
        AdapterError: nothing to fuse, a group with no fused (stacked) form, different scales.
    """
    where = places(adapter.loras, adapter.config, scheme)
    halves: dict[tuple, dict[str, Lora]] = defaultdict(dict)
    first_of: dict[tuple, str] = {}
    out: dict[str, Lora] = {}
    for target, lora in adapter.loras.items():
        p = where.get(target)
        if p is None or p.role not in ("gate", "up") or p.form.fused or p.form.stacked:
            out[target] = lora
            continue
        _supported(p, target)
        halves[p.key()][p.role] = lora
        first_of.setdefault(p.key(), target)
        out[first_of[p.key()]] = lora  # holds the place, in source order
    notes: list[str] = []
    fused_names: dict[str, Place] = {}
    for key, pair in halves.items():
        p = where[first_of[key]]
        if "fused" not in p.group.forms:
            raise AdapterError(f"{first_of[key]}: its FFN group has no fused gate_up form")
        name = p.name_in("fused", "gate_up")
        lora, note = _fuse_pair(name, pair.get("gate"), pair.get("up"), p.group.layout)
        notes += [note] if note else []
        del out[first_of[key]]
        out[name] = lora
        fused_names[name] = replace(p, form_name="fused", role="gate_up")
    for target in list(out):
        p = where.get(target)
        if p is not None and p.role == "down":
            fused_names[target] = p
    if not halves and not stack_experts:
        raise AdapterError(f"{adapter.path}: no gate/up LoRA pair to fuse")
    changes = [f"{len(halves)} gate and up LoRA pairs fused into gate_up"] if halves else []
    if stack_experts:
        out, stack_notes = _stack(out, fused_names, adapter.config)
        changes += stack_notes
    return adapter.with_loras(out), changes + notes


def _stack(loras: dict[str, Lora], where: dict[str, Place], config) -> tuple[dict[str, Lora], list[str]]:
    import torch

    groups: dict[tuple, dict[int, Lora]] = defaultdict(dict)
    first: dict[tuple, str] = {}
    for target, lora in loras.items():
        p = where.get(target)
        if p is None or p.group.kind != "expert" or p.expert is None:
            continue
        if "stacked" not in p.group.forms:
            raise AdapterError(f"{target}: its expert group has no stacked form (transformers v5's)")
        k = (p.group.name, p.layer, p.role)
        groups[k][p.expert] = lora
        first.setdefault(k, target)
    if not groups:
        raise AdapterError("no per-expert LoRA to stack")
    experts = int((config or {}).get("num_local_experts") or (config or {}).get("num_experts") or 0)
    out, notes = dict(loras), []
    for k, by_expert in groups.items():
        p = where[first[k]]
        n = max(experts, max(by_expert) + 1)
        rank = max(x.rank for x in by_expert.values())
        scales = {x.scale for x in by_expert.values()}
        if len(scales) > 1:
            raise AdapterError(f"layer {p.layer} {k[2]}: the experts' LoRAs have different scales {sorted(scales)}; a "
                               "stacked LoRA has one")
        some = next(iter(by_expert.values()))
        missing = [e for e in range(n) if e not in by_expert]
        filled = [pad(by_expert[e], rank) if e in by_expert else
                  replace(some, a=some.a.new_zeros((rank, some.a.shape[-1])),
                          b=some.b.new_zeros((some.b.shape[-2], rank)))
                  for e in range(n)]
        for e in by_expert:
            del out[by_expert[e].target]
        name = getattr(p.group.forms["stacked"], k[2]).format(layer=p.layer)
        alpha = None if some.alpha is None else some.alpha * rank / some.rank
        out[name] = replace(some, target=name, a=torch.stack([x.a for x in filled]),
                            b=torch.stack([x.b for x in filled]), alpha=alpha)
        if missing:
            notes.append(f"{name}: experts {missing} have no LoRA; stacked with zero factors")
        if any(x.rank != rank for x in by_expert.values()):
            notes.append(f"{name}: ranks differ across experts; padded with zeros to {rank}")
    return out, [f"{len(groups)} per-expert LoRA groups stacked"] + notes
