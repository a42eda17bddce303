"""GGUF's quantized types as a quantization scheme (``GGUF_TYPES``), with their codes: what a GGUF's stored blocks
are to a target that keeps codes.

Every quantized type's blocks are ``Blocks`` (a GGUF output of the same type copies them byte for byte: GGUF to
GGUF from its codes, K-quants and i-quants too). Q8_0, Q4_0 and Q4_1 are integer codes in groups of 32 with a
float16 scale (``IntCodes``: Q8_0 ``d * q`` as codes ``q + 128`` with zero point 128, Q4_0 ``d * (n - 8)`` as
codes ``n`` with zero point 8, Q4_1 ``d * n + m`` as codes ``n`` with bias ``m``), which any target holding such
codes keeps (MLX's affine modes). A tensor's stored parts (``GGUFCheckpoint.quantized_parts``): ``blocks``, the
rows of its blocks as stored, in the order the weight reads (q/k rows put back in transformers' order, one
expert of a stack), ``scale``, the per-tensor multiplier beside an NVFP4 weight where there is one, and
``input_scale``, W4A4's activation scale beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ffn_tools import quant

if TYPE_CHECKING:
    import torch

# The bits whose tolerance row a GGUF type gets (``tolerances.QUANT_TOLERANCES``): its bits per weight,
# rounded down; ternary and 1-bit types the coarsest row.
TYPE_BITS = {"Q8_0": 8, "Q8_1": 8, "Q8_K": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q4_0": 4, "Q4_1": 4,
             "Q4_K": 4, "IQ4_NL": 4, "IQ4_XS": 4, "MXFP4": 4, "NVFP4": 4, "Q3_K": 3, "IQ3_XXS": 3, "IQ3_S": 3,
             "Q2_K": 2, "IQ2_XXS": 2, "IQ2_XS": 2, "IQ2_S": 2, "IQ1_S": 2, "IQ1_M": 2, "TQ1_0": 2, "TQ2_0": 2}
INT_TYPES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # the integer types read as IntCodes: bytes per block of 32


class GgufType(quant.QuantScheme):
    """GGUF's quantized types (Q8_0, Q4_K, IQ4_XS, ...), read dequantized by gguf-py's ``gguf.quants`` (the reader
    decodes them; a module's parameters are {bits: ``TYPE_BITS``, group_size: the type's block, mode: the type});
    their codes as the module doc says."""

    name, label = "gguf", "GGUF"

    def decode(self, m, parts):
        raise NotImplementedError("the GGUF reader decodes its tensors itself")

    def params(self, m) -> dict:
        return dict(m.args)

    def what(self, m) -> str:
        return f"GGUF {m.args['mode']}"

    def blocks(self, m, parts) -> quant.Blocks | None:
        if not parts or "blocks" not in parts:
            return None
        scale, act = parts.get("scale"), parts.get("input_scale")
        return quant.Blocks(self.name, m.args["mode"], parts["blocks"], int(m.args["group_size"]),
                            float(scale) if scale is not None else None, float(act) if act is not None else None)

    def int_codes(self, m, parts) -> quant.IntCodes | None:
        if not parts or "blocks" not in parts or m.args["mode"] not in INT_TYPES or "scale" in parts:
            return None
        return int_codes(m.args["mode"], parts["blocks"])

    def exact_values(self, m, parts) -> "torch.Tensor | None":
        """The values the blocks define, as gguf-py's ``dequantize`` computes them (float32; times the per-tensor
        multiplier in float32, as llama.cpp multiplies): what a GGUF of the same blocks reads."""
        b = self.blocks(m, parts)
        return None if b is None else values(b, tuple(m.shape))


GGUF_TYPES = quant.register(GgufType())


def int_codes(qtype: str, rows: "torch.Tensor") -> quant.IntCodes:
    """Q8_0, Q4_0 or Q4_1 blocks (``rows``: (rows, row bytes) uint8) as ``IntCodes`` (module doc)."""
    import torch

    n = rows.shape[0]
    b = rows.reshape(n, -1, INT_TYPES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
    if qtype == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).reshape(n, -1).to(torch.int16) + 128
        return quant.IntCodes(q, torch.full_like(d, 128, dtype=torch.int16), d, 32, 8)
    qs = b[..., 4 if qtype == "Q4_1" else 2:].to(torch.int16)  # byte j: value j low, value j + 16 high
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, -1)
    if qtype == "Q4_0":
        return quant.IntCodes(codes, torch.full_like(d, 8, dtype=torch.int16), d, 32, 4)
    m = b[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
    return quant.IntCodes(codes, None, d, 32, 4, bias=m)


def values(b: quant.Blocks, shape: tuple) -> "torch.Tensor":
    """``b``'s values as gguf-py dequantizes them, times its multiplier (float32), in ``shape``."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    x = quants.dequantize(b.rows.numpy(), GGMLQuantizationType[b.type]).astype(np.float32, copy=False)
    if b.multiplier is not None:
        x = x * np.float32(b.multiplier)
    return torch.from_numpy(np.ascontiguousarray(x).reshape(shape))
