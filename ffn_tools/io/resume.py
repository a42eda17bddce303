"""``--resume``: a killed conversion continues from the shards it had finished.

Every directory output of shards (``executor.execute`` with a writer that writes safetensors shards: split-gateup,
fuse-gateup, merge, extract, convert --to torch and --to mlx) keeps, in its temporary directory, a ledger
``.ffn-tools-resume/``:

- ``plan.json``: the key of the run (``plan_key``: the tool's version and its libraries' installs, the command,
  the output's name, every output tensor's name, dtype, shape and recipe, the shard size, the metadata, and each
  input file's path, size and modification time, the adapter's too for merge). A partial output is only ever
  continued by the same run.
- ``SHARD.json`` per finished shard: its size and BLAKE3 digest (``io.digests``), computed by a background thread
  from the file just closed (from the page cache, while the next shard is written), written (atomically) only after
  the shard's last byte. The same digests make the output's receipt (``io.receipt``).

A process killed in any way (SIGKILL included: nothing of it runs) leaves its temporary directory
``.OUT.tmp-PID-TAG``. ``--resume`` adopts the newest such directory of a process that no longer runs whose
``plan.json`` has this run's key; a shard is reused only when its manifest says this key and its bytes hash, read
again, to the recorded digest; every other shard is written again. A run ended by a signal it can handle (Ctrl-C,
SIGTERM, SIGHUP: ``output.atomic_output``) keeps its temporary directory too, where the ledger has finished shards,
and says so in one line. The ledger is removed last (``remove_ledger``: after the side files and the receipt, just
before the output is moved into place), so a kill in the end phase loses no finished shard, and a resumed output is
byte-identical to an uninterrupted one, file for file. Without ``--resume``, such a directory is removed as before,
and a line says what was thrown away; ``--resume`` with no such directory of this run says so, and writes it all.

``io.run.Run.resume`` carries the flag from the command (``api``) to the one place that writes
(``output.atomic_output``): an output that cannot be continued (one file, GGUF, Orbax, DCP, Flax, an adapter) refuses ``--resume`` up front.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .digests import ALGORITHM, EVERY_CORE, file_digest

LEDGER = ".ffn-tools-resume"
CHECKERS = 4  # threads hashing finished shards again on --resume (at most the cores)

# the libraries whose code makes output bytes, by distribution name -> module: their versions are in every receipt
# (``io.receipt``), where they are installed, and when, in a run's key (an upgrade between a kill and --resume could
# change what a shard holds)
LIBRARIES = {"torch": "torch", "numpy": "numpy", "safetensors": "safetensors", "transformers": "transformers",
             "mlx": "mlx", "mlx-lm": "mlx_lm", "gguf": "gguf", "jax": "jax", "flax": "flax",
             "orbax-checkpoint": "orbax.checkpoint"}


@functools.lru_cache(maxsize=1)
def tool_version() -> str:
    """ffn-tools' installed version ("source": run from a source tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ffn-tools")
    except PackageNotFoundError:
        return "source"


def plan_key(**parts) -> str:
    """The SHA-256 of ``parts`` (JSON-able, ``str`` for anything else): what makes two runs the same run."""
    text = json.dumps({"version": tool_version(), "libraries": installed(), **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def installed() -> dict[str, tuple[str, int]]:
    """Where each of ``LIBRARIES`` is installed and when its files were written (a reinstall or upgrade changes it),
    found without importing it (``find_spec``: a fraction of a millisecond; asking the packages' metadata for their
    versions took 0.1 s), so the key is the same whatever the process has imported."""
    import importlib.util

    out = {}
    for name in LIBRARIES.values():
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        where = spec.origin or next(iter(spec.submodule_search_locations or []), None)  # a namespace: its directory
        if where:
            out[name] = (where, os.stat(where).st_mtime_ns)
    return out


def input_stamp(paths) -> list[tuple[str, int, int]]:
    """Each input file's resolved path, size and modification time (ns): a changed input makes another run."""
    out = []
    for p in paths:
        p = Path(p).resolve()
        files = sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() else [p]
        for f in files:
            st = f.stat()
            out.append((str(f), st.st_size, st.st_mtime_ns))
    return out


def ledger_key(tmp: Path) -> str | None:
    """The run key a temporary output's ledger records, or None (no ledger, or unreadable)."""
    try:
        return json.loads((tmp / LEDGER / "plan.json").read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def finished_shards(tmp: Path) -> int:
    """How many shards a temporary output's ledger says are finished."""
    d = tmp / LEDGER
    return sum(1 for p in d.glob("*.json") if p.name != "plan.json") if d.is_dir() else 0


class Ledger:
    """The ledger of one temporary output directory ``tmp`` for the run ``key`` (see the module docstring).

    ``reusable(name)`` says whether shard ``name`` is finished (manifest of this key, size and digest of its
    bytes as recorded); ``finished(name)`` queues the shard just closed for hashing and its manifest;
    ``close()`` waits for the shards queued (their digests are the receipt's, ``io.receipt``: the last one is
    the only shard hashed after the writing), or, where the writing failed, stops. The ledger is deleted by
    ``atomic_output``, last, just before the output moves into place (``remove_ledger``).
    """

    def __init__(self, tmp: Path, key: str):
        self.tmp, self.key, self.dir = tmp, key, tmp / LEDGER
        self.dir.mkdir(exist_ok=True)
        self._write(self.dir / "plan.json", {"key": key})
        self.reused: list[str] = []
        self._checks = self._check_all()
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ffn-tools-shard-hash", daemon=True)
        self._thread.start()

    @staticmethod
    def _write(path: Path, obj: dict) -> None:
        part = path.with_name(path.name + ".part")
        part.write_text(json.dumps(obj) + "\n")
        os.replace(part, path)

    def _check_all(self) -> dict[str, Future]:
        """Every shard the ledger says is finished, its bytes hashed again by ``CHECKERS`` threads at once (the
        hashing releases the GIL): a resume checks at the speed of the disk, not of one core."""
        names = [p.name.removesuffix(".json") for p in self.dir.glob("*.json") if p.name != "plan.json"]
        if not names:
            return {}
        pool = ThreadPoolExecutor(min(CHECKERS, os.cpu_count() or 1, len(names)), "ffn-tools-shard-check")
        checks = {n: pool.submit(self._check, n) for n in sorted(names)}
        pool.shutdown(wait=False)
        return checks

    def _check(self, name: str) -> bool:
        try:
            m = json.loads((self.dir / f"{name}.json").read_text())
        except (OSError, ValueError):
            return False
        path = self.tmp / name
        return (isinstance(m, dict) and m.get("key") == self.key and path.is_file()
                and path.stat().st_size == m.get("size") and file_digest(path, fresh=True) == m.get(ALGORITHM))

    def reusable(self, name: str) -> bool:
        check = self._checks.get(name)
        ok = check is not None and check.result()
        if ok:
            self.reused.append(name)
        return ok

    def forget(self, name: str) -> None:
        """Shard ``name`` is about to be written (again): its manifest no longer holds."""
        (self.dir / f"{name}.json").unlink(missing_ok=True)

    def finished(self, name: str, last: bool = False) -> None:
        """Shard ``name`` is written: queued for its digest and manifest. ``last``: no shard is written after it, so
        its hashing has the cores to itself (BLAKE3's threads: the one hashing left after the writing, shortened)."""
        self._queue.put((name, EVERY_CORE if last else 1))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None and not self._stop.is_set():
                try:
                    self.manifest(*item)
                except BaseException as e:  # said by close(): a missing manifest only costs a rewrite
                    self._error = e

    def manifest(self, name: str, threads: int = 1) -> None:
        """Hash shard ``name`` (on ``threads``) and write its manifest, now (``finished`` has the thread do it)."""
        path = self.tmp / name
        size = path.stat().st_size
        if (digest := file_digest(path, self._stop, threads=threads)) is not None:
            self._write(self.dir / f"{name}.json", {"key": self.key, "size": size, ALGORITHM: digest})

    def close(self, failed: bool = False) -> None:
        """Let the hashing thread finish the shards queued (stop it at once where the writing ``failed``); raise
        what it met, unless the writing itself failed (its error is the one to see, not this one's)."""
        if failed:
            self._stop.set()
        self._queue.put(None)
        self._thread.join()
        if self._error is not None and not failed:
            raise self._error

def remove_ledger(tmp: Path) -> None:
    """Delete the ledger of the temporary output ``tmp``, if it has one: the last step before ``tmp`` is moved into
    place (``output.atomic_output``), so a kill before it leaves every finished shard to ``--resume``. The run's key
    goes last: a kill half-way through leaves a ledger whose remaining shards still count."""
    d = tmp / LEDGER
    if not d.is_dir():
        return
    for p in sorted(d.iterdir(), key=lambda p: p.name == "plan.json"):
        p.unlink()
    d.rmdir()
