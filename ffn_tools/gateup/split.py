"""``split-gateup``'s plan: every fused gate_up cut into gate and up (per FFN, per expert of a stack, or into the
group's flat form), quantized parts by their scheme, FP8 scales with their rows."""

from __future__ import annotations

from collections import defaultdict

from ..detect import FFNSet
from ..errors import LayoutError, NothingToDoError
from ..ffn import FFN
from ..plan import Entry, Plan, source
from ..quant import fp8
from ..registry import Form
from .common import assemble, foreign_layout, index_entry, packed_rename, restack, split_ops, split_record, target_form
from .naming import Pair, out_names, pairs

def _split_entries(ckpt, f: FFN, src: str, is_bias: bool, names: dict[str, str], target: Form) -> list[Entry]:
    """gate and up entries cut from the fused tensor ``src`` (expert ``f.index`` when stacked), as ``target``
    stores them."""
    info = ckpt.info(src)
    shape = info.shape[1:] if f.index is not None else info.shape  # (E, 2I, ...) -> expert f.index
    layout = f.layout
    dim = layout.dim(len(shape), is_bias)
    segs = layout.segments(shape[dim])
    out = []
    for k, role in enumerate(("gate", "up")):
        rows = [f"{s}:{s + ln}" for r, s, _, ln in segs if r == role]
        where = f"[{f.index}] " if f.index is not None else ""
        what = "rows" if layout.axis == "rows" or is_bias else "columns"
        note = f"{what} {','.join(rows[:4])}{',…' if len(rows) > 4 else ''} of {src}{where and ' ' + where.strip()}" \
               f" ({layout.describe()})"
        out_shape = list(shape)
        out_shape[dim] //= 2
        turn = f.form.turns("gate_up") != target.turns(role) and not is_bias  # (H, 2I) stored (in, out): each
        # half goes back to (I, H), unless the target is stored (in, out) too
        if turn:
            out_shape, note = out_shape[::-1], note + (", transposed to (in, out)" if target.turns(role) else
                                                       ", transposed to (out, in)")
        made = split_ops(layout, k, is_bias, turn, f.index, info.shape[0] if f.index is not None else None, src)
        out.append(Entry(names[role], info.st_dtype, tuple(out_shape), (src,), made, sources=(source(ckpt, src),),
                         text=note))
    return out


def plan_split(ckpt, ffns: FFNSet, packed: dict | None = None) -> Plan:
    """Plan splitting every fused FFN of ``ckpt`` into separate gate/up projections (the group's ``unfused``
    form: per FFN, or a flat stack per layer; ``packed``: its quantized modules whose schemes move their stored
    parts themselves, ``QuantScheme.split_entries``).

    Raises:
        NothingToDoError: no FFN is fused.
        LayoutError: a fused tensor does not fit the layout (odd rows, --tp not dividing).
    """
    fused = [f for f in ffns.ffns if f.form.fused]
    if not fused:
        n = len(ffns.ffns)
        which = "its one FFN already has" if n == 1 else f"all {n} FFNs already have"
        raise NothingToDoError(f"{ckpt.path}: nothing to split: {which} separate gate and up projections (scheme "
                               f"{ffns.scheme.name})")
    replaced: dict[str, list[Entry]] = defaultdict(list)
    flat: dict[str, list[FFN]] = defaultdict(list)  # a stack -> its experts, split into a flat stack
    for f in fused:
        target = target_form(f, f.group.unfused or "separate", "split")
        if target.flat:
            flat[f.names["gate_up"]].append(f)
            continue
        new = out_names(f, target, ckpt.config)
        if packed and _packed_split(ckpt, f, new, replaced, packed):
            continue
        moved = pairs(f.names, new)  # the input's fused tensors and their names apart (fuse reads them backwards)
        for p in moved:
            if p.cut:  # gate_up and its bias: cut in two
                replaced[p.fused] += _split_entries(ckpt, f, p.fused, p.bias, _roles(p), target)
            elif p.role in ("gate_bias", "up_bias"):  # a fused form's biases stored apart: renamed at most
                if p.fused != p.apart[0]:
                    replaced[p.fused].append(index_entry(ckpt, p.fused, None, p.apart[0]))
            elif f.index is not None or p.fused != p.apart[0]:  # down and its bias: an expert's slice, or renamed
                turn = p.role == "down" and f.form.turns("down") != target.turns("down")
                replaced[p.fused].append(index_entry(ckpt, p.fused, f.index, p.apart[0], turn))
        _split_scales(ckpt, f, moved, replaced, target)
    for experts in flat.values():
        restack(ckpt, experts, experts[0].group.forms[experts[0].group.unfused or "separate"], replaced)
    plan = assemble(ckpt, ffns, replaced, "split-gateup", len(fused), fused[0].layout, (fused, "separate"))
    plan.summary["metadata"], said = split_record(ckpt, ffns, fused)  # fuse-gateup writes them back as they were
    plan.changes += said
    if w := foreign_layout(ffns, fused, "split as"):
        plan.summary["warnings"].append(w)
    return plan


# --- quantized modules (compressed-tensors, NVFP4, GPTQ, AWQ): their schemes move their stored parts ---
def _packed_split(ckpt, f: FFN, new: dict[str, str], replaced, packed: dict) -> bool:
    """A fused quantized gate_up split part by part by its scheme, down's parts renamed; False: not one."""
    m = packed.get(f.names["gate_up"])
    if m is None:
        return False
    if f.index is not None or "gate_up_bias" in f.names:
        raise LayoutError(f"{f.names['gate_up']}: compressed-tensors experts stacked or with biases are not split here")
    for src, entries in m.scheme.split_entries(m, f.layout, new, ckpt).items():
        replaced[src] += entries
    packed_rename(ckpt, packed, f.names["down"], new["down"], replaced)
    return True


def _roles(p: Pair) -> dict[str, str]:
    """A cut pair's names apart, by role (gate's, up's)."""
    return dict(zip(("gate", "up"), p.apart))


def _split_scales(ckpt, f: FFN, moved: list[Pair], replaced, target: Form) -> None:
    """A fused weight's FP8 scales split with it (row blocks), the down projection's renamed with it."""
    stacked = f.index is not None
    for p in moved:
        if p.bias:
            continue
        for suffix in fp8.companions(ckpt, p.fused):
            sc = p.scaled(suffix)
            if p.cut:
                fp8.check(ckpt, p.fused, sc.fused, f.layout, stacked, transposed=f.form.transposed)
                vector = len(ckpt.info(sc.fused).shape) == (2 if stacked else 1)
                replaced[sc.fused] += _split_entries(ckpt, f, sc.fused, vector, _roles(sc), target)
            elif stacked or sc.fused != sc.apart[0]:
                replaced[sc.fused].append(index_entry(ckpt, sc.fused, f.index, sc.apart[0]))
