"""MXFP4 experts, as OpenAI ships GPT-OSS: ``X_blocks`` (E, rows, cols/32, 16) bytes holding two FP4 (E2M1)
values each, low nibble first, and ``X_scales`` (E, rows, cols/32), one E8M0 exponent (bias 127) per 32
values of a row.

They are read dequantized, as transformers' ``convert_moe_packed_tensors`` does: FP4 value times 2^exponent,
which bf16 holds exactly (FP4 has 2 significant bits), then transposed to the Hugging Face layout
``X`` (E, cols, rows). So a checkpoint with MXFP4 experts is seen as the bf16 GPT-OSS checkpoint it
encodes: every command reads its FFNs, verify compares them, ``convert --to torch`` writes that bf16
checkpoint losslessly. split/fuse refuse it: they rewrite tensors as stored, and no one reads split MXFP4.
"""

from __future__ import annotations

from .base import Module, QuantScheme

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale


def pairs(ckpt) -> dict[str, tuple[str, str]]:
    """base name -> (blocks, scales) for every ``base_blocks`` beside a ``base_scales``."""
    return {n[: -len("_blocks")]: (n, n[: -len("_blocks")] + "_scales") for n in ckpt
            if n.endswith("_blocks") and n[: -len("_blocks")] + "_scales" in ckpt}


def dequantize(blocks, scales, dtype=None):
    """(E, rows, G, 16) bytes and (E, rows, G) exponents -> (E, G * 32, rows) values (exact in bf16)."""
    import torch

    dtype = dtype or torch.bfloat16
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    *prefix, groups, width = blocks.shape
    b = blocks.to(torch.uint8).reshape(-1, width)
    out = torch.empty(b.shape[0], width * 2, dtype=dtype)
    out[:, 0::2] = lut[(b & 0x0F).long()]
    out[:, 1::2] = lut[(b >> 4).long()]
    out = torch.ldexp(out, scales.to(torch.int32).reshape(-1, 1) - 127).to(dtype)
    return out.reshape(*prefix, groups * width * 2).transpose(-1, -2).contiguous()


class Mxfp4(QuantScheme):
    """GPT-OSS's MXFP4 experts (see the module doc): ``base_blocks`` + ``base_scales`` read as bf16 ``base``."""

    name, label = "mxfp4", "MXFP4"

    def find(self, ckpt) -> dict[str, Module]:
        out = {}
        for base, (blocks, scales) in pairs(ckpt).items():
            b = ckpt.info(blocks).shape
            out[base] = Module(base, self, {"blocks": blocks, "scales": scales}, (*b[:-3], b[-2] * b[-1] * 2, b[-3]),
                               "BF16")
        return out

    def decode(self, m: Module, parts):
        return dequantize(parts["blocks"], parts["scales"])

    def params(self, m: Module) -> dict:
        """MXFP4's 4 bits per value in groups of 32 (verify's 4-bit tolerance row against an unquantized twin)."""
        return {"bits": 4, "group_size": GROUP, "mode": "mxfp4"}

    def describe(self, modules: list[Module]) -> list[dict]:
        return [{"dtype": "MXFP4", "scales": "scales", "block": [1, GROUP], "weights": len(modules),
                 "how": "read dequantized, exactly (bf16)"}]

    def check_rewritable(self, modules: list[Module], path, command: str) -> None:
        from ..errors import FFNToolsError

        raise FFNToolsError(f"{path}: {len(modules)} MXFP4 tensors ({modules[0].weight}_blocks/_scales, ...): "
                            f"{command} rewrites tensors as stored and nothing reads split MXFP4; `ffn-tools "
                            "convert PATH --to torch -o DIR` dequantizes them exactly (bf16), then split that")


MXFP4 = Mxfp4()
