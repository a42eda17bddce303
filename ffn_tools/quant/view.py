"""A checkpoint seen with its quantized modules decoded: each scheme's ``X.weight`` (or GPT-OSS's ``..._proj``)
read as the scheme defines its values, its stored parts hidden. ``quant.decoded`` builds it, the one place a
stored checkpoint becomes its decoded view."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..io.store import Checkpoint, TensorInfo
from .base import Module

if TYPE_CHECKING:
    import torch


class DecodedView(Checkpoint):
    """``ckpt`` with every module of ``found`` read decoded (see the module docstring)."""

    resolves_quantization = True

    def __init__(self, ckpt, found: dict[str, Module]):
        self.raw, self.modules = ckpt, found
        hidden = {p: m for m in found.values() for p in m.parts.values()}
        infos = {}
        for name in ckpt:
            m = hidden.get(name)
            if m is None:
                infos[name] = ckpt.info(name)
            elif name == m.packed:  # the decoded weight takes the place of the part holding its codes
                infos[m.weight] = TensorInfo(m.weight, m.dtype, m.shape, ckpt.info(name).file, None)
        super().__init__(ckpt.path, ckpt.root, ckpt.files, infos, ckpt.metadata, ckpt.config)
        self.view_of(ckpt)

    def _read(self, info: TensorInfo) -> "torch.Tensor":
        m = self.modules.get(info.name)
        if m is None:
            return self.raw[info.name]
        return m.scheme.decode(m, self.parts(info.name))

    def parts(self, name: str) -> dict[str, "torch.Tensor"]:
        """Module ``name``'s stored tensors by role."""
        return {p: self.raw[n] for p, n in self.modules[name].parts.items()}

    def quantized(self, name: str) -> Module | None:
        return self.modules.get(name)

    def quantized_parts(self, name: str):
        return self.parts(name) if name in self.modules else None

    def rebuilt_files(self):
        return self.raw.rebuilt_files()

    def carried_metadata(self):
        return self.raw.carried_metadata()

    @property
    def stored(self):
        """The checkpoint with its quantized parts as stored (what its clients load)."""
        return self.raw.stored

    @property
    def label(self) -> str:
        names = sorted({m.scheme.label_of(m) for m in self.modules.values()})
        return f"{self.raw.label}, {' + '.join(names)} read dequantized"

    def decoded(self) -> list[dict]:
        by_scheme: dict = {}
        for m in self.modules.values():
            by_scheme.setdefault(m.scheme, []).append(m)
        return [d for s, ms in by_scheme.items() for d in s.describe(ms)]

    def close(self) -> None:
        self.raw.close()
