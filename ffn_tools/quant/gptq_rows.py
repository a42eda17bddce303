"""split-gateup and fuse-gateup of GPTQ and AWQ modules: their parts move with the weight's output columns.

GPTQ and AWQ store a Linear transposed, (in, out): gate's and up's output rows are ``qweight``'s, ``qzeros``'
and ``scales``' *columns*. ``scales`` (groups, out) has one column per output row; ``qweight`` (AWQ: (in,
out / 8)) and ``qzeros`` (groups, out / 8) hold 8 output columns per int32 word, so a gate/up boundary must
fall on a word boundary (I a multiple of 8 in a concat layout); where it does not, no exact split of the words
exists and the command refuses, with the numbers. GPTQ's ``qweight`` (in / 8, out) packs input rows, so its
output columns move one for one. ``g_idx`` (in,) names input rows' groups: split, each half keeps it; fused,
gate's and up's must be the same (GPTQ orders by the layer input, which gate and up share), else refused.
"""

from __future__ import annotations

from ..errors import LayoutError
from ..layouts import GateUpLayout
from ..ops import Copy
from ..plan import Entry, source
from ..stacks import fuse_ops, split_ops
from .base import check_pair
from .fp8 import fits

WORDS = ("qzeros",)  # 8 output columns per word (AWQ's qweight too)


def _packs_columns(fmt: str, suffix: str) -> bool:
    return suffix in WORDS or (fmt == "awq" and suffix == "qweight")


def _check_words(m, out_rows: int, layout: GateUpLayout, verb: str) -> None:
    for suffix, name in m.parts.items():
        if _packs_columns(m.args.format, suffix) and (not fits(layout, out_rows, out_rows // 8) or out_rows % 16):
            half = out_rows // 2
            raise LayoutError(f"{name}: {m.args.name} packs 8 output columns per int32 word, and the "
                              f"{layout.describe()} gate/up boundaries of {out_rows} output rows ({half} each, "
                              f"{half / 8:g} words) do not fall on word boundaries: no exact {verb} of the words exists")


def _columns(ckpt, name: str, src: tuple[str, ...], shape: tuple[int, ...], dtype: str, k: int | None,
             layout: GateUpLayout, note: str) -> Entry:
    """Half ``k`` of ``src[0]``'s columns, or (``k`` None) gate's and up's columns fused: the layout on the
    columns (the output rows of a Linear stored (in, out)), fuse's definition or its reverse."""
    columns = layout.oriented(layout.axis == "rows")  # the stored tensor's other axis (the transposed Linear's)
    made = fuse_ops(columns, name=name) if k is None else split_ops(columns, k, name=src[0])
    return Entry(name, dtype, shape, src, made, sources=tuple(source(ckpt, n) for n in src), text=note)


def _kept(ckpt, name: str, src: str, note: str) -> Entry:
    info = ckpt.info(src)
    return Entry(name, info.st_dtype, info.shape, (src,), (Copy(),), sources=(source(ckpt, src),), text=note)


def split_entries(m, layout: GateUpLayout, new: dict[str, str], ckpt) -> dict[str, list[Entry]]:
    rows, _ = m.shape
    layout.segments(rows)
    _check_words(m, rows, layout, "split")
    out: dict[str, list[Entry]] = {}
    for suffix, src in m.parts.items():
        info = ckpt.info(src)
        out[src] = []
        for k, role in enumerate(("gate", "up")):
            name = new[role][: -len("weight")] + suffix
            if suffix == "g_idx":
                out[src].append(_kept(ckpt, name, src, f"{src} (input rows' groups: each half keeps them)"))
                continue
            shape = (info.shape[0], info.shape[1] // 2)
            out[src].append(_columns(ckpt, name, (src,), shape, info.st_dtype, k, layout,
                                     f"{role} columns of {src} ({layout.describe()})"))
    return out


def fuse_entries(g, u, layout: GateUpLayout, name: str, ckpt) -> list[Entry]:
    import torch

    check_pair(g, u)
    rows, _ = g.shape
    layout.segments(2 * rows)
    _check_words(g, 2 * rows, layout, "fuse")
    base, out = name[: -len("weight")], []
    for suffix in g.parts:
        a, b = g.parts[suffix], u.parts[suffix]
        info = ckpt.info(a)
        if suffix == "g_idx":
            ga, gb = ckpt[a], ckpt[b]
            if not torch.equal(ga, gb):
                raise LayoutError(f"{a} and {b} differ in {int((ga != gb).sum())} of {ga.numel()} input rows' groups: "
                                  "one fused tensor has one g_idx, so no exact fuse exists")
            out.append(_kept(ckpt, base + suffix, a, f"{a} (gate's and up's, equal)"))
            continue
        out.append(_columns(ckpt, base + suffix, (a, b), (info.shape[0], info.shape[1] * 2), info.st_dtype, None, layout,
                            f"fuse(columns of {a} + {b}; {layout.describe()})"))
    return out
