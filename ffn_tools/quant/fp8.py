"""FP8 block-scaled weights (the ``FP8_BLOCKS`` scheme): scales that travel with a weight.

DeepSeek-V3, Qwen3-FP8 and Llama-4 FP8 store a projection ``X.weight`` as ``F8_E4M3`` beside
``X.weight_scale_inv``, one float per block of rows and columns (128 x 128 there), by which the 8-bit values
are multiplied; compressed-tensors checkpoints store ``X.weight_scale`` per row (a block of one row and all
columns). A scale has as many rows as the weight has row blocks, so splitting a fused ``gate_up`` or fusing
gate and up moves the scale's rows with the weight's when every gate/up run of the layout starts and ends on
a block boundary (``fits``); otherwise the command refuses, since no exact split exists. Every command but
verify keeps them as stored (convert writes the FP8 bytes and their scales); verify reads them dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LayoutError
from ..layouts import GateUpLayout
from ..tolerances import FP8_ROW_BITS
from .base import Module, QuantScheme

SUFFIXES = ("_scale_inv", "_scale")  # after the weight's name: X.weight_scale_inv, X.weight_scale
FP8 = ("F8_E4M3", "F8_E5M2")


def companions(ckpt, weight: str) -> dict[str, str]:
    """suffix -> name of each scale ``ckpt`` holds for tensor ``weight``."""
    return {s: weight + s for s in SUFFIXES if weight + s in ckpt}


def is_companion(name: str, tensors) -> bool:
    """Whether ``name`` is the scale of one of ``tensors``."""
    return any(name.endswith(s) and name[: -len(s)] in tensors for s in SUFFIXES)


def rows(shape: tuple[int, ...], stacked: bool) -> int:
    """The row count of a weight or scale (dim 1 of experts stacked on dim 0)."""
    return shape[1] if stacked else shape[0]


def fits(layout: GateUpLayout, weight_rows: int, scale_rows: int) -> bool:
    """Whether the layout's gate/up runs over ``weight_rows`` fused rows fall on the scale's row blocks."""
    if scale_rows <= 0 or weight_rows % scale_rows:
        return False
    block = weight_rows // scale_rows
    try:
        w, s = layout.segments(weight_rows), layout.segments(scale_rows)
    except LayoutError:
        return False
    return len(w) == len(s) and all(a[0] == b[0] and a[1] == b[1] * block and a[3] == b[3] * block
                                    for a, b in zip(w, s))


def check(ckpt, weight: str, scale: str, layout: GateUpLayout, stacked: bool, fused_rows: int | None = None,
          transposed: bool = False) -> None:
    """Refuse a fused weight's scale that cannot be split (or scales that cannot be fused) exactly.

    Args:
        fused_rows: the fused row count when fusing (the weight is one half), else the weight's own.

    Raises:
        LayoutError: naming both tensors and why.
    """
    w, s = ckpt.info(weight).shape, ckpt.info(scale).shape
    if transposed:
        raise LayoutError(f"{scale}: scales of weights stored (in, out) are not supported; split or fuse the "
                          "dequantized checkpoint")
    wr = fused_rows if fused_rows is not None else rows(w, stacked)
    sr = rows(s, stacked) * (2 if fused_rows is not None else 1)
    if not fits(layout, wr, sr):
        raise LayoutError(f"{scale} {list(s)}: its row blocks do not fall on the {layout.describe()} gate/up "
                          f"boundaries of {weight} {list(w)} ({wr} rows over {sr} scale rows), so no exact split "
                          "of the scale exists")
    given = config_block(ckpt)
    read = given is not None and sr in (-(-wr // given[0]), 2 * -(-(wr // 2) // given[0]))  # the config's block
    if given is not None and read and any(sg[1] % given[0] or sg[3] % given[0] for sg in layout.segments(wr)):
        # a gate/up run not of whole blocks: rows / scales is not the block the config reads
        raise LayoutError(f"{scale} {list(s)}: the {layout.describe()} gate/up runs of {wr} fused rows are not "
                          f"whole blocks of the config's weight_block_size {list(given or ())} (a partial last "
                          f"block), so no exact {'fuse' if fused_rows is not None else 'split'} of the scale exists")


def config_block(ckpt) -> tuple[int, int] | None:
    """The config's ``quantization_config.weight_block_size`` (rows, columns each scale covers), or None."""
    q = (ckpt.config or {}).get("quantization_config") or {}
    b = q.get("weight_block_size") if isinstance(q, dict) else None
    return (int(b[0]), int(b[1])) if isinstance(b, list) and len(b) == 2 else None


def dequantize(weight, scale, blocks: tuple[int, int] | None = None):
    """``weight`` (any float dtype, FP8 included) times its block scale, in float64; ``blocks``: the rows and
    columns each scale covers (None: ``block`` of the shapes)."""
    import torch

    w = weight.to(torch.float64)
    s = scale.to(torch.float64)
    if s.dim() == 1:
        s = s[:, None]
    rb, cb = blocks or block(tuple(w.shape), tuple(s.shape))
    full = s.repeat_interleave(rb, dim=-2).repeat_interleave(cb, dim=-1)
    return w * full[..., : w.shape[-2], : w.shape[-1]]


DECODE_BYTES = 64 << 20  # float32 output a decode makes at a time (``decode``), its scales' copy as large again
NARROW = ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "bfloat16", "float16", "float32")  # held by float32


def decode(weight, scale, blocks: tuple[int, int] | None = None):
    """``dequantize(weight, scale, blocks)`` rounded to float32, bit for bit, made a strip of row blocks at a time.

    Where weight and scale are no wider than float32 (FP8 codes, bfloat16, float32 scales), their product is
    exact in float64 (at most 24 + 24 significant bits), so rounding it to float32 is float32's own correctly
    rounded product: the strip is computed in float32 (what DeepSeek's ``weight_dequant`` and transformers' FP8
    dequantize compute), ``DECODE_BYTES`` of it at a time, into the float32 result. The whole-tensor float64 way
    held four times the result (a DeepSeek-V3 dense FFN's 18432 x 7168 weight: 3.2 GB for a 0.5 GB result). Wider
    inputs, and scales not laid out as the weight's blocks, take ``dequantize``."""
    import torch

    s = scale[:, None] if scale.dim() == 1 else scale
    if any(str(t.dtype).removeprefix("torch.") not in NARROW for t in (weight, s)) or not 2 <= s.dim() == weight.dim():
        return dequantize(weight, scale, blocks).to(torch.float32)
    w3 = weight.reshape(-1, *weight.shape[-2:])  # (stack, rows, cols): experts stacked on dim 0, or one weight
    s3 = s.reshape(-1, *s.shape[-2:])
    rows, cols = w3.shape[1:]
    rb, cb = blocks or block(tuple(w3.shape), tuple(s3.shape))  # rows and columns each scale covers
    out = torch.empty(w3.shape, dtype=torch.float32)
    step = max(1, DECODE_BYTES // (4 * max(1, cols) * rb)) * rb  # whole row blocks per strip
    for e in range(w3.shape[0]):
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            sc = s3[e, start // rb: -(-stop // rb)].to(torch.float32)
            sc = sc.repeat_interleave(rb, dim=0)[: stop - start].repeat_interleave(cb, dim=1)[:, :cols]
            torch.mul(w3[e, start:stop].to(torch.float32), sc, out=out[e, start:stop])
    return out.reshape(weight.shape)


@dataclass(frozen=True)
class Scaled:
    """An FP8-blocks module's own facts: the scale's suffix, the weight's stored dtype, the block each scale
    covers (rows, columns)."""

    suffix: str
    dtype: str
    block: tuple[int, int]


def block(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...],
          given: tuple[int, int] | None = None) -> tuple[int, int]:
    """Rows and columns of the weight each scale covers (a 1-D scale: one per row): ``given`` (the config's
    ``weight_block_size``) where it gives the scale's shape, else from the shapes (``_covers``)."""
    ws = weight_shape[-2:]
    ss = scale_shape[-2:] if len(scale_shape) >= 2 else (scale_shape[-1], 1)
    if len(ws) != 2:
        return (1, 1)
    if given is not None and all(-(-n // b) == k for n, k, b in zip(ws, ss, given)):
        return (int(given[0]), int(given[1]))
    return (_covers(ws[0], ss[0]), _covers(ws[1], ss[1]))


def _covers(n: int, k: int) -> int:
    """How many of ``n`` rows (columns) each of ``k`` scales covers: ``n / k`` where it divides; else the power of
    two that gives ``k`` blocks with a partial last one (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows over 5 scales
    of 128, where ``ceil(576 / 5)`` = 116 would shift every scale after the first), else ``ceil(n / k)``."""
    if k <= 1 or n % k == 0:
        return max(1, n // max(k, 1)) if k >= 1 else 1
    up = -(-n // k)
    p = 1 << (up - 1).bit_length()
    return p if -(-n // p) == k else up


class Fp8Blocks(QuantScheme):
    """A weight (FP8, or any float dtype) beside ``X.weight_scale_inv`` or ``X.weight_scale``: one float per block
    of rows and columns, read as their product rounded once to float32 (``decode``). Its tolerance row is
    ``tolerances.FP8_ROW_BITS`` bits (FP8's 3 mantissa bits) and its group the block's columns."""

    name, label, decoded_on_read, moves_parts = "fp8", "FP8", False, False

    def find(self, ckpt) -> dict[str, Module]:
        out = {}
        given = config_block(ckpt)
        for name in ckpt:
            found = companions(ckpt, name)
            if found and not is_companion(name, ckpt):
                suffix, scale = next(iter(found.items()))
                w, sc = ckpt.info(name), ckpt.info(scale)
                facts = Scaled(suffix, w.st_dtype, block(tuple(w.shape), tuple(sc.shape), given))
                out[name] = Module(name, self, {"weight": name, "scale": scale}, tuple(w.shape), "F32", facts)
        return out

    def decode(self, m: Module, parts):
        return decode(parts["weight"], parts["scale"], m.args.block)

    def exact_values(self, m: Module, parts):
        """The values a target keeping the codes and scales holds (MLX's mxfp8 where the scales are powers of two):
        each code times its block's scale, rounded once to float32 (``decode``: exact where the scales are)."""
        return decode(parts["weight"], parts["scale"], m.args.block) if parts is not None else None

    def params(self, m: Module) -> dict:
        return {"bits": FP8_ROW_BITS, "group_size": m.args.block[1], "mode": "fp8"}

    def describe(self, modules: list[Module]) -> list[dict]:
        """Grouped: weight dtype, scale suffix, block (rows x columns each scale covers), how many weights."""
        groups: dict[tuple, int] = {}
        for m in modules:
            key = (m.args.dtype, m.args.suffix.lstrip("_"), m.args.block)
            groups[key] = groups.get(key, 0) + 1
        return [{"dtype": d, "scales": sfx, "block": list(b), "weights": n} for (d, sfx, b), n in sorted(groups.items())]


FP8_BLOCKS = Fp8Blocks()
