"""Streaming casts and quantization with MLX's own ops, a few rows at a time, without torch or numpy.

An output tensor made from input tensors (one, or E experts stacked on dim 0) is computed in row chunks of
about ``CHUNK_BYTES``: input bytes are read with ``pread`` (or taken from a decoded tensor when the input
is not a plain safetensors file), wrapped as an ``mx.array``, cast with ``astype`` and/or packed with
``mx.quantize``, and the results are appended to the outputs' byte buffers. Affine quantization works per
row group along the last axis, so chunking rows gives the same bits as ``mlx_lm.convert``'s whole-tensor
call (the tests compare them). Memory stays at one chunk plus the (packed) outputs of one tensor.

A ``QuantPool`` worker writes a part's bytes into the output file itself, at the offset the writer gives
(``OutTensor.place``), where the writer has opened that file by the time the job is sent: the packed bytes then
never pass through a pipe, a pickle and the writer (one copy instead of five). Such a weight larger than
``PIECE_BYTES`` is sent as row ranges (``QuantJob.pieces``), run by whichever workers are free: a 1 GB embedding or
head no longer leaves one worker busy while the others wait, at the start of an export or at its end.

Reading goes the other way: ``dequantize`` unpacks one module's weight, scales and biases.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Literal

import mlx.core as mx

from ffn_tools.io.dtypes import itemsize, nbytes
from ffn_tools.io.raw import RawTensor  # noqa: F401 - re-exported: the MLX modules' tensors
from ffn_tools.io.chunked import read_chunks
from ffn_tools.io.writer import Placed, write_at

if TYPE_CHECKING:
    from concurrent.futures import Future, ProcessPoolExecutor

CHUNK_BYTES = 4 << 20
PIECE_BYTES = 64 << 20  # a weight larger than this is quantized by workers in pieces of about this many input bytes
PARALLEL_MIN_BYTES = 128 << 20  # less to quantize than this: starting worker processes costs more
MAX_WORKERS = 8
# safetensors dtype <-> mx dtype
MX_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "F64": mx.float64, "U32": mx.uint32,
             "U8": mx.uint8, "U16": mx.uint16, "I32": mx.int32, "I64": mx.int64, "I8": mx.int8, "I16": mx.int16,
             "U64": mx.uint64, "BOOL": mx.bool_}
ST_DTYPES = {v: k for k, v in MX_DTYPES.items()}
_UINT: dict[int, tuple[Literal["B", "H", "I", "Q"], mx.Dtype]] = {
    1: ("B", mx.uint8), 2: ("H", mx.uint16), 4: ("I", mx.uint32), 8: ("Q", mx.uint64)}


def to_mx(data: memoryview, st: str, shape: Sequence[int]) -> mx.array:
    """An mx array of dtype ``st`` from raw little-endian bytes (copied)."""
    code, utype = _UINT[itemsize(st)]
    a = mx.array(data.cast(code, shape=list(shape) or [1]))  # type: ignore[arg-type]  # mlx's stub omits buffers
    a = a if MX_DTYPES[st] == utype else a.view(MX_DTYPES[st])
    return a if shape else a.reshape(())


def torch_bytes(t) -> memoryview:
    """A torch tensor's bytes (C order)."""
    import torch

    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def torch_to_mx(t) -> mx.array:
    """An mx array with a torch tensor's dtype, shape and bytes (bf16 included, never through float32)."""
    from ffn_tools.io.dtypes import as_st

    return to_mx(torch_bytes(t), as_st(t.dtype), tuple(t.shape))


def raw_bytes(a: mx.array) -> memoryview:
    """The bytes of an (evaluated, row-contiguous) mx array, through its buffer (bf16 included)."""
    return memoryview(a).cast("B")  # type: ignore[arg-type]  # mlx's stub omits array.__buffer__


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """(last dim, product of the others): a tensor seen as rows; a scalar is one row of one."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return (shape[-1] if shape else 1), rows


def row_chunks(ckpt, name: str, max_bytes: int | None = None, first: int = 0,
               last: int | None = None) -> Iterator[tuple[memoryview, int]]:
    """(bytes, rows) chunks of whole rows (``first`` to ``last``, default all) of a tensor viewed as (rows, last dim).
    A chunk read from its file is read into one buffer, used again for the next chunk (no fresh pages to fault in
    and zero for each): the view holds until the next one is asked for."""
    info = ckpt.info(name)
    max_bytes = max_bytes or CHUNK_BYTES
    cols, rows = _rows_cols(info.shape)
    row_bytes = cols * itemsize(info.st_dtype)
    last = rows if last is None else last
    if last <= first or not row_bytes:
        return
    step = max(1, max_bytes // row_bytes)
    if info.start is not None:
        for view in read_chunks(info, step * row_bytes, first * row_bytes, last * row_bytes):
            yield view, len(view) // row_bytes
        return
    data = memoryview(ckpt.read_raw(name))  # decoded by the reader (torch only where it needs it)
    for r in range(first, last, step):
        n = min(step, last - r)
        yield data[r * row_bytes:(r + n) * row_bytes], n


def stream(ckpt, sources: Sequence[str], outputs: Sequence[tuple[str, tuple[int, ...]]],
           fn: Callable[[mx.array], Sequence[mx.array]], max_bytes: int | None = None,
           dests: dict[int, tuple[str, int]] | None = None,
           rows: tuple[int, int] | None = None) -> list[RawTensor | None]:
    """Apply ``fn`` to row chunks of ``sources`` (rows concatenated in order) and collect its outputs.

    Args:
        sources: input tensor names; their rows, in order, are the rows of the logical input.
        outputs: (dtype, shape) of each output of ``fn``, for the whole logical input.
        fn: maps an (rows, last dim) chunk to per-output arrays whose first axis is those rows.
        dests: output -> (file, offset): that output is written there chunk by chunk (the file exists, at least
            that long), and None returned in its place.
        rows: only these rows (start, end) of the logical input, where every output has a ``dests``: each output's
            bytes of those rows are written where the whole output's would be (a ``QuantJob``'s piece).

    Raises:
        RuntimeError: the outputs did not come out at their planned sizes (a bug).
    """
    dests = dests or {}
    outs: list[RawTensor | None] = [None if k in dests else RawTensor(st, shape)
                                    for k, (st, shape) in enumerate(outputs)]
    sizes = [nbytes(st, shape) for st, shape in outputs]
    total = _rows_cols(outputs[0][1])[1] if outputs else 0  # every output has the input's rows
    lo, hi = rows or (0, total)
    if rows is not None and (len(dests) < len(outputs) or not 0 <= lo <= hi <= total):
        raise RuntimeError(f"internal error: rows {rows} of {total} asked of {', '.join(sources)[:200]}")
    per_row = [size // total if total else 0 for size in sizes]
    fds = {k: os.open(path, os.O_WRONLY) for k, (path, _) in dests.items()}  # never created here
    pos = [lo * b for b in per_row]
    try:
        at = 0  # the logical row the next source begins at
        for name in sources:
            info = ckpt.info(name)
            cols, n = _rows_cols(info.shape)
            first, last, at = max(lo - at, 0), min(hi - at, n), at + n
            for data, chunk_rows in row_chunks(ckpt, name, max_bytes, first, max(first, last)):
                results = fn(to_mx(data, info.st_dtype, (chunk_rows, cols)))
                mx.eval(*results)
                for k, r in enumerate(results):
                    b = raw_bytes(r)
                    if k in fds:
                        write_at(fds[k], b, dests[k][1] + pos[k])
                    else:
                        outs[k][pos[k]:pos[k] + len(b)] = b  # type: ignore[index]
                    pos[k] += len(b)
                del results
    finally:
        for fd in fds.values():
            os.close(fd)
    if pos != ([hi * b for b in per_row] if rows is not None else sizes):
        raise RuntimeError(f"internal error: {', '.join(sources)[:200]} produced {pos} bytes, planned {sizes}")
    return outs


def cast_fn(target: str | None) -> Callable[[mx.array], list[mx.array]]:
    """Chunk function: cast to ``target`` (None: unchanged)."""
    return lambda a: [a.astype(MX_DTYPES[target]) if target else a]


def quantize_fn(target: str | None, group_size: int, bits: int, mode: str = "affine") -> Callable[[mx.array], list[mx.array]]:
    """Chunk function: optional cast, then ``mx.quantize`` -> (packed weight, scales[, biases]: affine)."""
    def fn(a: mx.array) -> list[mx.array]:
        a = a.astype(MX_DTYPES[target]) if target else a
        return list(mx.quantize(a, group_size=group_size, bits=bits, mode=mode))

    return fn


def part_specs(shape: tuple[int, ...], dtype: str, group_size: int, bits: int, mode: str) -> list[tuple[str, tuple]]:
    """(dtype, shape) of the packed weight, the scales and (affine only) the biases of a weight of ``shape``
    and (after any cast) ``dtype``: the other modes keep 8-bit exponent scales and no biases."""
    wshape, sshape = quantized_shapes(shape, group_size, bits)
    if mode == "affine":
        return [("U32", wshape), (dtype, sshape), (dtype, sshape)]
    return [("U32", wshape), ("U8", sshape)]


def from_mx(a: mx.array) -> RawTensor:
    """An mx array's bytes (evaluated, made row-contiguous) as a ``RawTensor``."""
    a = mx.contiguous(a)
    mx.eval(a)
    raw = RawTensor(ST_DTYPES[a.dtype], a.shape)
    if raw:
        raw[:] = raw_bytes(a if a.ndim else a.reshape(1))
    return raw


def quantized_shapes(shape: tuple[int, ...], group_size: int, bits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(packed weight shape, scales/biases shape) of a weight of ``shape`` quantized along its last axis."""
    lead, cols = shape[:-1], shape[-1]
    return (*lead, cols * bits // 32), (*lead, cols // group_size)


class QuantJob:
    """One weight's quantization, shared by its entries (weight, scales and, affine only, biases).

    Computed when the first part is asked for (or earlier, by a ``QuantPool`` worker) and forgotten once
    all three are taken, so only one tensor's packed outputs are alive at a time (plus the pool's few).
    """

    def __init__(self, ckpt, sources: Sequence[str], shape: tuple[int, ...], dtype: str, target: str | None,
                 group_size: int, bits: int, mode: str = "affine", array: Callable[[], mx.array] | None = None):
        """``sources``: input tensors whose rows, in order, are the weight's; or ``array``, a function giving
        the whole weight (one that ``sanitize`` computed, or a split piece of an input)."""
        self.ckpt, self.sources, self.target, self.array = ckpt, tuple(sources), target, array
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.specs = part_specs(shape, target or dtype, group_size, bits, mode)
        infos = [ckpt.info(n) for n in self.sources]
        self.infos = infos if infos and all(i.start is not None for i in infos) else None  # what a worker can read
        self.nbytes = sum(i.nbytes for i in infos)
        self.pool: QuantPool | None = None
        self.wanted = True  # False: no entry of a sample run (io.sample) asks for it, so the pool never runs it
        self.index = -1
        self.futures: list[Future[list[RawTensor | None]]] = []  # the pool's: the whole job, or its pieces
        self.dests: dict[int, tuple[str, int]] = {}  # part -> (output file, offset) a worker writes it at
        self._parts: list[RawTensor | None] | None = None
        self._left: set[int] = set()

    def args(self, rows: tuple[int, int] | None = None) -> tuple:
        """Arguments of ``quantize_files`` for this job (``rows``: one piece of it)."""
        return (self.infos, self.specs, self.target, self.group_size, self.bits, self.mode, CHUNK_BYTES,
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
            elif self.array is not None:
                a = self.array()
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


class _Infos:
    """The ``info`` half of a checkpoint, for a worker reading bytes at known offsets."""

    def __init__(self, infos):
        self._infos = {i.name: i for i in infos}

    def info(self, name: str):
        return self._infos[name]


def quantize_files(infos, specs, target, group_size, bits, mode, chunk_bytes,
                   dests: dict[int, tuple[str, int]], rows: tuple[int, int] | None = None) -> list[RawTensor | None]:
    """A ``QuantJob`` (or its ``rows``) in a worker process: read, cast and quantize tensors at known file offsets;
    the parts in ``dests`` are written into their output file at their offset as they come (None in their place;
    the writer made the file at its full size), the others returned."""
    return stream(_Infos(infos), [i.name for i in infos], specs, quantize_fn(target, group_size, bits, mode),
                  chunk_bytes, dests, rows)


class QuantPool:
    """Runs quantization jobs ahead of the writer in worker processes: on CPU ``mx.quantize`` uses one
    core, so N workers make it up to N times faster. At most ``2 * workers`` results wait in memory."""

    def __init__(self, jobs: Sequence[QuantJob], workers: int, executor: ProcessPoolExecutor | None = None):
        """``executor``: workers already started (``Workers``), else they start on first use."""
        self.jobs = [j for j in jobs if j.infos is not None]
        for i, j in enumerate(self.jobs):
            j.pool, j.index = self, i
        self.workers, self.submitted = workers, 0
        self._executor = executor
        self._wanted: list[int] = []

    def ahead(self, job: QuantJob) -> None:
        """Submit ``job`` if it is not yet, and keep ``2 * workers`` of the jobs after it that will be asked for
        submitted (called as the writer takes each job: topped up one by one, the workers never run dry between
        batches; measured, batches left them a quarter idle). Starts the workers on first use."""
        if self._executor is None:
            self._executor = _spawned(self.workers)
        if not self._wanted:
            self._wanted = [0]  # wanted jobs before each index (a sample run decides ``wanted`` before writing)
            for j in self.jobs:
                self._wanted.append(self._wanted[-1] + j.wanted)
        self.submitted = max(self.submitted, job.index)  # jobs before it are not asked for (--resume reused them)
        while self.submitted < len(self.jobs) and (self.submitted <= job.index or
                                                   self._wanted[self.submitted] - self._wanted[job.index + 1] <
                                                   2 * self.workers):
            j = self.jobs[self.submitted]
            if j.wanted:
                j.futures = [self._executor.submit(quantize_files, *j.args(rows)) for rows in j.pieces()]
            self.submitted += 1

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)


def _spawned(workers: int) -> ProcessPoolExecutor:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: fresh interpreters (forking a process that runs MLX's threads is unsafe)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_watch_parent,
                               initargs=(os.getpid(),))


PARENT_POLL_SECONDS = 0.25


def _watch_parent(parent: int) -> None:
    """A worker's initializer: a thread that ends the worker once ``parent`` (the exporting process) is gone, killed
    with SIGKILL included (a pool's own shutdown never runs then, and a worker waiting for its next job waits
    forever: every worker holds the job queue's writing end too). The resource tracker the pool started follows when
    its last worker is gone. Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the worker ends, and
    ``Workers`` starts them on a thread that ends at once."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)  # the parent is gone: nothing is waiting for this worker's results (or its writes)

    threading.Thread(target=watch, name="ffn-tools-parent-watch", daemon=True).start()


def _ready() -> None:
    """A worker's first task: nothing; unpickling it imported this module, and MLX with it."""


class Workers:
    """The pool's worker processes, started on a thread when an export that quantizes begins: a worker's start (a
    fresh interpreter importing MLX and this package) then runs beside the planning (mlx_lm's import, its model,
    the plan: ~3 s on one core for Llama-3-8B) instead of after it. ``start_pool`` takes them; ``close`` shuts
    down what it did not take (planning failed, or too little to quantize after all)."""

    def __init__(self):
        self.executor: ProcessPoolExecutor | None = None
        self.workers = 0
        self._thread = threading.Thread(target=self._start, name="ffn-tools-quant-workers", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        workers = min(idle_cores(), MAX_WORKERS)
        if workers >= 2:
            executor = _spawned(workers)
            for _ in range(workers):  # each submit without an idle worker spawns one: all start now
                executor.submit(_ready)
            self.executor, self.workers = executor, workers

    def take(self) -> tuple[ProcessPoolExecutor | None, int]:
        self._thread.join()
        taken, self.executor = self.executor, None
        return taken, self.workers

    def close(self) -> None:
        self._thread.join()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = None


_EARLY: ContextVar[Workers | None] = ContextVar("ffn_tools_mlx_early_workers", default=None)


@contextmanager
def started_early(ckpt, quantizing: bool) -> Iterator[None]:
    """``Workers`` started for the block, where an export that quantizes on the CPU a checkpoint holding at least
    ``PARALLEL_MIN_BYTES`` will run in it (what it quantizes is not known yet: never more than that); the export's
    ``start_pool`` takes them (``early``); what it did not take is shut down at the end."""
    workers = (Workers() if quantizing and mx.default_device() == mx.cpu and ckpt.total_bytes >= PARALLEL_MIN_BYTES
               else None)
    token = _EARLY.set(workers)
    try:
        yield
    finally:
        _EARLY.reset(token)
        if workers is not None:
            workers.close()


def early() -> Workers | None:
    """The workers ``started_early`` started for this export, if any."""
    return _EARLY.get()


def idle_cores() -> int:
    """Cores this process may use that are not busy now: the machine's CPU time over ``SAMPLE_SECONDS``
    (``/proc/stat``), else the 1-minute load average (ours counts as idle). The load average alone lags by a
    minute: a build or a read that just ended kept a 16 GB export on one core of an idle machine (measured)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = busy_cores()
    if busy is None:
        try:
            busy = max(os.getloadavg()[0] - 1, 0)
        except OSError:
            busy = 0
    return max(1, min(cores, int(cores - busy + 0.5)))


SAMPLE_SECONDS = 0.25


def busy_cores() -> float | None:
    """How many of the machine's cores other processes kept busy over the last ``SAMPLE_SECONDS``
    (``/proc/stat``'s all-CPU line: everything but idle and iowait, less this process's own CPU time over the
    same span), None where there is no /proc/stat. This process's own time is not counted: ``Workers`` samples
    on a thread while the export plans beside it on a core, which read as a busy core and started no workers."""
    def sample() -> tuple[int, int, float, float]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
        return sum(values), values[3] + values[4], time.process_time(), time.monotonic()

    try:
        total0, idle0, own0, at0 = sample()
        time.sleep(SAMPLE_SECONDS)
        total1, idle1, own1, at1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0 or at1 <= at0:
        return None
    busy = (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)
    return max(busy - (own1 - own0) / (at1 - at0), 0.0)


def start_pool(jobs: Sequence[QuantJob], started: Workers | None = None) -> QuantPool | None:
    """A ``QuantPool`` when quantizing on the CPU, with enough to quantize to repay starting workers and idle
    cores to run them (workers on a busy machine only add their start-up and copying), else None. ``started``:
    workers started already (``started_early``), taken here (shut down where no pool is made)."""
    todo = [j for j in jobs if j.infos is not None]
    executor, workers = started.take() if started is not None else (None, 0)
    if mx.default_device() != mx.cpu or sum(j.nbytes for j in todo) < PARALLEL_MIN_BYTES:
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        return None
    if executor is not None:
        return QuantPool(todo, workers, executor)
    workers = min(idle_cores(), MAX_WORKERS, len(todo))
    return QuantPool(todo, workers) if workers >= 2 else None


def dequantize(w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
               mode: str = "affine", dtype: str | None = None) -> RawTensor:
    """Unpack one quantized weight with ``mx.dequantize``, in safetensors dtype ``dtype`` (None: the scales',
    which only affine scales have: the other modes' are 8-bit floats)."""
    return from_mx(mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode,
                                 dtype=MX_DTYPES[dtype] if dtype else None))
