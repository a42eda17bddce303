"""The kernel's dirty-page throttle, as ``--dry-run``'s estimate models it (``ffn_tools.estimate``).

Linux lets a process dirty page-cache pages as fast as it makes them until the dirty pages reach the "freerun"
point, halfway between the background threshold (``vm.dirty_background_ratio`` or ``_bytes``) and the limit
(``vm.dirty_ratio`` or ``_bytes``) of the dirtyable memory (free pages and the file cache); the flusher writes them
back from the background threshold on, and past the freerun point ``balance_dirty_pages`` holds writers to the
speed it writes them back at. A sample run writes far less than that point and never meets it, so where the whole
output would pass it the sample times the disk. On this project's machines the disk took 2.5-3.3 GB/s and no command
waits on it: the slow writes once put down to this throttle (0.36 GB/s in a 4 GB cast) were the host of the virtual
machine faulting in again page-cache pages it had taken back, which the sample meets as the run does
(docs/performance.md#dry-run-estimates).

``measure`` (in the sample run) reads the thresholds and the dirty pages now, and, only where the whole output would
pass the freerun point, times the disk: the sample's own output flushed with ``fsync`` (its bytes over the time
taken). ``seconds`` then gives the time to write an output at a given speed under that throttle.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

VM = Path("/proc/sys/vm")


def _meminfo() -> dict[str, int]:
    out = {}
    for row in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = row.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def thresholds() -> dict | None:
    """``background``, ``limit`` and ``dirty`` (dirty or under writeback now) in bytes; None where /proc does not
    tell (not Linux)."""
    try:
        mem = _meminfo()
        vm = {n: int((VM / n).read_text()) for n in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes",
                                                     "dirty_background_bytes")}
        dirtyable = mem["MemFree"] + mem["Active(file)"] + mem["Inactive(file)"]
        dirty = mem["Dirty"] + mem.get("Writeback", 0)
    except (OSError, KeyError, ValueError):
        return None
    limit = vm["dirty_bytes"] or dirtyable * vm["dirty_ratio"] // 100
    background = vm["dirty_background_bytes"] or dirtyable * vm["dirty_background_ratio"] // 100
    if background >= limit:  # as the kernel corrects it
        background = limit // 2
    return {"background": background, "limit": limit, "dirty": dirty}


def freerun(t: dict) -> float:
    return (t["background"] + t["limit"]) / 2


def measure(files: list[Path], total: int) -> dict | None:
    """The throttle's facts for an output of ``total`` bytes of which ``files`` (just written, in the page cache)
    are a sample: ``thresholds``, and ``flushed`` bytes in ``flush_seconds`` where ``total`` would pass the freerun
    point (the sample is flushed to time the disk: a dry run then takes that much longer)."""
    t = thresholds()
    if t is None:
        return None
    sizes = [f.stat().st_size for f in files]
    t["dirty"] = max(t["dirty"] - sum(sizes), 0)  # the sample's own pages are dirty now: not the run's start
    if t["dirty"] + total <= freerun(t):
        return t
    begun, flushed = time.monotonic(), 0
    for f, size in zip(files, sizes):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        flushed += size
    return {**t, "flushed": flushed, "flush_seconds": time.monotonic() - begun}


def seconds(total: float, rate: float, t: dict | None) -> float:
    """Seconds to write ``total`` bytes made at ``rate`` bytes a second under the throttle ``t`` (``measure``): at
    ``rate`` until the dirty pages reach the freerun point (written back at the disk's speed from the background
    threshold on), then at the disk's speed."""
    if rate <= 0:
        return 0.0
    if t is None or not t.get("flush_seconds") or not t.get("flushed"):
        return total / rate  # nothing known of the disk: no throttle expected (measure's reason)
    disk = t["flushed"] / t["flush_seconds"]
    if rate <= disk:
        return total / rate
    dirty, left, spent = float(t["dirty"]), float(total), 0.0
    made = min(left, max(t["background"] - dirty, 0.0))  # nothing written back yet
    spent, left, dirty = spent + made / rate, left - made, dirty + made
    made = min(left, max(freerun(t) - dirty, 0.0) * rate / (rate - disk))  # made at rate, written back at disk
    spent, left = spent + made / rate, left - made
    return spent + left / disk
