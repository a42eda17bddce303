"""``verify --resume``: a killed verify continues from the FFN steps it had finished.

Every verify keeps a ledger of its FFN steps (``pairrun.PairRun``) in this user's cache (``io.cache``),
``verify/KEY-PID/`` (``~/.cache/ffn-tools`` by default; a verify of the same pair beside it keeps its
own; a cache that cannot be written only leaves nothing to resume from): ``plan.json`` (the key: the tool's version and
its libraries' installs, both sides' files with their sizes and modification times, every option that shapes the
results, the steps planned) and, per finished step, ``step-K.json`` with its results (written atomically, once the
step is done). The ledger is removed when verify ends, except where an interruption (Ctrl-C, SIGTERM, SIGHUP) ended
it after some steps were finished (kept, and a line says where and how to continue or discard it) or a kill left no
chance to clean up (SIGKILL, the OOM killer, a lost machine). ``--resume`` then reuses the results of every
finished step of the same key (the first FFN of each kind excepted: the kernel backends run it afterwards from what
it computed, so it runs again), and runs the rest; the report is an uninterrupted run's but for the wall times of the
steps run again. ``--resume`` takes the newest ledger of the key whose process no longer runs (where there is none,
or it has no finished step, a line says so); without it, such ledgers are removed, and a line says so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from ..errors import counted
from ..ffn import FFNRef
from ..io.cache import cache_dir
from ..io.output import alive
from ..io.resume import Ledger, input_stamp, plan_key
from ..progress import say
from ..tolerances import Tolerance
from .report import BackendResult, FFNResult

NOT_OPTIONS = ("resume", "ray", "ledger")  # how verify runs, not what it finds

log = logging.getLogger(__name__)


def key(a, b, options: dict) -> str:
    """The key of ``verify(a, b, **options)``: both sides' files, the options that shape the results."""
    shaping = {k: str(v) for k, v in sorted(options.items()) if k not in NOT_OPTIONS}
    return plan_key(command="verify", inputs=input_stamp([a, b]), options=shaping)


def home() -> Path:
    return cache_dir() / "verify"


def _as_dict(r: FFNResult) -> dict:
    """Everything of a result, floats as they are (JSON's NaN and Infinity included: read back exactly)."""
    return {"ref": [r.ref.layer, r.ref.kind, r.ref.expert], "shape_a": list(r.shape_a), "shape_b": list(r.shape_b),
            "dtype_a": r.dtype_a, "dtype_b": r.dtype_b, "exact": r.exact, "problems": r.problems, "notes": r.notes,
            "backends": [vars(b) for b in r.backends],
            "tolerance": vars(r.tolerance) if r.tolerance is not None else None, "bits_a": r.bits_a,
            "bits_b": r.bits_b}


def _from_dict(d: dict) -> FFNResult:
    layer, kind, expert = d["ref"]
    return FFNResult(ref=FFNRef(layer, kind, expert), shape_a=(d["shape_a"][0], d["shape_a"][1]),
                     shape_b=(d["shape_b"][0], d["shape_b"][1]), dtype_a=d["dtype_a"], dtype_b=d["dtype_b"],
                     exact=d["exact"], problems=d["problems"], notes=d["notes"],
                     backends=[BackendResult(**b) for b in d["backends"]],
                     tolerance=Tolerance(**d["tolerance"]) if d["tolerance"] is not None else None,
                     bits_a=d["bits_a"], bits_b=d["bits_b"])


def _dead(p: Path) -> bool:
    """Whether the ledger ``KEY-PID`` was left by a process that no longer runs."""
    pid = p.name.rsplit("-", 1)[1]
    return pid.isdigit() and not alive(int(pid))


class StepLedger:
    """The ledger of one verify's FFN steps (see the module docstring)."""

    def __init__(self, run: tuple[str, bool], planned: list[str]):
        run_key, resuming = run
        self.key = plan_key(run=run_key, steps=planned)
        self.dir = home() / f"{self.key}-{os.getpid()}"  # a verify of the same pair running beside it has its own
        self.reused = 0
        self.kept = True
        self.adopted = False  # a killed run's ledger taken over (--resume): only then are there steps to reuse
        dead = sorted((p for p in home().glob(f"{self.key}-*") if _dead(p)), key=lambda p: p.stat().st_mtime_ns)
        if resuming and dead:
            os.replace(dead.pop(), self.dir)  # the newest killed run's
            self.adopted = True
        for p in dead:
            said = len(list(p.glob("step-*.json")))
            shutil.rmtree(p, ignore_errors=True)
            if said:
                say(f"verify: removed what a killed or interrupted run of this same verify had finished ({said} FFN "
                    "steps); --resume continues one")
        if resuming and not self.steps():
            say("verify --resume: no FFN step of this same verify was left finished (by a killed or interrupted run); "
                "running every step")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            Ledger._write(self.dir / "plan.json", {"key": self.key})
        except OSError:
            self.kept = False  # no cache to write to: nothing to resume from, the verify itself unchanged

    def steps(self) -> int:
        """How many finished steps the ledger holds."""
        return len(list(self.dir.glob("step-*.json")))

    def done(self, k: int) -> list[FFNResult] | None:
        """Step ``k``'s results, where a killed run of this key finished it."""
        if not self.adopted:
            return None
        try:
            d = json.loads((self.dir / f"step-{k}.json").read_text())
            if d.get("key") != self.key:
                return None
            results = [_from_dict(r) for r in d["results"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self.reused += 1
        return results

    def finished(self, k: int, results: list[FFNResult]) -> None:
        if not self.kept:
            return
        try:
            Ledger._write(self.dir / f"step-{k}.json", {"key": self.key, "results": [_as_dict(r) for r in results]})
        except OSError:  # a full or read-only cache: only what --resume could reuse is lost
            self.kept = False

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def leave(self, exc_type, exc, tb) -> None:
        """Verify's end (an ``ExitStack``'s exit callback): the ledger is removed, but where an interruption (Ctrl-C;
        SIGTERM, SIGHUP as the CLI raises them) ended it after finished steps: kept for ``--resume``, said in one line
        on stderr whatever ``--quiet`` says (it leaves files on the disk)."""
        if isinstance(exc, KeyboardInterrupt) and self.kept and (n := self.steps()):
            log.warning("verify: interrupted: kept the %s it had finished in %s; the same verify with --resume "
                        "continues from them, without --resume (or rm -r %s) discards them",
                        counted(n, "FFN step"), self.dir, self.dir)
            return
        self.remove()
