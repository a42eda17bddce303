"""A checkpoint seen with its quantized modules (``ctensors.modules``: compressed-tensors, ModelOpt NVFP4,
GPTQ, AWQ) read dequantized by their own definitions (``ctdecode``), their stored parts hidden."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import nvfp4
from .ctdecode import dequantize
from .ctensors import FLOAT8, PACKED, Module, Scheme, modules
from .io.store import Checkpoint, TensorInfo

if TYPE_CHECKING:
    import torch


class CompressedView(Checkpoint):
    """``ckpt`` with each pack-quantized module's ``X.weight`` read dequantized (see the module doc)."""

    resolves_quantization = True

    def __init__(self, ckpt, found: dict[str, Module]):
        self.raw, self.modules = ckpt, found
        self.format = ckpt.format
        hidden = {p for m in found.values() for p in m.parts.values()}
        infos = {}
        for name in ckpt:
            if name in hidden:
                m = found.get(name.rsplit(".", 1)[0] + ".weight")
                if m is not None and name == m.packed:
                    dtype = "BF16" if m.scheme.nvfp4 else ckpt.info(m.parts.get("weight_scale") or m.parts["scales"]).st_dtype
                    infos[m.weight] = TensorInfo(m.weight, dtype, m.shape, ckpt.info(name).file, None)
            else:
                infos[name] = ckpt.info(name)
        super().__init__(ckpt.path, ckpt.root, ckpt.files, infos, ckpt.metadata, ckpt.config)

    def _read(self, info: TensorInfo):
        m = self.modules.get(info.name)
        if m is None:
            return self.raw[info.name]
        return dequantize(m, {p: self.raw[n] for p, n in m.parts.items()})

    def parts(self, name: str) -> dict[str, "torch.Tensor"]:
        """Module ``name``'s stored tensors by suffix."""
        return {p: self.raw[n] for p, n in self.modules[name].parts.items()}

    def quant_params(self, name: str) -> dict | None:
        """The module's bits and group (a channel's columns), for verify's tolerance row."""
        m = self.modules.get(name)
        if m is None:
            return None
        if m.scheme.float8:
            from .tolerances import FP8_ROW_BITS

            return {"bits": FP8_ROW_BITS, "group_size": m.scheme.group_size or m.shape[1], "mode": "fp8"}
        return {"bits": m.scheme.bits, "group_size": m.scheme.group_size or m.shape[1],
                "mode": m.scheme.format if m.scheme.format != PACKED else
                f"compressed-tensors {'symmetric' if m.scheme.symmetric else 'asymmetric'}"}

    @property
    def stored(self):
        """The checkpoint with its packed parts as stored (what compressed-tensors and vLLM load)."""
        return self.raw.stored

    @property
    def label(self) -> str:
        family = {nvfp4.MODELOPT: "ModelOpt NVFP4", "gptq": "GPTQ", "awq": "AWQ"}
        names = sorted({family.get(m.scheme.format, "compressed-tensors") for m in self.modules.values()})
        return f"{self.raw.label}, {' + '.join(names)} read dequantized"

    def decoded(self) -> list[dict]:
        first: dict[Scheme, Module] = {}
        counts: dict[Scheme, int] = {}
        for m in self.modules.values():
            first.setdefault(m.scheme, m)
            counts[m.scheme] = counts.get(m.scheme, 0) + 1
        how = {PACKED: "(q - z) * s in the scale's dtype", FLOAT8: "fp8 times its scale, in the scale's dtype",
               nvfp4.CT_FORMAT: "e2m1 * scale / global scale, to bfloat16",
               nvfp4.MODELOPT: "e2m1 * scale * scale_2, to bfloat16", "gptq": "scales * (q - (qzeros + 1)) by g_idx",
               "awq": "scales * (q - qzeros), GEMM packing order"}
        out = []
        for s, n in sorted(counts.items(), key=lambda kv: kv[0].name):
            m = first[s]
            cols = s.group_size or (m.shape[1] if s.strategy != "tensor" else m.shape[1])
            rows = m.shape[0] if s.strategy == "tensor" else 1
            out.append({"dtype": s.name, "scales": "weight_scale", "block": [rows, cols], "weights": n, "scheme": s.name,
                        "group": s.group, "how": f"read dequantized as {s.format} defines it: {how[s.format]}"})
        return out

    def close(self) -> None:
        self.raw.close()


def view(ckpt) -> Checkpoint:
    """``ckpt`` seen dequantized where compressed-tensors packed it, else ``ckpt`` itself.

    Raises:
        CheckpointError: see ``modules``.
    """
    found = modules(ckpt)
    return CompressedView(ckpt, found) if found else ckpt
