"""Decoders of the stored parts ``ctensors`` finds: each format's own definition of its values.

    pack-quantized   (q - z) * s in the scale's dtype        (compressed-tensors' decompress and _dequantize)
    float-quantized  fp8 * s, rounded to the scale's dtype   (``scales.dequantize``, shared with other FP8)
    NVFP4            ``nvfp4.dequantize``                     (compressed-tensors' and ModelOpt's conventions)
    GPTQ, AWQ        ``gptq.dequantize``

and compressed-tensors' round-to-nearest (``quantize``), which verify replays against B's codes (``ctcheck``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import gptq, nvfp4

if TYPE_CHECKING:
    import torch

    from .ctensors import Module


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
    return unpack(stored.T.contiguous(), m.scheme.bits, m.shape[0]).T


def dequantize(m: "Module", parts: dict[str, "torch.Tensor"]) -> "torch.Tensor":
    """``w = (q - z) * s`` in the scale's dtype, group by group (compressed-tensors' definition).

    Args:
        parts: the module's stored tensors by suffix.
    """
    if m.scheme.format in gptq.METHODS:
        return gptq.dequantize(m, parts)
    if m.scheme.float8:  # today's FP8 definition (float64 products), rounded to the scale's dtype as
        from .scales import dequantize as scaled  # compressed-tensors' x.to(scale.dtype) * scale rounds them

        return scaled(parts["weight"], parts["weight_scale"]).to(parts["weight_scale"].dtype)
    if m.scheme.nvfp4:
        per = m.per_tensor or ""
        return nvfp4.dequantize(nvfp4.unpack(parts["weight_packed" if "weight_packed" in parts else "weight"]),
                                parts["weight_scale"], parts[per], m.scheme.format == nvfp4.MODELOPT)
    rows, cols = m.shape
    scale = parts["weight_scale"]
    q = unpack(parts["weight_packed"], m.scheme.bits, cols)
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

    if m.scheme.nvfp4:
        return nvfp4.quantize(weight, parts["weight_scale"], parts[m.per_tensor or ""], m.scheme.format == nvfp4.MODELOPT)
    if m.scheme.format in gptq.METHODS:  # round-to-nearest as AutoGPTQ/AutoAWQ: clamp(round(w / s) + z, 0, 15)
        _, z, gi = gptq.codes(m, parts)
        s = parts["scales"].T.to(torch.float32)
        return torch.clamp(torch.round(weight.to(torch.float32) / s[:, gi]) + z[:, gi], 0, 15).to(torch.int16)
    rows, cols = m.shape
    scale = parts["weight_scale"]
    g = scale.shape[-1] if scale.dim() == 2 else 1
    x = weight.reshape(rows, g, cols // g) / (scale.reshape(-1, g, 1) if scale.dim() == 2 else scale.reshape(1, 1, 1))
    if "weight_zero_point" in parts:
        x = x + zero_points(m, parts["weight_zero_point"]).to(x.dtype).reshape(rows, g, 1)
    lo, hi = -(1 << (m.scheme.bits - 1)), (1 << (m.scheme.bits - 1)) - 1
    return torch.round(torch.clamp(x, lo, hi)).reshape(rows, cols).to(torch.int8)


def codes(m: "Module", parts: dict[str, "torch.Tensor"]) -> "torch.Tensor":
    """The module's stored codes (rows, cols): int8, GPTQ's and AWQ's unsigned (int16)."""
    if m.scheme.nvfp4:  # signed places on the E2M1 grid
        return nvfp4.steps(parts["weight_packed" if "weight_packed" in parts else "weight"])
    if m.scheme.format in gptq.METHODS:
        import torch

        return gptq.codes(m, parts)[0].to(torch.int16)
    return unpack(parts["weight_packed"], m.scheme.bits, m.shape[1])
