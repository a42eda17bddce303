"""MLX's quantizing worker processes: a ``QuantPool`` runs ``QuantJob``s (``quantize``) ahead of the writer.

On CPU ``mx.quantize`` uses one core, so N workers quantize up to N times faster. Workers start early
(``started_early``, from ``Mlx.preparing``: beside the conversion's checks and planning), as many as there are idle
cores (``idle_cores``: the CPU time of the last quarter second, not the load average), and end with the process
that started them, killed included (``_watch_parent``). A worker reads its input bytes at known file offsets
(``quantize_files``) and writes the parts into the output file itself at the place the writer gave.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import mlx.core as mx

from ffn_tools.io.raw import RawTensor

from .quant import quantize_fn, stream

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

    from .quantize import QuantJob

PARALLEL_MIN_BYTES = 128 << 20  # less to quantize than this: starting worker processes costs more
MAX_WORKERS = 8


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


_STARTED: dict[int, Workers] = {}  # id(checkpoint) -> the workers ``started_early`` started for its export


@contextmanager
def started_early(ckpt, quantizing: bool) -> Iterator[Workers | None]:
    """``Workers`` started for the block, where an export that quantizes on the CPU a checkpoint holding at least
    ``PARALLEL_MIN_BYTES`` will run in it (what it quantizes is not known yet: never more than that), kept for the
    export of this same ``ckpt`` (``early``); what it did not take is shut down at the end."""
    workers = (Workers() if quantizing and mx.default_device() == mx.cpu and ckpt.total_bytes >= PARALLEL_MIN_BYTES
               else None)
    if workers is not None:
        _STARTED[id(ckpt)] = workers
    try:
        yield workers
    finally:
        if workers is not None:
            _STARTED.pop(id(ckpt), None)
            workers.close()


def early(ckpt) -> Workers | None:
    """The workers ``started_early`` started for the export of ``ckpt`` (this very object, inside its block), if
    any: what ``start_pool`` takes."""
    return _STARTED.get(id(ckpt))


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


