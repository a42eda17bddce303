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

from .io.store import Checkpoint, TensorInfo

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


class Mxfp4View(Checkpoint):
    """``ckpt`` with every MXFP4 pair seen as its dequantized bf16 tensor (see the module doc)."""

    resolves_quantization = True

    def __init__(self, ckpt):
        self.raw, self.packed = ckpt, pairs(ckpt)
        self.format = ckpt.format
        hidden = {n for p in self.packed.values() for n in p}
        infos = {}
        for name in ckpt:
            base = name[: -len("_blocks")] if name.endswith("_blocks") else None
            if base in self.packed:
                b = ckpt.info(name).shape
                infos[base] = TensorInfo(base, "BF16", (*b[:-3], b[-2] * b[-1] * 2, b[-3]), ckpt.info(name).file, None)
            elif name not in hidden:
                infos[name] = ckpt.info(name)
        config = dict(ckpt.config or {})
        super().__init__(ckpt.path, ckpt.root, ckpt.files, infos, ckpt.metadata, config)

    def _read(self, info: TensorInfo):
        if info.name not in self.packed:
            return self.raw[info.name]
        blocks, scales = self.packed[info.name]
        return dequantize(self.raw[blocks], self.raw[scales])

    def quant_params(self, name: str) -> dict | None:
        """MXFP4's 4 bits per value in groups of 32 (verify's 4-bit tolerance row against an unquantized twin)."""
        return {"bits": 4, "group_size": GROUP, "mode": "mxfp4"} if name in self.packed else None

    @property
    def stored(self):
        """The checkpoint with its ``_blocks``/``_scales`` as stored (what transformers and mlx_lm load)."""
        return self.raw

    @property
    def label(self) -> str:
        return f"{self.raw.label}, MXFP4 read dequantized"

    def decoded(self) -> list[dict]:
        return [{"dtype": "MXFP4", "scales": "scales", "block": [1, GROUP], "weights": len(self.packed),
                 "how": "read dequantized, exactly (bf16)"}]

    def close(self) -> None:
        self.raw.close()
