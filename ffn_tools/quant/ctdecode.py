"""compressed-tensors' ``pack-quantized`` int codes: unpacking and packing words, and its two definitions

    dequantize   (q - z) * s in the scale's dtype          (compressed-tensors' decompress and _dequantize)
    quantize     round(clamp(w / s + z)) in w's dtype      (its round-to-nearest, which verify replays: ``codes``)

(the other schemes' decoders are their own modules': ``fp8``, ``nvfp4``, ``gptq``, ``mxfp4``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .base import Module


def unpack(packed: "torch.Tensor", bits: int, n: int) -> "torch.Tensor":
    """The first ``n`` codes of each row of int32 ``packed``: element i at bit i * bits of the row's words
    (across word boundaries), minus 2^(bits-1), as int8 (compressed-tensors' ``unpack_from_int32``)."""
    import sys

    import torch

    if bits in (4, 8) and sys.byteorder == "little":  # codes never straddle a byte: read the bytes
        b = packed.reshape(-1).view(torch.uint8).reshape(*packed.shape[:-1], -1)  # (a size-1 dim's stride: any)
        c = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:-1], -1) if bits == 4 else b
        c = c if c.shape[-1] == n else c[..., :n]
        if bits == 4:  # 0..15 read as int8 are themselves: the offset in int8
            return c.view(torch.int8) - 8
        return (c.to(torch.int16) - 128).to(torch.int8)
    words = packed.to(torch.int64) & 0xFFFFFFFF  # unsigned 32-bit words
    start = torch.arange(n, dtype=torch.int64) * bits
    word, off = start // 32, start % 32
    low = words[..., word] >> off
    nxt = torch.clamp(word + 1, max=packed.shape[-1] - 1)
    high = torch.where(off + bits > 32, words[..., nxt] << (32 - off), torch.zeros_like(low))
    codes = (low | high) & ((1 << bits) - 1)
    return (codes - (1 << (bits - 1))).to(torch.int8)


def pack(codes: "torch.Tensor", bits: int) -> "torch.Tensor":
    """The inverse of ``unpack``: int8 codes (rows, n) -> int32 (rows, ceil(n * bits / 32))."""
    import torch

    n = codes.shape[-1]
    values = (codes.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    width = -(-n * bits // 32)
    out = torch.zeros((*codes.shape[:-1], width + 1), dtype=torch.int64)
    start = torch.arange(n, dtype=torch.int64) * bits
    word, off = start // 32, start % 32
    out.index_add_(-1, word, values << off)  # bits of distinct codes never overlap: the sum is their union
    spill = off + bits > 32
    out.index_add_(-1, word[spill] + 1, values[..., spill] >> (32 - off[spill]))
    out = out[..., :width] & 0xFFFFFFFF
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def zero_points(m: "Module", stored: "torch.Tensor") -> "torch.Tensor":
    """Packed zero points (words down the rows) -> int8 (rows, groups)."""
    return unpack(stored.T.contiguous(), m.args.bits, m.shape[0]).T


def dequantize(m: "Module", parts: dict[str, "torch.Tensor"]) -> "torch.Tensor":
    """``w = (q - z) * s`` in the scale's dtype, group by group (compressed-tensors' definition).

    Args:
        parts: the module's stored tensors by suffix.
    """
    rows, cols = m.shape
    scale = parts["weight_scale"]
    q = unpack(parts["weight_packed"], m.args.bits, cols)
    g = scale.shape[-1] if scale.dim() == 2 else 1
    x = q.reshape(rows, g, cols // g).to(scale.dtype)  # (rows, groups, group_size)
    s = scale.reshape(-1, g, 1) if scale.dim() == 2 else scale.reshape(1, 1, 1)
    if "weight_zero_point" in parts:
        x = x - zero_points(m, parts["weight_zero_point"]).to(scale.dtype).reshape(rows, g, 1)
    return (x * s).reshape(rows, cols)


def quantize(m: "Module", weight: "torch.Tensor", parts: dict[str, "torch.Tensor"]) -> "torch.Tensor":
    """``weight`` quantized with the module's stored scale and zero point: ``round(clamp(w / s + z))``, in the
    weight's dtype, as compressed-tensors' ``forward._quantize`` computes it; int8 codes (rows, cols)."""
    import torch

    rows, cols = m.shape
    scale = parts["weight_scale"]
    g = scale.shape[-1] if scale.dim() == 2 else 1
    x = weight.reshape(rows, g, cols // g) / (scale.reshape(-1, g, 1) if scale.dim() == 2 else scale.reshape(1, 1, 1))
    if "weight_zero_point" in parts:
        x = x + zero_points(m, parts["weight_zero_point"]).to(x.dtype).reshape(rows, g, 1)
    lo, hi = -(1 << (m.args.bits - 1)), (1 << (m.args.bits - 1)) - 1
    return torch.round(torch.clamp(x, lo, hi)).reshape(rows, cols).to(torch.int8)
