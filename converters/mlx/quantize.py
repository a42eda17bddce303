"""One quantized weight's quantization, made once for its two or three output tensors (weight, scales, biases).

A ``QuantJob`` is computed when its first part is asked for (or earlier, by a ``workers.QuantPool`` worker) and
forgotten once every part is taken. A worker writes a part's bytes into the output file itself, at the offset the
writer gives (``OutTensor.place``), where the writer has opened that file by the time the job is sent: the packed
bytes then never pass through a pipe, a pickle and the writer (one copy instead of five). Such a weight larger than
``PIECE_BYTES`` is sent as row ranges (``QuantJob.pieces``), run by whichever workers are free: a 1 GB embedding or
head no longer leaves one worker busy while the others wait, at the start of an export or at its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx

from ffn_tools.io.dtypes import nbytes
from ffn_tools.io.raw import RawTensor
from ffn_tools.io.writer import Placed

from . import quant
from .quant import _rows_cols, from_mx, part_specs, quantize_fn, stream

if TYPE_CHECKING:
    from concurrent.futures import Future


PIECE_BYTES = 64 << 20  # a weight larger than this is quantized by workers in pieces of about this many input bytes
PARTS = ("weight", "scales", "biases")  # a quantized weight's parts, in ``part_specs``' order


class Pool(Protocol):
    """What a job asks of the pool that computes it ahead of the writer (``workers.QuantPool``)."""

    def ahead(self, job: QuantJob) -> None: ...


class Whole(Protocol):
    """A weight's whole data, where it is not input rows (``tensors.Whole``: data, so a job pickles)."""

    def array(self) -> mx.array: ...


class QuantJob:
    """One weight's quantization, shared by its entries (weight, scales and, affine only, biases).

    Computed when the first part is asked for (or earlier, by a ``QuantPool`` worker) and forgotten once
    all three are taken, so only one tensor's packed outputs are alive at a time (plus the pool's few).
    """

    def __init__(self, ckpt, sources: Sequence[str], shape: tuple[int, ...], dtype: str, target: str | None,
                 group_size: int, bits: int, mode: str = "affine", whole: Whole | None = None):
        """``sources``: input tensors whose rows, in order, are the weight's; or ``whole``, the whole weight
        (one that ``sanitize`` computed, or a split piece of an input)."""
        self.ckpt, self.sources, self.target, self.whole = ckpt, tuple(sources), target, whole
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.specs = part_specs(shape, target or dtype, group_size, bits, mode)
        infos = [ckpt.info(n) for n in self.sources]
        self.infos = infos if infos and all(i.start is not None for i in infos) else None  # what a worker can read
        self.nbytes = sum(i.nbytes for i in infos)
        self.pool: Pool | None = None
        self.wanted = True  # False: no entry of a sample run (io.sample) asks for it, so the pool never runs it
        self.index = -1
        self.futures: list[Future[list[RawTensor | None]]] = []  # the pool's: the whole job, or its pieces
        self.dests: dict[int, tuple[str, int]] = {}  # part -> (output file, offset) a worker writes it at
        self._parts: list[RawTensor | None] | None = None
        self._left: set[int] = set()

    def describe(self) -> str:
        """How the weight is quantized, for --dry-run."""
        cast = f" after cast to {self.target}" if self.target else ""
        return f"mx.quantize {self.bits}-bit group {self.group_size} {self.mode}{cast}"

    def __getstate__(self) -> dict:
        """What the job is, without what running it holds (its pool, futures, parts, places): pickled with its
        entries (a ``--ray`` task's plan slice), it runs again where it lands, in that process."""
        state = dict(self.__dict__)
        state.update(pool=None, index=-1, futures=[], dests={}, _parts=None, _left=set())
        return state

    def args(self, rows: tuple[int, int] | None = None) -> tuple:
        """Arguments of ``quantize_files`` for this job (``rows``: one piece of it)."""
        return (self.infos, self.specs, self.target, self.group_size, self.bits, self.mode, quant.CHUNK_BYTES,
                dict(self.dests), rows)

    def pieces(self) -> list[tuple[int, int] | None]:
        """The row ranges workers quantize this job in: pieces of about ``PIECE_BYTES`` where a worker writes every
        part into the output (a 1 GB embedding in 16 pieces: the other workers never wait while one worker runs
        it, at the start or at the end), else the whole job (None)."""
        rows = _rows_cols(self.specs[0][1])[1]
        if len(self.dests) < len(self.specs) or self.nbytes <= PIECE_BYTES or rows < 2:
            return [None]
        step = max(1, rows * PIECE_BYTES // self.nbytes)
        return [(r, min(r + step, rows)) for r in range(0, rows, step)]

    def place(self, k: int, path, offset: int) -> None:
        """Part ``k``'s bytes go to ``path`` at ``offset``: a worker that has not started the job yet writes them
        there (and ``part`` gives ``Placed``); computed here, or already sent, the part is returned as bytes."""
        if self.pool is not None and not self.futures and self._parts is None:
            self.dests[k] = (str(path), offset)

    def part(self, k: int) -> RawTensor | Placed:
        if self._parts is None or k not in self._left:
            if self.pool is not None:
                self.pool.ahead(self)  # this job, and the window after it kept full
            fn = quantize_fn(self.target, self.group_size, self.bits, self.mode)
            if self.futures:
                done = [f.result() for f in self.futures]  # pieces: every part written by the workers
                self._parts, self.futures = (done[0] if len(done) == 1 else [None] * len(self.specs)), []
            elif self.whole is not None:
                a = self.whole.array()
                parts = [from_mx(r) for r in fn(a.reshape(-1, a.shape[-1]))]
                for p, (st, shape) in zip(parts, self.specs):
                    p.shape = tuple(shape)
                self._parts = list(parts)
            else:
                self._parts = stream(self.ckpt, self.sources, self.specs, fn)
            self._left = set(range(len(self.specs)))
        part = self._parts[k]
        self._left.discard(k)
        if not self._left:
            self._parts, self.dests = None, {}
        if part is None:  # the worker wrote it into the output
            st, shape = self.specs[k]
            return Placed(nbytes(st, shape))
        return part
