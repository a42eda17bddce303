"""An elementwise output (a cast) made a chunk at a time, in two buffers reused from chunk to chunk.

Made whole, a 197 MB cast reads its input into fresh memory and casts it into more: for a 4 GB bf16 -> f16 cast that
was 1.9 million page faults, the kernel zeroing 8 GB of new pages, and 10.4 s of system time against 5.8 s of user
time (``perf``: ``clear_page_erms``, ``exc_page_fault``). Made here, each chunk of ``CHUNK_BYTES`` of the input is
read with ``pread`` into one buffer and cast into another, and handed to the writer, which writes it before it asks
for the next: no page is faulted after the first chunk, and what the process holds is two chunks, whatever the
tensor's size (docs/performance.md#casts).

Used by ``executor.out_tensor`` where an entry has an ``into`` (``plan.Entry``) and its one input's bytes lie in a file
as stored (``TensorInfo.start``); the writer takes the chunks through ``OutTensor.stream``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .store import TensorInfo, read_into

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 8 << 20  # input bytes per chunk. A settled 4 GB cast, twice each: 1 MiB 6.2-6.7 s (50 MB less RSS, 0.4
# CPU-s more), 8 MiB 5.8-6.7 s, 32 MiB 6.2-7.3 s (more system time) (docs/performance.md#casts)


def read_chunks(info: TensorInfo, step: int, begin: int = 0, end: int | None = None) -> Iterator[memoryview]:
    """Bytes ``begin:end`` (default all) of the tensor ``info``, whose bytes lie in ``info.file`` from ``info.start``,
    ``step`` bytes a chunk, each read with ``pread`` into one buffer used again for the next (no fresh pages to fault
    in for each): a chunk holds until the next is asked for. For every reader of a tensor in pieces (a cast
    here, 4-bit MLX's rows).

    Raises:
        OSError: the file ends early.
    """
    if info.start is None:
        raise RuntimeError(f"internal error: {info.name} is read in chunks, but its bytes are not in a file")
    end = info.nbytes if end is None else end
    if end <= begin:
        return
    import numpy as np

    buf = np.empty(min(step, end - begin), dtype=np.uint8).data  # not zeroed: every byte of a chunk is read over
    with open(info.file, "rb", buffering=0) as f:
        for at in range(begin, end, step):
            view = buf[: min(step, end - at)]
            read_into(f.fileno(), view, info.start + at, info.file)
            yield view


def chunks(info: TensorInfo, out_dtype: "torch.dtype", into: Callable[["torch.Tensor", "torch.Tensor"], object],
           step: int | None = None) -> Iterator["torch.Tensor"]:
    """The output of ``into`` for the tensor ``info`` (whose bytes lie in ``info.file`` from ``info.start``), a flat
    chunk at a time: ``into(src, out)`` writes into ``out`` the outputs of the input elements ``src`` (both flat,
    as long as each other). A chunk is valid until the next is asked for (its buffer is reused).

    Args:
        step: input bytes per chunk (``CHUNK_BYTES``; rounded down to whole elements).

    Raises:
        OSError: the file ends early.
    """
    import torch

    size = info.dtype.itemsize
    per = max(1, (step or CHUNK_BYTES) // size)  # elements per chunk
    out_buf = torch.empty(min(per, max(info.nbytes // size, 1)), dtype=out_dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for raw in read_chunks(info, per * size):
            src = torch.frombuffer(raw, dtype=info.dtype)
            out = out_buf[: len(src)]
            into(src, out)
            yield out
    finally:
        torch.set_num_threads(threads)
