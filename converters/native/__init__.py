"""Native formats: Meta's (``consolidated.NN.pth`` + ``params.json``) and Mistral's (``consolidated.safetensors``
+ ``params.json``), read with Hugging Face names so every command takes them (see ``reader``, ``layout``).

Read only: ``convert --to torch`` turns one into a checkpoint transformers loads.
"""

from __future__ import annotations

from pathlib import Path

from ffn_tools.formats import Format
from ffn_tools.io.store import Checkpoint

from .reader import PARAMS, NativeCheckpoint, shard_files

__all__ = ["FORMAT"]


class Native(Format):
    name = "native"
    writes = False
    detect_order = 20

    def can_read(self, path: Path) -> bool:
        """A directory (or a file in one) holding params.json and consolidated weights."""
        path = Path(path)
        root = path if path.is_dir() else path.parent
        if not path.is_dir() and not path.name.startswith(("consolidated", PARAMS)):
            return False
        return (root / PARAMS).is_file() and bool(shard_files(root))

    def read(self, path: Path, absent_shards: bool = False, like: Checkpoint | None = None) -> Checkpoint:
        """A native checkpoint as a lazy Hugging Face-named view.

        Raises:
            CheckpointError: params.json unreadable, tensors of unknown names, shards that disagree.
        """
        return NativeCheckpoint(Path(path))

    def export(self, ckpt: Checkpoint, out: Path, **options) -> dict:
        from ffn_tools.errors import FFNToolsError

        raise FFNToolsError("ffn-tools reads Meta and Mistral native checkpoints but does not write them; "
                            "convert to torch, mlx or flax")

    runtimes = ()  # clients.runtime gives a NoClient saying so
    unloaded = ("Meta's and Mistral's own code loads native checkpoints, not a client here; "
                "`ffn-tools convert --to torch` makes one transformers loads")


FORMAT = Native()
