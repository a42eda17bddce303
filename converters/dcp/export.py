"""DCP export as a plan: one ``Entry`` per key of the state dict written, run by ``plan.execute`` with ``DcpWriter``.

``hf`` naming: every tensor under its own name (cast where ``--dtype`` asks). ``torchtitan`` naming: each Hugging
Face tensor under its torchtitan name (``names``), q/k rows in torchtitan's rotary order where the family permutes
them, and each layer's routed experts stacked into ``moe.experts.w1/w3/w2`` from their canonical weights (any
stored form: one tensor per expert, or transformers 5's fused stacks), all pure moves. config.json and the
tokenizer go beside ``.metadata`` (``torch.distributed.checkpoint.load`` reads only its own files), so the
directory reads back as the same model.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING

from ffn_tools.detect import find_ffns
from ffn_tools.errors import FFNToolsError, SchemeError, listing
from ffn_tools.io.store import Checkpoint
from ffn_tools.io.dtypes import as_st
from ffn_tools import ops as oplib
from ffn_tools.ops import Cast, Op, Permute, Stack, Take, Unstack
from ffn_tools.stacks import canonical_ops, stack_shape
from ffn_tools.plan import Entry, Plan, cast_entry, dequantized_line, unquantized_config

from .names import NAMINGS, family_of, heads_of, stacked, to_titan

if TYPE_CHECKING:
    import torch

def _rotary_order(rows: int, heads: int) -> tuple[int, ...]:
    """The row order of q/k in torchtitan's rotary order (``native.layout.unpermute``: each head's rows from
    Hugging Face's halves back to interleaved pairs): output row i is input row order[i]."""
    per, half = rows // heads, rows // heads // 2
    return tuple(h * per + p * half + j for h in range(heads) for j in range(half) for p in range(2))


def _entry(ckpt: Checkpoint, name: str, key: str, dtype, heads: int | None) -> Entry:
    base = cast_entry(ckpt, name, dtype)
    if heads is None:
        return replace(base, name=key, text=f"{name}, {base.note}")
    return Entry(key, base.dtype, base.shape, base.inputs, (*base.ops, Permute(_rotary_order(base.shape[0], heads))),
                 reads=base.reads, sources=base.sources,
                 text=f"{name}, rows in torchtitan's rotary order ({heads} heads), {base.note}")


def _stack_ops(ckpt: Checkpoint, experts: list, role: str) -> tuple[tuple[str, ...], tuple[Op, ...]]:
    """The inputs and ops making ``role``'s canonical stack (E, out, in) of a layer's ``experts`` (in order), every
    stored form a pure move: one tensor per expert (or a fused gate_up per expert), each read back to canonical
    (``stacks.canonical_ops``: its ``stored_ops`` reversed: turned where stored (in, out), split where fused), the
    part kept, stacked; or the layer's stored stack read back, and where it holds experts not written (or in
    another order), it unstacked, the experts taken, stacked again.

    Raises:
        FFNToolsError: experts stored in no one form (mixed layouts, a stack in several tensors)."""
    f0, count = experts[0], len(experts)
    h, i = f0.d_model, f0.d_ffn
    held = role if role in f0.names else "gate_up"
    used = tuple(f.names.get(held) for f in experts)
    if f0.index is None and not f0.form.flat and None not in used and len(set(used)) == count and all(
            f.index is None and f.form == f0.form and f.layout == f0.layout for f in experts):
        if held == role:
            return used, (*canonical_ops(f0.form, role, (role,), f0.layout, 1, h, i), Stack(count))
        back = canonical_ops(f0.form, held, ("gate", "up"), f0.layout, 1, h, i)  # 2 per expert: gate, up
        part = 0 if role == "gate" else 1
        return used, (*oplib.take(back, tuple(range(part, 2 * count, 2)), count), Stack(count))
    src = used[0]
    shape = tuple(ckpt.info(src).shape) if src is not None else ()
    one = stack_shape(f0.form, held, 1, h, i)
    total = shape[0] // one[0] if shape and shape[0] % one[0] == 0 else 0
    index = tuple(f.index for f in experts)
    if (src is None or any(n != src for n in used) or None in index or not total
            or shape != stack_shape(f0.form, held, total, h, i)):
        raise FFNToolsError(f"layer {f0.ref.layer}'s experts' {role} is stored in no one form torchtitan's stack "
                            "is made from (one tensor per expert, or one stack); write --dcp-naming hf")
    ops = canonical_ops(f0.form, held, (role,), f0.layout, total, h, i)
    if index != tuple(range(total)):
        ops = (*ops, Unstack(total), Take(index), Stack(count))  # some experts not written, or reordered
    return (src,), ops


def _experts(ckpt: Checkpoint, dtype, family: str) -> tuple[list[Entry], set[str]]:
    """Each layer's routed experts as torchtitan's three stacks, and the Hugging Face tensors they take."""
    try:
        ffns = find_ffns(ckpt)
    except SchemeError:
        return [], set()
    names = stacked(family)
    layers: dict[int, list] = defaultdict(list)
    for f in ffns.ffns:
        if f.ref.kind == "expert":
            layers[f.ref.layer].append(f)
    if layers and not names:
        raise FFNToolsError(f"{ckpt.path}: torchtitan's {family} model has no experts; write --dcp-naming hf")
    entries, taken = [], set[str]()
    for layer, experts in sorted(layers.items()):
        experts.sort(key=lambda f: f.ref.expert)
        inputs = tuple(dict.fromkeys(n for f in experts for n in f.names.values()))
        if any(k.endswith("_bias") for f in experts for k in f.names):
            raise FFNToolsError(f"layer {layer}'s experts have biases; torchtitan's experts have none: write "
                                "--dcp-naming hf")
        taken.update(inputs)
        src = ckpt.info(experts[0].names.get("down"))
        out = dtype if dtype is not None and src.dtype.is_floating_point else src.dtype
        for role, template in names.items():
            h, i = experts[0].d_model, experts[0].d_ffn
            shape = (len(experts), h, i) if role == "down" else (len(experts), i, h)

            text = f"{role} of the {len(experts)} experts of layer {layer}, stacked"
            used, ops = _stack_ops(ckpt, experts, role)
            cast = Cast(as_st(out), ckpt.info(used[0]).st_dtype)
            entries.append(Entry(template.format(L=layer), out, shape, used, (*ops, cast),
                                 sources=tuple((ckpt.info(n).st_dtype, tuple(ckpt.info(n).shape)) for n in used),
                                 text=text))
    return entries, taken


def build_plan(ckpt: Checkpoint, naming: str, dtype: torch.dtype | None) -> Plan:
    """The plan of a DCP export (see the module docstring).

    Raises:
        FFNToolsError: unknown naming; for torchtitan, a model without a torchtitan naming here, or tensors its
            naming has no name for (listed).
    """
    if naming not in NAMINGS:
        raise FFNToolsError(f"unknown DCP naming {naming!r}; use one of {', '.join(NAMINGS)}")
    config, _ = unquantized_config(ckpt.config, dtype)
    if naming == "hf":
        entries = [cast_entry(ckpt, n, dtype) for n in ckpt]
        plan = Plan(ckpt, entries, config, summary={"naming": naming})
        plan.changes = ["naming hf: every tensor under its Hugging Face name", *dequantized_line(plan, "DCP")]
        return plan
    if not ckpt.config or "model_type" not in ckpt.config:
        raise FFNToolsError(f"{ckpt.path}: torchtitan's names depend on the architecture, and there is no config.json "
                            "naming its model_type; give one with ffn-tools --config FILE, or write --dcp-naming hf")
    family = family_of(ckpt.config)
    heads = heads_of(ckpt.config)
    experts, taken = _experts(ckpt, dtype, family)
    entries, unknown = [], []
    for name in ckpt:
        if name in taken:
            continue
        found = to_titan(name, family)
        if found is None or found[0].stacked:
            unknown.append(name)
            continue
        spec, where = found
        entries.append(_entry(ckpt, name, spec.titan.format(**where), dtype,
                              heads[spec.rotary] if spec.rotary else None))
    if unknown:
        raise FFNToolsError(f"{ckpt.path}: {len(unknown)} tensor(s) have no name in torchtitan's {family} model: "
                            f"{listing(unknown)}; write them under their own names with --dcp-naming hf")
    plan = Plan(ckpt, entries + experts, config, summary={"naming": naming, "family": family})
    plan.changes = [f"naming torchtitan ({family}): Hugging Face names mapped as torchtitan's state-dict adapter "
                    "maps them" + (", q/k rows in its rotary order" if family == "llama3" else "")
                    + (f", {len({e.name.split('.')[1] for e in experts})} layers' experts stacked" if experts else ""),
                    *dequantized_line(plan, "DCP")]
    return plan
