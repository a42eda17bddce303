"""``--dry-run``'s estimates: output bytes, temporary disk, peak RSS and time, measured on this machine.

A dry run plans; the estimate then runs the same command in a child process on a sample of the plan (``io.sample``:
about 3% of the bytes read, 48 MB to 1 GB: every k-th output tensor, and the one that reads the most with its
neighbours), into a temporary directory beside the output (same disk), removed after. From it:

- ``output_bytes``: the weight files' bytes, headers and index included, as the writer computes them from the whole
  plan before writing (``Writer.output_bytes``; a writer that cannot say: the sample's scaled by the plan's exact
  tensor bytes), plus the side files (config, tokenizer: written whole by the sample run);
- ``temporary_disk``: the same bytes: the output is written into its own temporary directory beside ``-o`` and moved
  into place; nothing else is written (where ``--force`` replaces an output, the old one is freed after);
- ``peak_rss``: the sample process's peak RSS (its own high-water mark, or its workers' where larger: the largest
  process of its tree, as the benchmarks measure it), which planned the whole output and streamed its largest
  tensor;
- ``seconds``: the sample's start-up (process, imports, planning, measured), plus its streaming time: the part that
  writes the tensors (worker processes starting, the shards' hashing included) scaled by the bytes read, the rest
  (side files, the receipt, the move into place) once. Where the whole output would pass the kernel's dirty-page
  freerun point, the sample's output is flushed to time the disk, and the tensors' part is the time to write the
  output at the sample's speed under that throttle (``io.writeback``): ``sample.waits_on_disk`` says how much of
  the estimate that wait is.

The child runs the command line as given (``cli`` keeps it); a library call is sampled where its options are plain
data. An output the executor does not stream (GGUF, adapters) has no estimate, and the result says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from . import rerun
from .io import sample, writeback
from .io.store import WEIGHT_INDEXES, WEIGHT_SUFFIXES
from .sizes import human

ENV = "FFN_TOOLS_ESTIMATE"  # "0": dry runs plan only (as --no-estimate)
TIMEOUT = 600


def wanted(given: bool | None) -> bool:
    return given if given is not None else os.environ.get(ENV, "1") != "0"


def estimate(function: str, options: dict, out) -> dict:
    """The estimate of the run that ``function(**options)`` (an ``api`` function, under ``--dry-run``) would make,
    writing ``out``: ``made`` False and ``why`` where none could be made."""
    from .child import python_env

    call = rerun.replay(function, options)
    if call is None:
        return {"made": False, "why": "an option is not plain data, so the sample run cannot be given it"}
    cmd = rerun.command(call)
    out = Path(out)
    where = out.parent if out.parent.is_dir() else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix=".ffn-tools-estimate-", dir=where) as tmp:
        report = Path(tmp) / "report.json"
        env = {**python_env(), sample.ENV: json.dumps({"out": tmp, "report": str(report)}), ENV: "0"}
        with tempfile.TemporaryFile("w+") as err:
            begun = time.time()
            status = _run(cmd, env, err)
            err.seek(0)
            said = err.read().strip().splitlines()
        if status is None:
            return {"made": False, "why": f"the sample run took over {TIMEOUT} s"}
        if status == sample.NOT_SAMPLED:
            return {"made": False, "why": "this output is not streamed through the plan executor (GGUF and "
                    "adapters are written by their own writers), so no sample of it can be run"}
        if not report.is_file():
            return {"made": False, "why": f"the sample run failed ({(said or ['no message'])[-1]})"}
        facts = json.loads(report.read_text())
    return _scaled(facts, begun)


def _run(cmd: list[str], env: dict, err) -> int | None:
    """Run ``cmd``: its exit status (None: killed after ``TIMEOUT``)."""
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    try:
        return proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def _scaled(f: dict, begun: float) -> dict:
    weights = {n: s for n, s in f["files"].items()
               if Path(n).suffix in WEIGHT_SUFFIXES or Path(n).name in WEIGHT_INDEXES or "/" in n}
    side = sum(s for n, s in f["files"].items() if n not in weights)
    sampled_out = sum(weights.values())
    if f.get("weight_bytes") is not None:  # the writer's exact bytes (headers, index): the plan knows them all
        out_bytes = side + f["weight_bytes"]
    else:
        out_bytes = side + (round(sampled_out * f["bytes"] / f["sample_bytes"]) if f["sample_bytes"] else sampled_out)
    streaming = f["ended"] - f["started"]
    startup = f["started"] - begun
    writing = min(f.get("writing", streaming), streaming)  # the tensors' part of it: scaled; the rest is once a run
    computing = writing * (f["reads"] / f["sample_reads"] if f["sample_reads"] else 1.0)
    made = out_bytes - side  # at the rate the sample made them, or the disk's where the throttle holds the writer
    written = writeback.seconds(made, made / computing, f.get("writeback")) if computing > 0 < made else computing
    seconds = startup + (streaming - writing) + written
    return {"made": True, "output_bytes": out_bytes, "weight_bytes": made, "exact": f.get("weight_bytes") is not None,
            "temporary_disk": out_bytes, "peak_rss": f["peak_rss"],
            "seconds": round(seconds, 2),
            "sample": {"tensors": f["sampled"], "of": f["entries"], "reads": f["sample_reads"], "of_reads": f["reads"],
                       "startup_seconds": round(startup, 2), "seconds": round(streaming, 3),
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
