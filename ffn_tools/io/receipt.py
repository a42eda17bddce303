"""Receipts: every output says what made it and what it holds.

Every output ffn-tools writes (``output.atomic_output``: executor.execute's shards, GGUF, Orbax, DCP, Flax, adapters)
carries a receipt, ``ffn-tools-receipt.json``, inside a directory output, or beside a one-file output as
``OUT.ffn-tools-receipt.json``:

- ``tool``: ffn-tools' version, and the versions of the libraries that make output bytes;
- ``command`` and ``options``: the command (``api``'s function, as the command line names it) and what it was given
  (not ``--resume``: a resumed output is the uninterrupted one's, receipt included; not where the output was
  written: ``output`` is its name, and the receipt moves with it);
- ``sources``: every input file (path, size, BLAKE3: ``io.digests``), hashed by a background thread while the command
  streams it (the pages it reads are the ones the hash reads, from the page cache);
- ``outputs``: every file of the output (path relative to the output's directory, size, BLAKE3); a shard the resume
  ledger hashed while the next one was written is not read again.

It holds nothing that changes from one run to the next (no time, no process id), so two runs of the same command on
the same inputs write the same receipt. ``ffn-tools verify --receipt OUT`` checks an output against it without the
source (``checks.receipt``).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from .digests import ALGORITHM, ALGORITHMS, file_digest, hash_into
from .resume import LEDGER, LIBRARIES, tool_version

NAME = "ffn-tools-receipt.json"
VERSION = 2  # 1: SHA-256 digests (read still: ``DIGESTS``)
DIGESTS = {1: "sha256", 2: ALGORITHM}  # receipt version -> its digests' key and algorithm
HASHERS = 4  # threads hashing the output's files at the end (the hashing releases the GIL)
# given to a command, but not what its output is made of: --resume (a resumed output is the uninterrupted one's), and
# where the output is written (the receipt travels with it; ``output`` holds its name)
NOT_OPTIONS = ("resume", "out", "ray")  # --ray: a Ray run's output is the one-node run's, receipt included

def record(command: str, options: dict) -> tuple[str, dict]:
    """What a receipt records of ``command`` and the ``options`` it was given (``io.run.Run.command``; ``api``
    makes it): the options as JSON holds them, less those that are not what the output is made of."""
    return command, {k: _plain(v) for k, v in options.items() if k not in NOT_OPTIONS}


def _plain(v):
    """``v`` as JSON holds it, the same in every run (a function or object by its type's name, not its address)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_plain(x) for x in (sorted(v, key=str) if isinstance(v, (set, frozenset)) else v)]
    text = str(v)
    return type(v).__name__ if " at 0x" in text else text


def receipt_path(out: Path) -> Path:
    """Where the receipt of output ``out`` lies: inside a directory, beside a file."""
    out = Path(out)
    return out / NAME if out.is_dir() else out.with_name(out.name + "." + NAME)


def source_files(inputs) -> list[Path]:
    """The files under ``inputs`` (files, or directories read whole: every plain file in them, hidden ones and
    receipts aside), each once, in order."""
    seen, out = set(), []
    for p in inputs:
        p = Path(p)
        files = (sorted(f for f in p.rglob("*") if f.is_file() and f.name != NAME
                        and not any(part.startswith(".") for part in f.relative_to(p).parts))
                 if p.is_dir() else [p] if p.is_file() else [])
        for f in files:
            if (r := f.resolve()) not in seen:
                seen.add(r)
                out.append(f)
    return out


class Sources:
    """The input files hashed by background threads (``HASHERS`` files at a time, at most half the cores) from the
    moment the output is begun; ``digests()`` waits for the rest. ``stop()``: the run failed, nothing more is read.
    ``budget``: hash that many bytes in all, no more (the sample run of ``--dry-run``'s estimate, ``io.sample``: its
    share of the hashing; its digests mean nothing)."""

    def __init__(self, inputs, budget: int | None = None):
        self.files = source_files(inputs)
        self._stop = threading.Event()
        self._done: dict[Path, tuple[int, str]] = {}
        # half the cores at most: the writer and the shards' own hashing need the rest (on 2 cores, 2 source threads
        # made a split 13% slower than 1)
        threads = 1 if budget is not None else max(1, min(HASHERS, (os.cpu_count() or 2) // 2, len(self.files)))
        pool = ThreadPoolExecutor(threads, "ffn-tools-source-hash")
        self._futures = ([pool.submit(self._partial, budget)] if budget is not None
                         else [pool.submit(self._one, f) for f in self.files])
        pool.shutdown(wait=False)

    def _one(self, f: Path) -> None:
        size = f.stat().st_size
        if (digest := file_digest(f, self._stop)) is not None:
            self._done[f] = (size, digest)

    def _partial(self, left: int) -> None:
        for f in self.files:
            h, size = ALGORITHMS[ALGORITHM](), f.stat().st_size
            if left > 0 and hash_into(h, f, self._stop, left):
                left -= min(left, size)
            self._done[f] = (size, h.hexdigest())

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.cancel()
        wait(self._futures)

    def digests(self) -> list[dict]:
        for f in self._futures:
            f.result()  # an error hashing a source is said here, after the run's own
        return [{"path": os.path.abspath(f), "size": self._done[f][0], ALGORITHM: self._done[f][1]} for f in self.files]


@functools.lru_cache(maxsize=1)
def _tool() -> dict:
    """ffn-tools' version and its libraries' (asked once per process: the packages' metadata takes ~0.1 s)."""
    from importlib.metadata import PackageNotFoundError, version

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"name": "ffn-tools", "version": tool_version(),
            "libraries": {n: x for n in LIBRARIES if (x := v(n)) is not None}}


def output_files(path: Path, name: str | None = None) -> list[tuple[str, Path]]:
    """The files of an output at ``path`` (a file, or a directory's files at any depth), by the path the receipt
    gives them: relative to the directory, or the output's own name for one file (``name``: its name once in place,
    where ``path`` is its temporary)."""
    if path.is_dir():
        return sorted((f.relative_to(path).as_posix(), f) for f in path.rglob("*")
                      if f.is_file() and f.name != NAME and LEDGER not in f.relative_to(path).parts)  # removed last
    return [(name or path.name, path)]


def hashed(files: list[Path], algorithm: str = ALGORITHM) -> list[tuple[int, str]]:
    """Each file's size and digest, ``HASHERS`` files at a time, the cores shared among them (BLAKE3's own threads:
    one output shard hashed at the end on 2 cores, 1.7x faster than on one; a digest this process made before is
    reused). For an output's end and ``verify --receipt``, where nothing else runs."""
    cores = os.cpu_count() or 1
    hashers = max(1, min(HASHERS, cores, len(files)))

    def one(f: Path) -> tuple[int, str]:
        size = f.stat().st_size
        return size, file_digest(f, algorithm=algorithm, threads=max(1, cores // hashers)) or ""

    if len(files) <= 1:
        return [one(f) for f in files]
    with ThreadPoolExecutor(hashers, "ffn-tools-output-hash") as pool:
        return list(pool.map(one, files))


def make(out: Path, tmp: Path, sources: Sources, command: tuple[str, dict] | None = None) -> dict:
    """The receipt of the output at ``tmp``, to be moved to ``out``; ``command``: ``record``'s (None: a library call
    below the api, recorded as no command)."""
    name, options = command or (None, {})
    named = output_files(tmp, out.name)
    digests = hashed([f for _, f in named])
    return {"receipt": VERSION, "tool": copy.deepcopy(_tool()), "command": name, "options": options, "output": out.name,
            "sources": sources.digests(),
            "outputs": [{"path": rel, "size": size, ALGORITHM: digest}
                        for (rel, _), (size, digest) in zip(named, digests)]}


def write(receipt: dict, path: Path) -> None:
    path.write_text(json.dumps(receipt, indent=2, sort_keys=False) + "\n")
