"""split-gateup and fuse-gateup of compressed-tensors modules: the stored parts move with the weight's rows.

A pack-quantized weight packs its codes along each row (``weight_packed``), and its scales are per row
(``weight_scale`` (rows, groups)), so gate and up rows of a fused ``gate_up`` move exactly as rows, with
their scales: a scale group never spans two rows. Zero points are packed *down* the rows, ``32 / bits`` rows
to an int32 word (3, 5, 6 and 7 bits straddle words), so a gate/up boundary must fall on a word boundary of
the zero points; where it does not (I = 92 rows at 4 bits: 11.5 words), no exact split of the words exists
and the command refuses, with the numbers. A per-tensor scale is one number: split, each half keeps it (two, one per half of the rows: each half takes its
own, ``nvfp4.per_row``, in the concatenated layout only);
fused, gate's and up's must be the same number, else the fused tensor would need one scale for two.
``weight_shape`` is written for the new rows. The output's module names must resolve, under the config's
``quantization_config`` (carried unchanged), to the scheme their parts are stored in.
"""

from __future__ import annotations

import dataclasses

from ..errors import LayoutError
from ..layouts import CONCAT, GateUpLayout
from ..ops import Const, Copy, Rows
from ..plan import Entry, source
from ..stacks import fuse_ops, split_ops
from .base import Module, check_pair
from .ctconfig import PER_TENSOR
from .fp8 import fits


def _zero_point_check(m: Module, fused_rows: int, layout: GateUpLayout, verb: str) -> None:
    words = -(-fused_rows * m.args.bits // 32)
    if not fits(layout, fused_rows, words) or fused_rows * m.args.bits % 32:
        half = fused_rows // 2
        raise LayoutError(
            f"{m.base}.weight_zero_point: {m.args.name} packs {32 / m.args.bits:g} rows of zero points per "
            f"int32 word, and the {layout.describe()} gate/up boundaries of {fused_rows} rows ({half} each, "
            f"{half * m.args.bits / 32:g} words) do not fall on word boundaries: no exact {verb} of the packed "
            "zero points exists")


def _shape_entry(name: str, rows: int, cols: int, src: str) -> Entry:
    return Entry(name, "I64", (2,), (src,), (Const((rows, cols), "I64"),), text=f"[{rows}, {cols}] (the new rows)")


def split_entries(m: Module, layout: GateUpLayout, new: dict[str, str], ckpt) -> dict[str, list[Entry]]:
    """Input part name -> entries writing gate's and up's parts (``new``: role -> output ``X.weight``).

    Raises:
        LayoutError: zero point words straddling the boundary, or output names the config does not quantize.
    """
    rows, cols = m.shape
    layout.segments(rows)  # odd rows, a --tp not dividing: LayoutError
    for role in ("gate", "up"):
        m.scheme.check_target(ckpt, new[role][: -len(".weight")], m)
    if "weight_zero_point" in m.parts:
        _zero_point_check(m, rows, layout, "split")
    out: dict[str, list[Entry]] = {}
    for suffix, src in m.parts.items():
        out[src] = []
        for k, role in enumerate(("gate", "up")):
            name = new[role][: -len("weight")] + suffix
            if suffix == "weight_shape":
                out[src].append(_shape_entry(name, rows // 2, cols, src))
            elif suffix in PER_TENSOR and tuple(ckpt.info(src).shape) == (2,):  # one per half (nvfp4.per_row)
                if not layout.same_arrangement(CONCAT):
                    raise LayoutError(f"{src}: one global scale per half of the rows, which the "
                                      f"{layout.describe()} layout does not split into gate and up")
                info = ckpt.info(src)
                out[src].append(Entry(name, info.st_dtype, (1,), (src,), (Rows(k, 1),), sources=(source(ckpt, src),),
                                      text=f"{src}[{k}] ({role}'s own global scale)"))
            elif suffix in PER_TENSOR or (suffix == "weight_scale" and m.args.strategy == "tensor"):
                out[src].append(_kept(ckpt, name, src, f"{src} (one number: each half keeps it)"))
            else:
                out[src].append(_rows_entry(name, src, k, layout))
        out[src] = finish(out[src], ckpt)
    return out


def _kept(ckpt, name: str, src: str, note: str) -> Entry:
    """``src`` as it is, under ``name`` (a per-tensor number both halves keep)."""
    info = ckpt.info(src)
    return Entry(name, info.st_dtype, info.shape, (src,), (Copy(),), sources=(source(ckpt, src),), text=note)


def _rows_entry(name: str, src: str, k: int, layout: GateUpLayout) -> Entry:
    """Half ``k`` of ``src``'s rows per ``layout`` (fuse reversed); shape and dtype filled in by ``finish``."""
    return Entry(name, None, (), (src,), split_ops(layout, k, name=src),
                 text=f"{'gate' if k == 0 else 'up'} rows of {src} ({layout.describe()})")


def finish(entries: list[Entry], ckpt) -> list[Entry]:
    """Dtypes and shapes of the row entries, from the inputs' headers (without reading them)."""
    out = []
    for e in entries:
        if e.dtype is None:
            infos = [ckpt.info(n) for n in e.inputs]
            shape = list(infos[0].shape)
            shape[0] = shape[0] // 2 if len(infos) == 1 else shape[0] * 2
            e = dataclasses.replace(e, dtype=infos[0].st_dtype, shape=tuple(shape),
                                    sources=tuple((i.st_dtype, tuple(i.shape)) for i in infos))
        out.append(e)
    return out


def fuse_entries(g: Module, u: Module, layout: GateUpLayout, name: str, ckpt) -> list[Entry]:
    """Entries writing the fused module ``name`` (``X.weight``) from gate's and up's parts.

    Raises:
        LayoutError: different schemes or shapes, a per-tensor scale that differs, zero point words that
            would straddle the boundary, an output name the config does not quantize.
    """
    import torch

    check_pair(g, u)
    rows, cols = g.shape
    g.scheme.check_target(ckpt, name[: -len(".weight")], g)
    layout.segments(2 * rows)
    if "weight_zero_point" in g.parts:
        _zero_point_check(g, 2 * rows, layout, "fuse")
    out = []
    base = name[: -len("weight")]
    for suffix in g.parts:
        a, b = g.parts[suffix], u.parts[suffix]
        if suffix == "weight_shape":
            out.append(_shape_entry(base + suffix, 2 * rows, cols, a))
        elif suffix in PER_TENSOR or (suffix == "weight_scale" and g.args.strategy == "tensor"):
            sa, sb = ckpt[a], ckpt[b]
            if sa.dtype != sb.dtype or not torch.equal(sa.reshape(-1).view(torch.uint8), sb.reshape(-1).view(torch.uint8)):
                what = "global scales" if suffix in PER_TENSOR else "per-tensor scales"
                raise LayoutError(f"{a} = {sa.item()} and {b} = {sb.item()}: {what} that differ (ratio "
                                  f"{sb.item() / sa.item():.6g}); the fused tensor would need one {what[:-1]} for two, "
                                  "and taking either (or their max) changes the other half's values, so no exact fuse "
                                  "exists (re-quantizing one half is not done here)")
            out.append(_kept(ckpt, base + suffix, a, f"{a} (gate's and up's, equal)"))
        else:
            out.append(Entry(base + suffix, None, (), (a, b), fuse_ops(layout, name=name),
                             text=f"fuse({a} + {b}; {layout.describe()})"))
    return finish(out, ckpt)
