"""``fuse-gateup``'s plan: separate gate and up fused per FFN in the group's layout (and its orientation), or
routed experts stacked (E, 2I, H); quantized parts by their scheme, FP8 scales and biases with them."""

from __future__ import annotations

from collections import defaultdict

from .. import mtp
from ..detect import FFNSet
from ..errors import LayoutError, NothingToDoError, counted
from ..ffn import FFN
from ..layouts import GateUpLayout
from ..plan import Entry, Plan, copy_entry, source
from ..quant import fp8
from ..registry import UNFUSED, Group
from .common import (SPLIT_FROM, as_split_from, assemble, foreign_layout, fuse_ops, packed_rename, recorded_form,
                     restack, split_from, stack_ops, target_form)
from .naming import COUNTERPARTS, Pair, out_names, pairs

def _packed_fuse(ckpt, f: FFN, new: dict[str, str], replaced, packed: dict) -> bool:
    """Separate quantized gate and up fused part by part by their scheme, down's parts renamed; False: neither
    is one."""
    g, u = packed.get(f.names["gate"]), packed.get(f.names["up"])
    if g is None and u is None:
        return False
    if g is None or u is None or "gate_bias" in f.names:
        raise LayoutError(f"{f.ref}: {f.names['gate' if g is None else 'up']} is stored unquantized and "
                          f"{f.names['up' if g is None else 'gate']} compressed (or they have biases): they cannot "
                          "be fused as stored")
    entries = g.scheme.fuse_entries(g, u, f.layout, new["gate_up"], ckpt)
    replaced[g.packed] += entries
    for name in (*g.parts.values(), *u.parts.values()):
        replaced[name] += []
    packed_rename(ckpt, packed, f.names["down"], new["down"], replaced)
    return True
def _fuse_entry(ckpt, name: str, srcs: list[tuple[str, ...]], layout: GateUpLayout, is_bias: bool,
                stacked: bool = False, transpose: bool = False) -> Entry:
    """One fused tensor from (gate, up) name pairs: one pair, or one per expert stacked on dim 0
    (``transpose``: stored (in, out), each (I, H) projection turned to (H, I) before fusing its columns)."""
    infos = [(ckpt.info(g), ckpt.info(u)) for g, u in srcs]
    gi, ui = infos[0]
    for g, u in infos:
        if g.shape != gi.shape or u.shape != g.shape or g.st_dtype != gi.st_dtype or u.st_dtype != g.st_dtype:
            raise LayoutError(f"cannot fuse {g.name} {g.st_dtype}{list(g.shape)} with {u.name} {u.st_dtype}{list(u.shape)}: "
                              "gate and up (and all stacked experts) need one shape and dtype")
    part = gi.shape[::-1] if transpose else gi.shape
    dim = layout.dim(len(part), is_bias)
    shape = list(part)
    shape[dim] *= 2
    layout.segments(shape[dim])  # raises LayoutError for a bad --tp before anything is written
    inputs = tuple(n for pair in srcs for n in pair)
    out_shape = (len(srcs), *shape) if stacked else tuple(shape)
    first = f"{srcs[0][0]} + {srcs[0][1]}" + (f" … ({len(srcs)} experts stacked)" if stacked else "")
    return Entry(name, gi.st_dtype, out_shape, inputs,
                 fuse_ops(layout, is_bias, transpose, len(srcs) if stacked else None, name),
                 sources=tuple(source(ckpt, n) for n in inputs), text=f"fuse({first}; {layout.describe()})")


def _stack_entry(ckpt, name: str, srcs: list[str], transpose: bool = False) -> Entry:
    info = ckpt.info(srcs[0])
    for s in srcs:
        if ckpt.info(s).shape != info.shape or ckpt.info(s).st_dtype != info.st_dtype:
            raise LayoutError(f"cannot stack {s} {list(ckpt.info(s).shape)} with {srcs[0]} {list(info.shape)}")
    return Entry(name, info.st_dtype, (len(srcs), *(info.shape[::-1] if transpose else info.shape)), tuple(srcs),
                 stack_ops(len(srcs), transpose), sources=tuple(source(ckpt, s) for s in srcs),
                 text=f"stack({srcs[0]} … {len(srcs)} experts{', transposed' if transpose else ''})")


def plan_fuse(ckpt, ffns: FFNSet, stack_experts: bool = False, packed: dict | None = None) -> Plan:
    """Plan fusing every separate FFN of ``ckpt``; with ``stack_experts``, stack the routed experts instead
    (``packed``: compressed-tensors modules, as for ``plan_split``).

    With ``stack_experts`` dense MLPs and shared experts keep their form, as transformers v5 stores them, but
    for those whose group's own (first declared) form is fused: those are fused, as their family stores them.
    split-gateup's output (its record, ``common.SPLIT_FROM``) is fused back as its input was: each group in its
    recorded form and names, stacks stacked, the FFNs it had separate left so.

    Raises:
        NothingToDoError: no FFN is separate, or the scheme has no fused form.
        LayoutError: shapes that cannot be fused in the layout.
    """
    recorded = split_from(ckpt)  # split-gateup's output: fused back as its input had them, the rest left as they are
    left = [f for f in ffns.ffns if f.form_name in UNFUSED and recorded_form(recorded, f) in UNFUSED]
    separate = [as_split_from(ckpt, ffns, f) for f in ffns.ffns
                if f.form_name in UNFUSED and recorded_form(recorded, f) not in UNFUSED]
    if not separate:
        raise NothingToDoError(f"{ckpt.path}: nothing to fuse: no FFN has separate gate and up projections "
                               f"(scheme {ffns.scheme.name}, forms {sorted({f.form_name for f in ffns.ffns})})")
    replaced: dict[str, list[Entry]] = defaultdict(list)
    by_layer: dict[tuple[int, Group], list[FFN]] = defaultdict(list)
    fused: list[FFN] = []
    for f in separate:
        only_stacked = "fused" not in f.group.forms and "stacked" in f.group.forms  # GPT-OSS, Llama-4, Granite
        only_stacked |= recorded_form(recorded, f) == "stacked"  # split from a stack: stacked back
        home = next(iter(f.group.forms))  # a group's first form is its family's own
        if stack_experts or f.form.flat or (f.ref.kind == "expert" and only_stacked):
            if f.ref.kind == "expert":  # only routed experts: v5 keeps dense MLPs and shared experts as they are
                by_layer[f.ref.layer, f.group].append(f)
                continue
            if home != "fused":  # ... unless fused is their own form (Granite's shared_mlp.input_linear)
                continue
        target = target_form(f, "fused", "fuse")
        fused.append(f)
        new = out_names(f, target, ckpt.config)
        if packed and _packed_fuse(ckpt, f, new, replaced, packed):
            continue
        if not target.separate_biases:  # gate's and up's biases fused: both or neither
            _check_biases([f])
        moved = pairs(new, f.names)  # split's pairs, read from the separate side
        for p in moved:
            if p.cut:  # gate and up (or their biases) fused into one
                layout = f.layout if p.bias else f.layout.oriented(target.turns("gate_up"))
                replaced[p.apart[0]].append(_fuse_entry(ckpt, p.fused, [p.apart], layout, p.bias))
                replaced[p.apart[1]] += []
            elif p.apart[0] != p.fused:  # down and its bias, and biases a fused form keeps apart: renamed at most
                replaced[p.apart[0]].append(copy_entry(ckpt, p.apart[0], p.fused))
        _fuse_scales(ckpt, [f], [moved], replaced)
    for (layer, _), experts in by_layer.items():
        held = [packed[n] for f in experts for r in ("gate", "up", "down") if packed and (n := f.names[r]) in packed]
        if held:  # compressed-tensors / GPTQ / AWQ experts (ctrows moves single modules, not stacks)
            raise LayoutError(f"layer {layer}: {len(held)} expert weights are stored quantized ({held[0].scheme.what(held[0])}); "
                              "stacking quantized experts is not done here: `ffn-tools convert PATH --to torch -o DIR` "
                              "dequantizes them, then stack that")
        f0 = experts[0]
        target = target_form(f0, "stacked", "stack")
        if f0.form.flat:
            restack(ckpt, experts, target, replaced)
            continue
        first = f0.group.offsets(mtp.numbering(ckpt.config))[1]
        experts.sort(key=lambda f: f.ref.expert)
        if [f.ref.expert - first for f in experts] != list(range(len(experts))):
            raise LayoutError(f"layer {layer}: experts {[f.ref.expert for f in experts]} are not "
                              f"{first}..{first + len(experts) - 1}; cannot stack")
        new = out_names(f0, target, ckpt.config)
        _check_biases(experts)
        for p in pairs(new, f0.names):  # each of f0's pairs, made from every expert's tensors of its roles
            srcs = [tuple(f.names[r] for r in COUNTERPARTS[p.role]) for f in experts]
            if p.cut:  # gate and up (or their biases) fused, experts stacked
                turn = not p.bias and target.turns("gate_up")
                layout = f0.layout if p.bias else f0.layout.oriented(turn)
                replaced[p.apart[0]].append(_fuse_entry(ckpt, p.fused, srcs, layout, p.bias, True, turn))
            else:  # down and its bias: stacked
                replaced[p.apart[0]].append(_stack_entry(ckpt, p.fused, [n for n, in srcs],
                                                         p.role == "down" and target.turns("down")))
        _fuse_scales(ckpt, experts, [pairs(new, f.names) for f in experts], replaced, stacked=True,
                     transposed=target.turns("gate_up"))
        for f in experts:
            for role in f.names:
                replaced[f.names[role]] += []
    if stack_experts and not by_layer:
        raise NothingToDoError(f"{ckpt.path}: --stack-experts: no routed experts with separate gate/up to stack")
    stacked = [f for fs in by_layer.values() for f in fs]
    changed = stacked + fused
    layout = changed[0].layout.oriented(target_form(changed[0], "stacked" if stacked else "fused", "fuse").turns("gate_up")) \
        if changed else separate[0].layout
    plan = assemble(ckpt, ffns, replaced, "fuse-gateup", len(changed), layout, (stacked, "stacked"), (fused, "fused"))
    if SPLIT_FROM in ckpt.metadata:  # split-gateup's record, used: not carried
        plan.summary["metadata"] = {k: v for k, v in ckpt.metadata.items() if k != SPLIT_FROM}
        back = sorted({f"{f.group.name} {recorded_form(recorded, f)}" for f in changed if f.group.name in recorded})
        plan.changes += [f"FFNs fused back as split-gateup recorded they were ({SPLIT_FROM}): {', '.join(back)}"
                         ] if back else []
        plan.changes += [f"{counted(len(left), 'FFN')} left separate, as split-gateup's input had them"] if left else []
    if w := foreign_layout(ffns, changed, "fused"):
        plan.summary["warnings"].append(w)
    return plan


def _fuse_scales(ckpt, group: list[FFN], moved: list[list[Pair]], replaced, stacked: bool = False,
                 transposed: bool = False) -> None:
    """Gate's and up's FP8 scales fused (and stacked) as their weights are; down's renamed (or stacked).
    ``moved``: each FFN's pairs (``naming.pairs``)."""
    f0 = group[0]
    for suffix in fp8.SUFFIXES:
        gate_up, down = ([p.scaled(suffix) for ps in moved for p in ps if p.role == role]
                         for role in ("gate_up", "down"))
        both = [q.apart for q in gate_up]
        present = [n for pair in both for n in pair if n in ckpt]
        if present:
            if len(present) != 2 * len(both):
                missing = next(n for pair in both for n in pair if n not in ckpt)
                raise LayoutError(f"{missing} is missing: gate and up (and every expert) need the same scales to "
                                  "be fused")
            gate = ckpt.info(f0.names["gate"]).shape
            fp8.check(ckpt, f0.names["gate"], both[0][0], f0.layout, False, fused_rows=2 * gate[0],
                         transposed=transposed or f0.form.transposed)
            vector = len(ckpt.info(both[0][0]).shape) == 1
            replaced[both[0][0]].append(_fuse_entry(ckpt, gate_up[0].fused, both, f0.layout, vector,
                                                     stacked))
            for name in present[1:]:
                replaced[name] += []
        downs = [q.apart[0] for q in down if q.apart[0] in ckpt]
        if downs and stacked:
            replaced[downs[0]].append(_stack_entry(ckpt, down[0].fused, downs))
            for name in downs[1:]:
                replaced[name] += []
        elif downs and downs[0] != down[0].fused:
            replaced[downs[0]].append(copy_entry(ckpt, downs[0], down[0].fused))


def _check_biases(group: list[FFN]) -> None:
    """Gate's and up's biases are fused together: each FFN of ``group`` has both, or none has either."""
    has = [("gate_bias" in f.names, "up_bias" in f.names) for f in group]
    if any(a or b for a, b in has) and not all(a and b for a, b in has):
        raise LayoutError(f"{group[0].ref}: gate and up must both have biases (or neither) to be fused")
