"""Streaming writer of torch.distributed.checkpoint directories, as ``plan.execute``'s ``Writer``.

Each tensor is cut along dim 0 into one chunk per rank of ``ranks`` (``torch.chunk``'s sizes: FSDP's
``Shard(0)``), rank r's chunks written to ``__r_0.distcp`` as torch's ``FileSystemWriter`` writes them (what
``torch.save`` writes for the chunk, at the file's current end: ``torchsave.write``, streaming the bytes), then
``.metadata`` (``metadata.write_metadata``). A tensor with fewer rows than ranks, and a 0-d one, has fewer chunks;
an empty chunk is not written. A tensor copied from the input is streamed from its file in blocks, never whole in
memory; a computed one (q/k permuted, experts stacked) is in memory alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ffn_tools.io.dtypes import short_name
from ffn_tools.io.writer import OutTensor, Writer, cut_ranges, payload_tensor

from . import torchsave
from .metadata import METADATA, Chunk, write_metadata

if TYPE_CHECKING:
    from ffn_tools.progress import Progress


def _save(f, payload, dtype: str, shape: tuple[int, ...], at: int, n: int) -> None:
    """Bytes ``at:at+n`` of the tensor ``payload`` (a tensor, or input byte ranges) as a torch.save of ``shape``."""
    import torch

    if isinstance(payload, list):  # a copy: checksummed as read, then copied file to file, never whole in memory
        torchsave.write(f, dtype, shape, cut_ranges(payload, at, n), n)
        return
    flat = payload.contiguous().reshape(-1).view(torch.uint8) if payload.numel() else torch.empty(0, dtype=torch.uint8)
    piece = flat[at: at + n]
    if torchsave.writable(dtype):
        torchsave.write(f, dtype, shape, [piece.numpy().data], n)
    else:  # a dtype torch.save names otherwise (float8, complex): torch.save of a copy of the rows
        torch.save(piece.clone().view(getattr(torch, dtype)).reshape(shape), f)


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def row_chunks(rows: int, ranks: int) -> list[tuple[int, int]]:
    """(first row, rows) of each rank's chunk, as ``torch.chunk`` cuts ``rows`` into ``ranks`` (empty ones left out)."""
    step = -(-rows // ranks) if rows else 0
    return [(r, min(step, rows - r)) for r in range(0, rows, step)] if step else []


class DcpWriter(Writer):
    """See the module docstring. ``ranks``: the world size the output is sharded for."""

    suffix = "\0"  # a DCP checkpoint is a directory: no path is a single-file output
    resumable = False  # written as one store, not as shards a resume ledger can keep (--resume refused)

    def output_bytes(self, items, *, max_shard_size, metadata, single):
        """Not known before writing (this store's own layout): ``--dry-run`` scales its sample's bytes."""
        return None

    def __init__(self, ranks: int = 1):
        self.ranks = ranks

    def write_file(self, path: Path, items: Sequence[OutTensor], metadata: dict | None,
                   progress: Progress | None = None) -> None:
        raise RuntimeError("internal error: a DCP checkpoint is a directory")

    def write_sharded(self, out_dir: Path, items: Sequence[OutTensor], *, max_shard_size: int | None,
                      metadata: dict | None, progress: Progress | None = None, ledger=None) -> list[str]:
        """Every rank's ``__r_0.distcp`` and ``.metadata`` in ``out_dir`` (``max_shard_size``: not used; the
        export refuses it)."""
        files = [open(out_dir / rank_file(r), "wb", buffering=0) for r in range(self.ranks)]  # noqa: SIM115
        written: list[tuple[str, str, tuple[int, ...], list[Chunk]]] = []
        try:
            for t in items:
                dtype = short_name(t.dtype)  # torch's name of it
                payload = t.produce()
                if not torchsave.writable(dtype) and isinstance(payload, list):
                    payload = payload_tensor(payload, t.dtype, t.shape)
                chunks = []
                cuts = row_chunks(t.shape[0], self.ranks) if t.shape else [(0, 1)]
                row = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
                for rank, (first, rows) in enumerate(cuts):
                    f = files[rank]
                    start = f.tell()
                    sizes = (rows, *t.shape[1:]) if t.shape else ()
                    _save(f, payload, dtype, sizes, first * row, rows * row if t.shape else t.nbytes)
                    offsets = (first,) + (0,) * (len(t.shape) - 1) if t.shape else ()
                    chunks.append(Chunk(offsets, sizes, out_dir / rank_file(rank), start, f.tell() - start))
                written.append((t.name, dtype, tuple(t.shape), chunks))
                if progress:
                    progress.update(t.progress_bytes)
        finally:
            for f in files:
                f.close()
        write_metadata(out_dir, written)
        return [rank_file(r) for r in range(self.ranks)] + [METADATA]
