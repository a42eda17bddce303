"""MLX format: the model directories mlx-lm reads and writes (``mlx_lm.load`` / ``mlx_lm.convert``).

    models    mlx_lm's own model class for a config, built lazily: the spec an export must meet
    names     mlx_lm's sanitize on stand-ins: which input becomes which parameter
    recipe    what ``mlx_lm.convert -q`` quantizes, by mlx_lm's rules
    tensors   one plan entry per parameter: byte copies, streamed casts and quantization
    quant     MLX's quantize/cast in row chunks, worker processes; dequantize
    config    config.json as mlx_lm writes it; the keys export added
    card      the model card README.md
    exporter  ``export``: the whole directory
    view      ``open``: an MLX directory read back with Hugging Face names
"""

from __future__ import annotations

from pathlib import Path

from ffn_tools.errors import FFNToolsError
from ffn_tools.io.store import Checkpoint, open_checkpoint

FORMAT = "mlx"
OPTIONS: frozenset[str] = frozenset({"quantize", "group_size", "q_bits", "q_group_size", "q_mode", "quant_predicate",
                                     "dequantize",
                                     "dry_run"})

__all__ = ["FORMAT", "OPTIONS", "can_read", "open", "export"]


def can_read(path: Path) -> bool:
    """A safetensors checkpoint whose metadata says "mlx", whose config has a ``quantization`` block, or
    whose names contain ``switch_mlp``. Plain Hugging Face checkpoints have none of these."""
    path = Path(path)
    try:
        if path.is_dir():
            if not any(path.glob("*.safetensors")):
                return False
        elif not path.name.endswith((".safetensors", ".safetensors.index.json")):
            return False
        with open_checkpoint(path, absent_shards=True) as raw:  # what it is, from the shards that are here
            if raw.metadata.get("format") == "mlx" or isinstance((raw.config or {}).get("quantization"), dict):
                return True
            return any(".switch_mlp." in n for n in raw)
    except (FFNToolsError, OSError, ValueError):
        return False


def export(ckpt: Checkpoint, out: Path, **options) -> dict:
    """Write ``ckpt`` as an MLX model directory (see ``exporter.export``; mlx is imported only now, so an MLX
    directory is still recognized, and named with its extra, where mlx is not installed)."""
    from .exporter import export as run

    return run(ckpt, out, **options)


def open(path: Path, absent_shards: bool = False) -> Checkpoint:  # noqa: A001 - the converter surface's name
    """Open an MLX model directory as a lazy Hugging Face-named view (see ``view``); ``absent_shards``: its
    index may name shards not on disk (``Checkpoint.absent``).

    Raises:
        CheckpointError: no config.json, quantized weights without a ``quantization`` block, or
            tensors that do not fit it.
    """
    from .view import MLXCheckpoint

    return MLXCheckpoint(Path(path), absent_shards)
