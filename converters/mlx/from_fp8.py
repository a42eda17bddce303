"""FP8 block-scaled weights exported as MLX mxfp8, codes kept, where their scales are powers of two.

An FP8 block-scaled weight (``quant.fp8``: DeepSeek's ``weight_scale_inv`` per 128 x 128 or 32 x 32 block, a
per-row ``weight_scale``) reads ``w = e4m3 * s``. MLX's mxfp8 reads ``w = e4m3 * 2^(e - 127)`` per 32 values of a
row, its E4M3 codes packed four to a uint32 (element i at bit ``8 i``, the bytes as stored) and ``e`` a uint8
(E8M0). So where every scale is a power of two (UE8M0 scales, ``scale_fmt: ue8m0``) and a block's columns are a
multiple of 32, each group of 32 takes its block's exponent and the codes are the stored bytes: MLX's values are
the source's exactly (an E4M3 value times a power of two is exact in bfloat16 and float32). Anything else is
written dequantized, as before (``modules`` leaves it out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ffn_tools.io.raw import RawTensor
from ffn_tools.plan import Entry
from ffn_tools.quant import Module

if TYPE_CHECKING:
    import torch

FP8 = "fp8"  # the FP8 block scheme's name (``quant.fp8.FP8_BLOCKS``)
GROUP = 32


def holds(m: Module, parts) -> bool:
    """Whether MLX's mxfp8 holds ``m`` (an FP8 block module, its stored ``parts``) exactly (module doc)."""
    return m.scheme.name == FP8 and why_not(m, parts) is None


def why_not(m: Module, parts) -> str | None:
    """Why MLX's mxfp8 cannot hold FP8 block module ``m`` exactly (its stored ``parts``), or None where it can."""
    import torch

    if parts is None or len(m.shape) != 2:
        return "stacked or unreadable parts"
    if m.args.dtype != "F8_E4M3":
        return f"{m.args.dtype} codes, not E4M3"
    rows, cols = m.shape
    if cols % GROUP or (m.args.block[1] % GROUP and m.args.block[1] < cols):
        return f"blocks of {m.args.block[1]} columns, not a multiple of {GROUP}"
    s = parts["scale"].to(torch.float32)
    mant, exp = torch.frexp(s)
    if not bool(((s > 0) & torch.isfinite(s) & (mant == 0.5) & (exp - 1 >= -127) & (exp - 1 <= 127)).all()):
        return "scales not all powers of two (mxfp8's are E8M0)"
    return None


def exponents(m: Module, scale: "torch.Tensor") -> "torch.Tensor":
    """The E8M0 exponent of each group of 32 values of ``m``: uint8 (rows, cols / 32)."""
    import torch

    rows, cols = m.shape
    rb, cb = m.args.block
    s = scale.to(torch.float32)
    s = s[:, None] if s.dim() == 1 else s
    e = torch.frexp(s)[1] - 1 + 127  # s = 2^(e - 127)
    ri = torch.arange(rows) // rb
    ci = (torch.arange(cols // GROUP) * GROUP) // cb
    return e[ri][:, ci].to(torch.uint8)


def part(m: Module, parts, i: int):
    """Part ``i`` of ``m`` as mxfp8: 0 the E4M3 bytes as uint32 words, 1 the E8M0 exponents."""
    import torch

    rows, cols = m.shape
    if i == 0:
        return RawTensor("U32", (rows, cols // 4), parts["weight"].contiguous().view(torch.uint8).numpy().tobytes())
    return exponents(m, parts["scale"])


def entries(path: str, m: Module, op) -> list[Entry]:
    """``path``'s weight (uint32 words) and scales (uint8), made by ``op(i)`` (``from_ct.KeptCodes``)."""
    rows, cols = m.shape
    how = f"FP8 {m.args.block[0]}x{m.args.block[1]} codes kept as MLX mxfp8"
    return [Entry(f"{path}.weight", "U32", (rows, cols // 4), (), (op(0),), text=f"{m.weight}'s E4M3 bytes ({how})"),
            Entry(f"{path}.scales", "U8", (rows, cols // GROUP), (), (op(1),), reads=0,
                  text=f"{m.parts['scale']}'s powers of two as E8M0, one per 32 values ({how})")]
