"""GGUF, llama.cpp's format: read (``reader``) with Hugging Face names, and written as llama.cpp's own
converter writes it (``writer``).

Reading needs ``gguf`` (llama.cpp's gguf-py); writing also needs llama.cpp's ``convert_hf_to_gguf.py`` with
its ``conversion/`` package and vendored ``gguf-py`` (``writer.LLAMA_CPP``).
"""

from __future__ import annotations

from pathlib import Path

from ffn_tools.io.store import Checkpoint

from .writer import OUTTYPES  # convert_hf_to_gguf.py's --outtype; K-quants: llama-quantize

FORMAT = "gguf"
OPTIONS: frozenset[str] = frozenset({"outtype", "dry_run"})

__all__ = ["FORMAT", "OPTIONS", "OUTTYPES", "can_read", "open", "export", "side_files", "GGUFCheckpoint",
           "split_files"]


def can_read(path: Path) -> bool:
    """A file whose name ends in .gguf: GGUF's reader opens it, or says why it is not a GGUF it reads (a file so
    named that another format's reader took would be refused as "not a checkpoint" with no reason)."""
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file()


def open(path: Path) -> Checkpoint:  # noqa: A001 - the converter surface's name
    """Open a GGUF (any part of a split one) as a lazy Hugging Face-named view.

    Raises:
        CheckpointError: not a GGUF, an architecture or tensor ffn-tools has no Hugging Face name for.
    """
    from .reader import GGUFCheckpoint  # gguf and numpy: imported only when a GGUF is read

    return GGUFCheckpoint(Path(path))


def __getattr__(name: str):
    """``GGUFCheckpoint`` and ``split_files`` from ``reader``, imported on first use: detecting formats (every
    command does) must not import gguf and numpy (split and fuse never import them)."""
    if name in ("GGUFCheckpoint", "split_files"):
        from . import reader

        return getattr(reader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def export(ckpt: Checkpoint, out: Path, **options) -> dict:
    """Write ``ckpt`` as a GGUF, as llama.cpp's convert_hf_to_gguf.py does (see ``writer.export``)."""
    from .writer import export as write

    return write(ckpt, out, **options)


def side_files(ckpt: Checkpoint) -> tuple[dict[str, str | bytes], list[str]]:
    """The tokenizer files and generation_config.json rebuilt from the GGUF's metadata, name -> text (bytes for
    tokenizer.model), and what
    the summary says about them (see ``sidefiles``)."""
    from .sidefiles import side_files as rebuild  # transformers: imported only when a GGUF is converted

    return rebuild(ckpt)
