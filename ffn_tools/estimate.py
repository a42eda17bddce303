"""``--dry-run``'s estimates: output bytes, temporary disk, peak RSS and time, measured on this machine.

A dry run plans; where the command was asked for an estimate (``io.run.Run.estimate``: the time the command began),
the command hands its plan and the run it would make of it (``Run``: output, writer, metadata, shard size, side
files) to ``estimate`` where it would hand them to ``executor.execute``. The estimate then streams a sample of that
plan (``io.sample.narrow``: about 3% of the bytes read, 48 MB to 1 GB: every k-th output tensor, and the one that
reads the most with its neighbours) through the one executor, in this process, into a temporary directory beside
the output (same disk), removed after: the command is not run again. From it:

- ``output_bytes``: the weight files' bytes, headers and index included, as the writer computes them from the whole
  plan before writing (``Writer.output_bytes``; a writer that cannot say: the sample's scaled by the plan's exact
  tensor bytes), plus the side files (config, tokenizer, receipt: written whole by the sample);
- ``temporary_disk``: the same bytes: the output is written into its own temporary directory beside ``-o`` and moved
  into place; nothing else is written (where ``--force`` replaces an output, the old one is freed after);
- ``peak_rss``: this process's peak RSS once it has planned the whole output and streamed the sample's largest
  tensor (its own high-water mark, or its workers' where larger: the largest process of its tree, as the
  benchmarks measure it);
- ``seconds``: the command's start-up (the process, its imports and the planning, measured: the run does the same),
  plus the sample's time from its writer's start (the tensors made, written and hashed) scaled by the bytes read,
  and the sample's time before it (its temporary directory, lock, resume key) once. Where the whole output would pass the kernel's
  dirty-page freerun point, the sample's output is flushed to time the disk, and the tensors' part is the time to
  write the output at the sample's speed under that throttle (``io.writeback``): ``sample.waits_on_disk`` says how
  much of the estimate that wait is.

An output the executor does not stream (GGUF, adapters) has no estimate, and the result says why (``NOT_STREAMED``).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from . import progress
from .errors import FFNToolsError
from .io import sample, writeback
from .io.run import Run
from .io.store import WEIGHT_INDEXES, WEIGHT_SUFFIXES
from .io.writer import SAFETENSORS
from .plan import Plan
from .sizes import human

log = logging.getLogger(__name__)

ENV = "FFN_TOOLS_ESTIMATE"  # "0": dry runs plan only (as --no-estimate)
NOT_STREAMED = {"made": False, "why": "this output is not streamed through the plan executor (GGUF and adapters are "
                "written by their own writers), so no sample of it can be run"}


def wanted(given: bool | None) -> bool:
    return given if given is not None else os.environ.get(ENV, "1") != "0"


def began() -> float:
    """When the command began, for its start-up: this process's start where the process is the command line (the
    ``ffn-tools`` script or ``python -m ffn_tools``: its interpreter's start and imports are the run's too), else
    now (a library call: from the call)."""
    spec = sys.modules["__main__"].__spec__  # None: a script, or python -c
    command_line = Path(sys.argv[0]).name == "ffn-tools" or (spec is not None and spec.name.startswith("ffn_tools"))
    started = _process_start() if command_line else None
    return started if started is not None else time.time()


def _process_start() -> float | None:
    """This process's start (``/proc/self/stat``'s start time after boot), None where /proc does not tell."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def priced(plan: Plan, run: Run) -> dict:
    """``{"estimate": ...}`` for a dry run asked for one (``run.estimate``), else ``{}``: what a command's dry run
    adds to its summary, with the plan and the run it would hand to ``executor.execute``."""
    return {} if run.estimate is None else {"estimate": estimate(plan, run)}


def estimate(plan: Plan, run: Run) -> dict:
    """The estimate of ``execute(plan, run)`` (``run.estimate``: when the command began; None: now), from a sample
    of ``plan`` streamed here into a temporary directory beside ``run.out``: ``made`` False and ``why`` where none
    could be made."""
    from .executor import out_tensor, execute  # its items: the writer aligns each copy's bytes as in its input

    begun = run.estimate if run.estimate is not None else time.time()
    planned = time.time()  # the command's start-up ends here: what the run does before it streams
    if run.out is None:
        raise FFNToolsError("internal error: the estimate needs the run's output path (Run.out)")
    out, writer = Path(run.out), run.writer or SAFETENSORS
    meta = dict(plan.source.metadata if run.metadata is None else run.metadata)
    meta.setdefault("format", "pt")  # as the executor writes it
    sized = [out_tensor(e, plan.source, {}) for e in plan.entries]  # as the executor makes them: nothing produced
    weight_bytes = writer.output_bytes(sized, max_shard_size=run.max_shard_size, metadata=meta,
                                       single=out.suffix == writer.suffix)
    narrowed, facts = sample.narrow(plan)
    shard = run.max_shard_size
    if shard and facts["bytes"]:  # as many shards as the run writes, hashed as they are
        shard = max(1, int(shard * facts["sample_bytes"] / facts["bytes"]))
    where = out.parent if out.parent.is_dir() else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix=".ffn-tools-estimate-", dir=where) as tmp:
        into = Path(tmp) / out.name
        timed = _Timed(writer)
        sampled = run.but(out=into, force=True, max_shard_size=shard, resume=False, ray=None, estimate=None,
                          hash_limit=facts["sample_reads"] or 1, writer=timed)  # the receipt hashes the sample's share
        started = time.time()
        try:
            with _quiet():
                execute(narrowed, sampled)
        except Exception as e:  # the dry run stands without its estimate, which says why (KeyboardInterrupt ends it)
            log.debug("the estimate's sample run failed", exc_info=True)
            return {"made": False, "why": f"the sample run failed ({e if isinstance(e, FFNToolsError) else repr(e)})"}
        ended = time.time()
        files = [f for f in into.rglob("*") if f.is_file()] if into.is_dir() else [into] if into.exists() else []
        size = {f: f.stat().st_size for f in files}
        sizes = {(f.relative_to(into).as_posix() if into.is_dir() else f.name): size[f] for f in files}
        rss = peak()
        heavy = [f for f in files if size[f] >= 1 << 20]  # the weights: what the disk's speed is timed on
        throttle = writeback.measure(heavy, facts["bytes"])  # after ``ended``: not part of the sample's own time
    return _scaled({**facts, "weight_bytes": weight_bytes, "started": started, "ended": ended, "files": sizes,
                    "peak_rss": rss, "writeback": throttle, "extra": sorted(run.extra_files or {}),
                    "writing": ended - (timed.begun or started)}, begun, planned)


class _Timed:
    """The run's writer, told when it begins: the sample's time from there on scales with its tensors (made,
    written, hashed for the resume ledger and the receipt, a quantization pool's start included); the time before
    it (the output's temporary directory, its lock, the resume key) is once a run, as is the rest of the run's
    start-up."""

    def __init__(self, writer):
        self.writer, self.begun = writer, None

    def __getattr__(self, name: str):
        return getattr(self.writer, name)  # suffix, resumable, output_bytes: the writer's own

    def write_file(self, *args, **kwargs):
        self.begun = self.begun or time.time()
        return self.writer.write_file(*args, **kwargs)

    def write_sharded(self, *args, **kwargs):
        self.begun = self.begun or time.time()
        return self.writer.write_sharded(*args, **kwargs)


@contextmanager
def _quiet():
    """No progress drawn for the sample (the dry run's own output is the plan and this estimate)."""
    was = progress._enabled
    progress.set_enabled(False)
    try:
        yield
    finally:
        progress.set_enabled(was)


def peak() -> int:
    """This process's peak RSS, or its workers' where larger (the largest process of its tree): its own high-water
    mark, its reaped children's (``RUSAGE_CHILDREN``), and its live children's (a quantization pool's workers,
    still up until the export closes the pool)."""
    import multiprocessing

    live = [_hwm(Path(f"/proc/{c.pid}/status")) for c in multiprocessing.active_children()]
    return max([sample.peak(), *live])


def _hwm(status: Path) -> int:
    try:
        for row in status.read_text().splitlines():
            if row.startswith("VmHWM:"):
                return int(row.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _scaled(f: dict, begun: float, planned: float | None = None) -> dict:
    """The estimate from the sample's facts: ``begun`` the command's start, ``planned`` the end of its planning
    (None: the sample's start), ``f["started"]``/``f["ended"]`` the sample's streaming."""
    given = set(f.get("extra", ()))  # files the command hands the executor whole (MLX's index of one shard)
    weights = {n: s for n, s in f["files"].items() if n not in given
               and (Path(n).suffix in WEIGHT_SUFFIXES or Path(n).name in WEIGHT_INDEXES or "/" in n)}
    side = sum(s for n, s in f["files"].items() if n not in weights)
    sampled_out = sum(weights.values())
    if f.get("weight_bytes") is not None:  # the writer's exact bytes (headers, index): the plan knows them all
        out_bytes = side + f["weight_bytes"]
    else:
        out_bytes = side + (round(sampled_out * f["bytes"] / f["sample_bytes"]) if f["sample_bytes"] else sampled_out)
    streaming = f["ended"] - f["started"]
    startup = (f["started"] if planned is None else planned) - begun
    writing = min(f.get("writing", streaming), streaming)  # the tensors' part of it: scaled; the rest is once a run
    computing = writing * (f["reads"] / f["sample_reads"] if f["sample_reads"] else 1.0)
    made = out_bytes - side  # at the rate the sample made them, or the disk's where the throttle holds the writer
    written = writeback.seconds(made, made / computing, f.get("writeback")) if computing > 0 < made else computing
    seconds = startup + (streaming - writing) + written
    return {"made": True, "output_bytes": out_bytes, "weight_bytes": made, "exact": f.get("weight_bytes") is not None,
            "temporary_disk": out_bytes, "peak_rss": f["peak_rss"],
            "seconds": round(seconds, 2),
            "sample": {"tensors": f["sampled"], "of": f["entries"], "reads": f["sample_reads"], "of_reads": f["reads"],
                       "startup_seconds": round(startup, 3), "seconds": round(streaming, 3),
                       "writing_seconds": round(writing, 3), "waits_on_disk": round(max(written - computing, 0), 2)}}


def line(r: dict) -> list[str]:
    """The estimate's line in a dry run's text output ([] where there is none)."""
    e = r.get("estimate")
    if not e:
        return []
    if not e["made"]:
        return [f"estimate: not made ({e['why']})"]
    s = e["sample"]
    share = f"{s['tensors']} of {s['of']} tensors, {human(s['reads'])} of {human(s['of_reads'])} read"
    rss = f"peak RSS {human(e['peak_rss'])}, " if e.get("peak_rss") else ""
    disk = s.get("waits_on_disk", 0)
    waits = f", {_duration(disk)} of it waiting for the disk to take the writes" if disk >= 0.05 * e["seconds"] else ""
    return [f"estimate: writes {human(e['output_bytes'])} (its temporary directory beside the output: "
            f"{human(e['temporary_disk'])}, no other disk), {rss}{_duration(e['seconds'])} on this machine{waits} "
            f"(a sample run here: {share})"]


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"
