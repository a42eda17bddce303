"""Hugging Face PyTorch checkpoints: safetensors (single or sharded) and weights-only pickles, read by the core's
lazy store (``ffn_tools.io.store``) and seen with their quantized weights decoded (``ffn_tools.quant``: MXFP4
experts, compressed-tensors, NVFP4, GPTQ, AWQ); written by ``export``; loaded by transformers (``client``)."""

from __future__ import annotations

from pathlib import Path

from ffn_tools import quant
from ffn_tools.mtp_option import OPTION as MTP
from ffn_tools.formats import Format
from ffn_tools.io.store import Checkpoint
from ffn_tools.io.readers import open_checkpoint

__all__ = ["FORMAT"]


class PyTorch(Format):
    name, extra = "torch", ""
    takes = frozenset({"dry_run"})
    options = (MTP,)  # --mtp keep|drop|only: the MTP heads (ffn_tools.mtp)
    partial_shards = True
    detect_order = 100  # the catch-all: anything no other format claims

    def can_read(self, path: Path) -> bool:
        """Anything ``open_checkpoint`` accepts; errors are left for ``open`` to report."""
        return True

    def read(self, path: Path, absent_shards: bool = False, like: Checkpoint | None = None) -> Checkpoint:
        """A PyTorch checkpoint opened lazily (``open_checkpoint``), its quantized weights decoded
        (``quant.decoded``: GPT-OSS's MXFP4 experts exactly, compressed-tensors as it dequantizes them, ...)."""
        ckpt = open_checkpoint(path, absent_shards)
        try:
            return quant.decoded(ckpt)
        except Exception:
            ckpt.close()
            raise

    def export(self, ckpt: Checkpoint, out: Path, **options) -> dict:
        from .export import export

        return export(ckpt, out, **options)

    def recipe(self, ckpt: Checkpoint, dtype: str | None, quantized: bool) -> dict | None:
        """Its dtype; None for a quantized one (ffn-tools writes no PyTorch quantization)."""
        return None if quantized or dtype is None else {"dtype": dtype}

    runtimes = ("transformers",)

    def load_runtime(self, name: str):
        from .client import Transformers

        return Transformers()


FORMAT = PyTorch()
