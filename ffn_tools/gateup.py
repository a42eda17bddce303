"""Plans for ``split-gateup`` and ``fuse-gateup``: move FFNs between the forms of their scheme.

Split: fused ``gate_up`` (per FFN, or experts stacked (E, 2I, H)) -> separate gate/up (per expert), or the
group's flat form (``stacks``) where it declares that before a separate one (DBRX).
Fuse: separate gate/up -> fused per FFN, or with ``stack_experts`` routed experts -> stacked (E, 2I, H); flat
experts always stack. Every output is a pure row rearrangement, so most entries carry byte pieces as well as
``compute``.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from .detect import FFNSet, find_ffns
from .io.dtypes import itemsize
from .errors import FFNToolsError, LayoutError, NothingToDoError
from .ffn import FFN
from .layouts import GateUpLayout, fuse, split
from .io.output import check_output
from .plan import Entry, Plan, check_shardable, copy_entry, execute
from . import quant
from .quant import fp8 as scales
from .registry import LIBRARY, UNFUSED, Form, Group, Scheme, bias_name
from .sizes import human
from .stacks import restack_entries
from .io.store import Checkpoint, open_checkpoint

MAX_PIECES = 256  # above this many byte runs (interleaved, column axis) computing is faster than copying


def _runs(shape: tuple[int, ...], isz: int, dim: int, start: int, length: int, base: int = 0) -> list[tuple[int, int]]:
    """Byte runs of ``t.narrow(dim, start, length)`` for a C-contiguous ``t``, one per index before ``dim``."""
    outer = 1
    for d in shape[:dim]:
        outer *= d
    inner = isz
    for d in shape[dim + 1:]:
        inner *= d
    return [(base + (o * shape[dim] + start) * inner, length * inner) for o in range(outer)]


def _stack(tensors):
    import torch

    return torch.stack(tensors)


def _name(template: str, f: FFN, config) -> str:
    """``template`` filled with the numbers in ``f``'s tensor names (its ref's, less the group's offsets)."""
    first_layer, first_expert = f.group.offsets(config)
    return template.format(layer=f.ref.layer - first_layer, expert=f.ref.expert - first_expert)


def _target(f: FFN, form_name: str, verb: str) -> Form:
    form = f.group.forms.get(form_name)
    if form is None:
        want = "--gate and --up" if form_name == "separate" else "--gate-up"
        raise NothingToDoError(f"{f.ref}: the naming scheme has no {form_name} form to {verb} into "
                               f"(it knows {', '.join(f.group.forms)}); name the output tensors with {want} "
                               "templates (with the others), or declare the form in a --scheme-file")
    return form


def _split_entries(ckpt, f: FFN, src: str, is_bias: bool, names: dict[str, str], target: Form) -> list[Entry]:
    """gate and up entries cut from the fused tensor ``src`` (expert ``f.index`` when stacked), as ``target``
    stores them."""
    info = ckpt.info(src)
    shape, base = info.shape, 0
    if f.index is not None:  # (E, 2I, ...) -> expert f.index
        shape = shape[1:]
        base = f.index * info.nbytes // info.shape[0]
    layout = f.layout
    dim = layout.dim(len(shape), is_bias)
    segs = layout.segments(shape[dim])
    out = []
    for role in ("gate", "up"):
        runs = [_runs(shape, itemsize(info.st_dtype), dim, s, ln, base) for r, s, _, ln in segs if r == role]
        pieces = tuple((0, off, n) for o in range(len(runs[0])) for seg in runs for off, n in [seg[o]])
        rows = [f"{s}:{s + ln}" for r, s, _, ln in segs if r == role]
        where = f"[{f.index}] " if f.index is not None else ""
        what = "rows" if layout.axis == "rows" or is_bias else "columns"
        note = f"{what} {','.join(rows[:4])}{',…' if len(rows) > 4 else ''} of {src}{where and ' ' + where.strip()}" \
               f" ({layout.describe()})"
        k = 0 if role == "gate" else 1
        out_shape = list(shape)
        out_shape[dim] //= 2

        turn = f.form.turns("gate_up") != target.turns(role) and not is_bias  # (H, 2I) stored (in, out): each
        # half goes back to (I, H), unless the target is stored (in, out) too

        def compute(ts, k=k, index=f.index, b=is_bias, name=src, turn=turn):
            t = ts[0] if index is None else ts[0][index]
            part = split(t, layout, is_bias=b, name=name)[k]
            return part.T.contiguous() if turn else part

        if turn:
            out_shape, note = out_shape[::-1], note + (", transposed to (in, out)" if target.turns(role) else
                                                       ", transposed to (out, in)")
        out.append(Entry(names[role], info.st_dtype, tuple(out_shape), (src,), compute,
                         pieces if len(pieces) <= MAX_PIECES and not turn else None, note))
    return out


def _index_entry(ckpt, src: str, index: int | None, name: str, transpose: bool = False) -> Entry:
    """``src`` itself, or its slice ``[index]`` of a stacked tensor, under ``name`` (``transpose``: a slice
    stored (in, out), turned back to (out, in))."""
    if index is None:
        return copy_entry(ckpt, src, name)
    info = ckpt.info(src)
    n = info.nbytes // info.shape[0]
    if transpose:
        return Entry(name, info.st_dtype, info.shape[1:][::-1], (src,), lambda ts: ts[0][index].T.contiguous(),
                     None, f"[{index}] of {src}, transposed to (out, in)")
    return Entry(name, info.st_dtype, info.shape[1:], (src,), lambda ts: ts[0][index].contiguous(),
                 ((0, index * n, n),), f"[{index}] of {src}")


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
        target = _target(f, f.group.unfused or "separate", "split")
        new = {r: _name(t, f, ckpt.config) for r, t in target.templates().items()}
        if target.flat:
            flat[f.names["gate_up"]].append(f)
            continue
        if packed and _packed_split(ckpt, f, new, replaced, packed):
            continue
        replaced[f.names["gate_up"]] += _split_entries(ckpt, f, f.names["gate_up"], False, new, target)
        if "gate_up_bias" in f.names:
            replaced[f.names["gate_up_bias"]] += _split_entries(
                ckpt, f, f.names["gate_up_bias"], True, {r: bias_name(new[r]) for r in ("gate", "up")}, target)
        for r in ("gate", "up") if f.form.separate_biases else ():  # biases stored apart: renamed at most
            src = f.names.get(f"{r}_bias")
            if src and src != bias_name(new[r]):
                replaced[src].append(_index_entry(ckpt, src, None, bias_name(new[r])))
        for src, dst, turn in ((f.names["down"], new["down"], f.form.turns("down") != target.turns("down")),
                               (f.names.get("down_bias"), bias_name(new["down"]), False)):
            if src and (f.index is not None or src != dst):
                replaced[src].append(_index_entry(ckpt, src, f.index, dst, turn))
        _split_scales(ckpt, f, new, replaced, target)
    for experts in flat.values():
        _restack(ckpt, experts, experts[0].group.forms[experts[0].group.unfused or "separate"], replaced)
    return _assemble(ckpt, ffns, replaced, "split-gateup", len(fused), fused[0].layout, (fused, "separate"))


def _restack(ckpt, experts: list[FFN], target: Form, replaced) -> None:
    """One layer's whole stack of experts written as ``target`` (a flat form, or from one): ``stacks``."""
    experts = sorted(experts, key=lambda f: f.index if f.index is not None else -1)
    f0 = experts[0]
    if [f.index for f in experts] != list(range(len(experts))):
        raise LayoutError(f"layer {f0.ref.layer}: a flat stack moves whole, but only experts "
                          f"{[f.index for f in experts]} of {f0.names['down']} are there")
    for name in f0.names.values():
        if scales.companions(ckpt, name):
            raise LayoutError(f"{name}: has FP8 scales, which a flat stack of experts does not carry; dequantize "
                              "it first (ffn-tools convert --to torch --dtype bfloat16)")
    entries = restack_entries(ckpt, experts, target, {r: _name(t, f0, ckpt.config)
                                                      for r, t in target.templates().items()})
    replaced[f0.names["down"]] += entries
    for name in f0.names.values():
        replaced[name] += []


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
    _packed_rename(ckpt, packed, f.names["down"], new["down"], replaced)
    return True


def _packed_rename(ckpt, packed: dict, src: str, dst: str, replaced) -> None:
    """``src`` (a module's ``X.weight``, every stored part of it) copied under ``dst``'s names."""
    parts = packed[src].parts if src in packed else {"weight": src}
    if src != dst:
        for suffix, name in parts.items():
            replaced[name].append(copy_entry(ckpt, name, dst[: -len("weight")] + suffix))


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
    _packed_rename(ckpt, packed, f.names["down"], new["down"], replaced)
    return True
# --- end compressed-tensors ---




def _split_scales(ckpt, f: FFN, new: dict[str, str], replaced, target: Form) -> None:
    """A fused weight's FP8 scales split with it (row blocks), the down projection's renamed with it."""
    gate_up, stacked = f.names["gate_up"], f.index is not None
    for suffix, sc in scales.companions(ckpt, gate_up).items():
        scales.check(ckpt, gate_up, sc, f.layout, stacked, transposed=f.form.transposed)
        vector = len(ckpt.info(sc).shape) == (2 if stacked else 1)
        replaced[sc] += _split_entries(ckpt, f, sc, vector, {r: new[r] + suffix for r in ("gate", "up")}, target)
    for suffix, sc in scales.companions(ckpt, f.names["down"]).items():
        if stacked or sc != new["down"] + suffix:
            replaced[sc].append(_index_entry(ckpt, sc, f.index, new["down"] + suffix))


def _fuse_pieces(parts: list[tuple[int, tuple[int, ...], int]], layout: GateUpLayout, is_bias: bool,
                 isz: int) -> tuple[tuple[int, int, int], ...]:
    """Byte pieces of fused tensors built from (gate input position, shape, up input position) triples,
    stacked one after the other (one triple per expert)."""
    pieces = []
    for g, shape, u in parts:
        dim = layout.dim(len(shape), is_bias)
        segs = layout.segments(2 * shape[dim])
        runs = [(g if r == "gate" else u, _runs(shape, isz, dim, p, ln)) for r, _, p, ln in segs]
        pieces += [(pos, *rs[o]) for o in range(len(runs[0][1])) for pos, rs in runs]
    return tuple(pieces)


def _fuse_entry(ckpt, name: str, srcs: list[tuple[str, str]], layout: GateUpLayout, is_bias: bool,
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
    pieces = None if transpose else _fuse_pieces([(2 * k, gi.shape, 2 * k + 1) for k in range(len(srcs))], layout,
                                                 is_bias, itemsize(gi.st_dtype))

    def compute(ts, n=name):
        ts = [t.T for t in ts] if transpose else ts
        fused = [fuse(ts[2 * k], ts[2 * k + 1], layout, is_bias=is_bias, name=n) for k in range(len(ts) // 2)]
        return _stack(fused) if stacked else fused[0]

    out_shape = (len(srcs), *shape) if stacked else tuple(shape)
    first = f"{srcs[0][0]} + {srcs[0][1]}" + (f" … ({len(srcs)} experts stacked)" if stacked else "")
    return Entry(name, gi.st_dtype, out_shape, inputs, compute,
                 pieces if pieces and len(pieces) <= MAX_PIECES * len(srcs) else None,
                 f"fuse({first}; {layout.describe()})")


def _stack_entry(ckpt, name: str, srcs: list[str], transpose: bool = False) -> Entry:
    info = ckpt.info(srcs[0])
    for s in srcs:
        if ckpt.info(s).shape != info.shape or ckpt.info(s).st_dtype != info.st_dtype:
            raise LayoutError(f"cannot stack {s} {list(ckpt.info(s).shape)} with {srcs[0]} {list(info.shape)}")
    if transpose:  # stored (in, out)
        return Entry(name, info.st_dtype, (len(srcs), *info.shape[::-1]), tuple(srcs),
                     lambda ts: _stack([t.T for t in ts]), None, f"stack({srcs[0]} … {len(srcs)} experts, transposed)")
    return Entry(name, info.st_dtype, (len(srcs), *info.shape), tuple(srcs), _stack,
                 tuple((k, 0, info.nbytes) for k in range(len(srcs))), f"stack({srcs[0]} … {len(srcs)} experts)")


def plan_fuse(ckpt, ffns: FFNSet, stack_experts: bool = False, packed: dict | None = None) -> Plan:
    """Plan fusing every separate FFN of ``ckpt``; with ``stack_experts``, stack the routed experts instead
    (``packed``: compressed-tensors modules, as for ``plan_split``).

    With ``stack_experts`` dense MLPs and shared experts keep their form, as transformers v5 stores them, but
    for those whose group's own (first declared) form is fused: those are fused, as their family stores them.

    Raises:
        NothingToDoError: no FFN is separate, or the scheme has no fused form.
        LayoutError: shapes that cannot be fused in the layout.
    """
    separate = [f for f in ffns.ffns if f.form_name in UNFUSED]
    if not separate:
        raise NothingToDoError(f"{ckpt.path}: nothing to fuse: no FFN has separate gate and up projections "
                               f"(scheme {ffns.scheme.name}, forms {sorted({f.form_name for f in ffns.ffns})})")
    replaced: dict[str, list[Entry]] = defaultdict(list)
    by_layer: dict[tuple[int, Group], list[FFN]] = defaultdict(list)
    fused: list[FFN] = []
    for f in separate:
        only_stacked = "fused" not in f.group.forms and "stacked" in f.group.forms  # GPT-OSS, Llama-4, Granite
        home = next(iter(f.group.forms))  # a group's first form is its family's own
        if stack_experts or f.form.flat or (f.ref.kind == "expert" and only_stacked):
            if f.ref.kind == "expert":  # only routed experts: v5 keeps dense MLPs and shared experts as they are
                by_layer[f.ref.layer, f.group].append(f)
                continue
            if home != "fused":  # ... unless fused is their own form (Granite's shared_mlp.input_linear)
                continue
        target = _target(f, "fused", "fuse")
        fused.append(f)
        new = {r: _name(t, f, ckpt.config) for r, t in target.templates().items()}
        if packed and _packed_fuse(ckpt, f, new, replaced, packed):
            continue
        replaced[f.names["gate"]].append(_fuse_entry(ckpt, new["gate_up"], [(f.names["gate"], f.names["up"])],
                                                     f.layout.oriented(target.turns("gate_up")), False))
        replaced[f.names["up"]] += []
        if target.separate_biases:  # gate and up biases stay apart, named as the separate form names them
            for r in ("gate", "up"):
                src, dst = f.names.get(f"{r}_bias"), bias_name(_name(f.group.forms["separate"].templates()[r], f,
                                                                     ckpt.config))
                if src and src != dst:
                    replaced[src].append(copy_entry(ckpt, src, dst))
        else:
            _fuse_biases(ckpt, f, replaced, [f], bias_name(new["gate_up"]))
        _fuse_scales(ckpt, [f], new, replaced)
        for src, dst in ((f.names["down"], new["down"]), (f.names.get("down_bias"), bias_name(new["down"]))):
            if src and src != dst:
                replaced[src].append(copy_entry(ckpt, src, dst))
    for (layer, _), experts in by_layer.items():
        held = [packed[n] for f in experts for r in ("gate", "up", "down") if packed and (n := f.names[r]) in packed]
        if held:  # compressed-tensors / GPTQ / AWQ experts (ctrows moves single modules, not stacks)
            raise LayoutError(f"layer {layer}: {len(held)} expert weights are stored quantized ({held[0].scheme.what(held[0])}); "
                              "stacking quantized experts is not done here: `ffn-tools convert PATH --to torch -o DIR` "
                              "dequantizes them, then stack that")
        f0 = experts[0]
        target = _target(f0, "stacked", "stack")
        if f0.form.flat:
            _restack(ckpt, experts, target, replaced)
            continue
        first = f0.group.offsets(ckpt.config)[1]
        experts.sort(key=lambda f: f.ref.expert)
        if [f.ref.expert - first for f in experts] != list(range(len(experts))):
            raise LayoutError(f"layer {layer}: experts {[f.ref.expert for f in experts]} are not "
                              f"{first}..{first + len(experts) - 1}; cannot stack")
        new = {r: _name(t, f0, ckpt.config) for r, t in target.templates().items()}
        replaced[f0.names["gate"]].append(_fuse_entry(
            ckpt, new["gate_up"], [(f.names["gate"], f.names["up"]) for f in experts],
            f0.layout.oriented(target.turns("gate_up")), False, True, target.turns("gate_up")))
        replaced[f0.names["down"]].append(_stack_entry(ckpt, new["down"], [f.names["down"] for f in experts],
                                                       target.turns("down")))
        _fuse_biases(ckpt, f0, replaced, experts, bias_name(new["gate_up"]), stacked=True)
        _fuse_scales(ckpt, experts, new, replaced, stacked=True, transposed=target.turns("gate_up"))
        if "down_bias" in f0.names:
            replaced[f0.names["down_bias"]].append(_stack_entry(ckpt, bias_name(new["down"]),
                                                                [f.names["down_bias"] for f in experts]))
        for f in experts:
            for role in f.names:
                replaced[f.names[role]] += []
    if stack_experts and not by_layer:
        raise NothingToDoError(f"{ckpt.path}: --stack-experts: no routed experts with separate gate/up to stack")
    stacked = [f for fs in by_layer.values() for f in fs]
    changed = stacked + fused
    layout = changed[0].layout.oriented(_target(changed[0], "stacked" if stacked else "fused", "fuse").turns("gate_up")) \
        if changed else separate[0].layout
    plan = _assemble(ckpt, ffns, replaced, "fuse-gateup", len(changed), layout, (stacked, "stacked"), (fused, "fused"))
    if w := _foreign_layout(ffns, changed):
        plan.summary["warnings"].append(w)
    return plan


def _foreign_layout(ffns: FFNSet, changed: list[FFN]) -> str | None:
    """A warning when FFNs were fused in another arrangement than their family stores (``--layout`` given): the
    output carries the family's names, which its clients read in the family's arrangement, so they would compute
    another function from it without a word."""
    foreign = [f for f in changed if not f.layout.same_arrangement(f.group.layout)]
    if foreign and foreign[0].group not in set(LIBRARY):  # a user's own templates (--gate-up, --scheme-file) name
        return None  # no family whose clients read them one way
    if not foreign:
        return None
    f = foreign[0]
    own, given = f.group.layout.oriented(False).describe(), f.layout.oriented(False).describe()
    return (f"{len(foreign)} FFN{'s' * (len(foreign) > 1)} fused {given!r}, but {ffns.scheme.name}'s names hold gate "
            f"and up as {own!r}, which is how its clients read them: they would compute another function from this "
            "output; fuse without --layout to write the family's own, or split this output back with the same --layout")


def _fuse_scales(ckpt, group: list[FFN], new: dict[str, str], replaced, stacked: bool = False,
                 transposed: bool = False) -> None:
    """Gate's and up's FP8 scales fused (and stacked) as their weights are; down's renamed (or stacked)."""
    f0 = group[0]
    for suffix in scales.SUFFIXES:
        pairs = [(f.names["gate"] + suffix, f.names["up"] + suffix) for f in group]
        present = [n for pair in pairs for n in pair if n in ckpt]
        if present:
            if len(present) != 2 * len(pairs):
                missing = next(n for pair in pairs for n in pair if n not in ckpt)
                raise LayoutError(f"{missing} is missing: gate and up (and every expert) need the same scales to "
                                  "be fused")
            gate = ckpt.info(f0.names["gate"]).shape
            scales.check(ckpt, f0.names["gate"], pairs[0][0], f0.layout, False, fused_rows=2 * gate[0],
                         transposed=transposed or f0.form.transposed)
            vector = len(ckpt.info(pairs[0][0]).shape) == 1
            replaced[pairs[0][0]].append(_fuse_entry(ckpt, new["gate_up"] + suffix, pairs, f0.layout, vector,
                                                     stacked))
            for name in present[1:]:
                replaced[name] += []
        downs = [f.names["down"] + suffix for f in group if f.names["down"] + suffix in ckpt]
        if downs and stacked:
            replaced[downs[0]].append(_stack_entry(ckpt, new["down"] + suffix, downs))
            for name in downs[1:]:
                replaced[name] += []
        elif downs and downs[0] != new["down"] + suffix:
            replaced[downs[0]].append(copy_entry(ckpt, downs[0], new["down"] + suffix))


def _fuse_biases(ckpt, f0: FFN, replaced, group: list[FFN], name: str, stacked: bool = False) -> None:
    has = [("gate_bias" in f.names, "up_bias" in f.names) for f in group]
    if not any(a or b for a, b in has):
        return
    if not all(a and b for a, b in has):
        raise LayoutError(f"{f0.ref}: gate and up must both have biases (or neither) to be fused")
    replaced[f0.names["gate_bias"]].append(
        _fuse_entry(ckpt, name, [(f.names["gate_bias"], f.names["up_bias"]) for f in group], f0.layout, True, stacked))
    for f in group:
        replaced[f.names["up_bias"]] += []


def _assemble(ckpt, ffns: FFNSet, replaced: dict[str, list[Entry]], command: str, changed: int,
              layout: GateUpLayout, *forms: tuple[list[FFN], str]) -> Plan:
    """The plan: replaced entries in input order, everything else copied; ``forms`` are (FFNs, the form they
    take), for the warning when the output's form is not the one its carried config.json loads."""
    entries: list[Entry] = []
    for name in ckpt:
        entries += replaced[name] if name in replaced else [copy_entry(ckpt, name)]
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise LayoutError(f"two output tensors would be named {e.name}; the input mixes forms")
        seen.add(e.name)
    summary = {"command": command, "input": str(ckpt.path), "scheme": ffns.scheme.name, "layout": layout.describe(),
               "ffns_changed": changed, "ffns_total": len(ffns.ffns), "tensors_in": len(ckpt),
               "tensors_out": len(entries), "bytes": sum(e.nbytes for e in entries),
               "warnings": [w] if (w := ffns.unmatched_warning()) else []}
    summary["form_changes"] = [(fs, form) for fs, form in forms if fs]
    changes = ["config.json: carried over unchanged (no config key records the gate/up layout)"] if ckpt.config else []
    return Plan(ckpt, entries, ckpt.config, changes, summary)


def default_output(path: Path, tag: str) -> Path:
    """A path that exists nowhere yet: model.split.safetensors beside a lone file; DIR-split/ beside a directory
    and beside a file that sits in a checkpoint directory (a config.json beside it): loaders read every
    *.safetensors of a directory, so a second weight file there would break the input for them."""
    path = Path(path).resolve()  # '.' has no name: resolve it first
    if path.is_file() and path.suffix == ".safetensors" and not (path.parent / "config.json").is_file():
        stem, suffix, parent = f"{path.stem}.{tag}", ".safetensors", path.parent
    else:
        d = path if path.is_dir() else path.parent
        stem, suffix, parent = f"{d.name}-{tag}", "", d.parent
    candidate, k = parent / f"{stem}{suffix}", 2
    while candidate.exists():
        candidate, k = parent / f"{stem}-{k}{suffix}", k + 1
    return candidate


def check_rewritable(ckpt: Checkpoint, command: str) -> None:
    """The rule of split-gateup and fuse-gateup, for the CLI and the Python API alike: they rewrite the tensors
    of a PyTorch checkpoint as stored, so other formats and MXFP4 experts are refused (exit 2).

    Raises:
        FFNToolsError: naming the format and the conversion to run first.
    """
    if not ckpt.rewritable:
        raise FFNToolsError(f"{ckpt.path}: is {ckpt.described} checkpoint; {command} works on PyTorch checkpoints: "
                            f"ffn-tools convert {ckpt.path} --to torch -o DIR first")
    by_scheme: dict = {}
    for m in quant.find(ckpt.stored).values():
        by_scheme.setdefault(m.scheme, []).append(m)
    for scheme, modules in by_scheme.items():
        scheme.check_rewritable(modules, ckpt.path, command)


def _run(command: str, plan_fn, source, out, *, scheme, layout, dry_run, force, max_shard_size, load_check,
         **kw) -> dict:
    """``source``: a path (opened here as PyTorch weights) or a checkpoint already open (the API's, any format)."""
    with ExitStack() as stack:
        ckpt = source if isinstance(source, Checkpoint) else stack.enter_context(open_checkpoint(Path(source)))
        path = Path(ckpt.path)
        check_rewritable(ckpt, command)
        ckpt = ckpt.stored  # tensors as stored: quantized parts move as they are
        packed = {n: m for n, m in quant.find(ckpt).items()  # FFNs found as read, parts moved by their scheme
                  if m.scheme.moves_parts}  # (FP8 weights and their scales: as fp8 moves them, below)
        seen = quant.DecodedView(ckpt, packed) if packed else ckpt
        plan = plan_fn(ckpt, find_ffns(seen, scheme, layout), **kw, **({"packed": packed} if packed else {}))
        out = Path(out) if out else default_output(path, "split" if command == "split-gateup" else "fused")
        check_shardable(out, max_shard_size)
        if max_shard_size is None and len(ckpt.files) > 1 and out.suffix != ".safetensors":
            max_shard_size = max(f.stat().st_size for f in ckpt.files)  # shard like the input
            plan.changes.append(f"shards of at most {human(max_shard_size)}, like the input's largest "
                                "(--max-shard-size to change)")
        summary = dict(plan.summary, output=str(out), dry_run=dry_run, changes=plan.changes,
                       plan=plan.describe() if dry_run else None)
        with ThreadPoolExecutor(1) as pool:  # the load check (importing transformers) overlaps the copy
            changed = summary.pop("form_changes")
            client = ckpt.format.client() if ckpt.format is not None and changed and load_check else None
            warning = pool.submit(client.load_warning, ckpt, plan, str(out)) if client else None
            if dry_run:
                check_output(out, [path, *ckpt.files], force)
            else:
                summary["files"] = execute(plan, out, force=force, max_shard_size=max_shard_size, desc=command)
            if warning is not None and (w := warning.result()):
                summary["warnings"] = [*summary["warnings"], w]
        return summary


def split_gateup(path, out=None, *, scheme: Scheme | None = None, layout: GateUpLayout | None = None,
                 dry_run: bool = False, force: bool = False, max_shard_size: int | None = None,
                 load_check: bool = False) -> dict:
    """Split every fused gate_up tensor of a checkpoint into gate and up projections.

    Args:
        path: a .safetensors file, an index, or a checkpoint directory.
        out: output file or directory; default beside the input (``model.split.safetensors``, ``DIR-split``).
        scheme: naming scheme (detected when None).
        layout: the layout the fused tensors are stored in (the scheme's when None).
        dry_run: plan only; nothing is written.
        force: replace an existing output.
        max_shard_size: bytes per output shard (directory outputs).
        load_check: check that transformers loads the planned output under the config.json it carries, and
            warn, naming what it would not load, where it does not (imports transformers: off by default,
            since split and fuse otherwise run at the speed of a copy without it).

    Returns:
        A summary: scheme, layout, counts, output path, files (and the plan lines when ``dry_run``).
    """
    return _run("split-gateup", plan_split, path, out, scheme=scheme, layout=layout, dry_run=dry_run,
                force=force, max_shard_size=max_shard_size, load_check=load_check)


def fuse_gateup(path, out=None, *, scheme: Scheme | None = None, layout: GateUpLayout | None = None,
                stack_experts: bool = False, dry_run: bool = False, force: bool = False,
                max_shard_size: int | None = None, load_check: bool = False) -> dict:
    """Fuse gate and up projections into one gate_up tensor per FFN (the inverse of ``split_gateup``).

    Args are as for ``split_gateup``, plus ``stack_experts``: stack routed experts into transformers-v5
    tensors ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I).
    """
    return _run("fuse-gateup", plan_fuse, path, out, scheme=scheme, layout=layout, dry_run=dry_run,
                force=force, max_shard_size=max_shard_size, load_check=load_check, stack_experts=stack_experts)
