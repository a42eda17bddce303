"""Streaming writer of torch.distributed.checkpoint directories, as ``plan.execute``'s ``Writer``.

Each tensor is cut along dim 0 into one chunk per rank of ``ranks`` (``torch.chunk``'s sizes: FSDP's
``Shard(0)``), rank r's chunks written to ``__r_0.distcp`` as torch's ``FileSystemWriter`` writes them (a
``torch.save`` of the chunk at the file's current end), then ``.metadata`` (``metadata.write_metadata``). A
tensor with fewer rows than ranks, and a 0-d one, has fewer chunks; an empty chunk is not written. One tensor
is in memory at a time (and the chunk being saved, a copy of its rows: ``torch.save`` of a view would save the
whole tensor's storage).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ffn_tools.io.writer import OutTensor, Writer, produced_tensor

from .metadata import METADATA, Chunk, write_metadata

if TYPE_CHECKING:
    from ffn_tools.progress import Progress


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def row_chunks(rows: int, ranks: int) -> list[tuple[int, int]]:
    """(first row, rows) of each rank's chunk, as ``torch.chunk`` cuts ``rows`` into ``ranks`` (empty ones left out)."""
    step = -(-rows // ranks) if rows else 0
    return [(r, min(step, rows - r)) for r in range(0, rows, step)] if step else []


class DcpWriter(Writer):
    """See the module docstring. ``ranks``: the world size the output is sharded for."""

    suffix = "\0"  # a DCP checkpoint is a directory: no path is a single-file output

    def __init__(self, ranks: int = 1):
        self.ranks = ranks

    def write_file(self, path: Path, items: Sequence[OutTensor], metadata: dict | None,
                   progress: Progress | None = None) -> None:
        raise RuntimeError("internal error: a DCP checkpoint is a directory")

    def write_sharded(self, out_dir: Path, items: Sequence[OutTensor], *, max_shard_size: int | None,
                      metadata: dict | None, progress: Progress | None = None) -> list[str]:
        """Every rank's ``__r_0.distcp`` and ``.metadata`` in ``out_dir`` (``max_shard_size``: not used; the
        export refuses it)."""
        import torch

        files = [open(out_dir / rank_file(r), "wb", buffering=0) for r in range(self.ranks)]  # noqa: SIM115
        written: list[tuple[str, str, tuple[int, ...], list[Chunk]]] = []
        try:
            for t in items:
                whole = produced_tensor(t)
                chunks = []
                cuts = row_chunks(t.shape[0], self.ranks) if t.shape else [(0, 1)]
                for rank, (first, rows) in enumerate(cuts):
                    piece = whole if len(cuts) == 1 else whole.narrow(0, first, rows)
                    if piece.storage_offset() or piece.untyped_storage().nbytes() != piece.nbytes:
                        piece = piece.clone()  # torch.save writes a view's whole storage
                    f = files[rank]
                    start = f.tell()
                    torch.save(piece, f)
                    offsets = (first,) + (0,) * (len(t.shape) - 1) if t.shape else ()
                    sizes = (rows, *t.shape[1:]) if t.shape else ()
                    chunks.append(Chunk(offsets, sizes, out_dir / rank_file(rank), start, f.tell() - start))
                written.append((t.name, str(whole.dtype).removeprefix("torch."), tuple(t.shape), chunks))
                if progress:
                    progress.update(t.progress_bytes)
        finally:
            for f in files:
                f.close()
        write_metadata(out_dir, written)
        return [rank_file(r) for r in range(self.ranks)] + [METADATA]
