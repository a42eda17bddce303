"""Content digests of files (BLAKE3), each file's bytes hashed once per process.

The resume ledger hashes each shard as it is finished (``io.resume``), the receipt every output and source file
(``io.receipt``): a digest is remembered under the file's identity (resolved path, inode, size, modification
time), so a shard the ledger hashed is not read again for the receipt, and a file changed since is.

BLAKE3, not SHA-256: 5.4 GB/s a core here against SHA-256's 1.05 (SHA-NI); at SHA-256's speed the hashes were
most of a copy's time and of a quantized export's CPU time (docs/performance.md#receipts). ``b3sum`` checks one by
hand. SHA-256 is still read, for receipts written before (``ALGORITHMS``).

A file is hashed through a read-only mapping, ``WINDOW`` bytes per call: the hash releases the GIL for the whole
window. Read in 1 MiB chunks, every chunk handed the GIL back and forth twice, and a hashing thread beside Python
work (a conversion's imports and planning, a writer) waited out the other's switch interval each time: 0.10 GB/s
against 3-4 GB/s alone. Windows of 32 MiB hash at 2.3-2.5 GB/s beside it (64 MiB: 2.7-3.1, at twice the RSS: a
window's pages are resident while it is hashed; ``benchmarks/bench_hash.py``). A file that cannot be mapped (empty, a
pipe) is read in chunks. ``threads``: BLAKE3's own threads for one file, where the cores are idle (an output's
receipt, the last shard).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import blake3

EVERY_CORE = blake3.blake3.AUTO  # ``threads`` for a file hashed while nothing else runs
WINDOW = 32 << 20  # mapped bytes hashed per call (a stop is seen between two, ~10 ms apart; RSS holds one window)
HASH_CHUNK = 1 << 20  # read and hashed at a time where a file cannot be mapped
ALGORITHM = "blake3"
ALGORITHMS: dict[str, Callable[[], Any]] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}

_known: dict[tuple, str] = {}
_busy: dict[tuple, threading.Lock] = {}  # a file being hashed: held by the thread reading it
_lock = threading.Lock()


def _identity(path: Path) -> tuple:
    st = os.stat(path)
    return str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns


def file_digest(path: Path, stop: threading.Event | None = None, *, fresh: bool = False,
                algorithm: str = ALGORITHM, threads: int = 1) -> str | None:
    """The hex digest of a file's bytes; None if ``stop`` was set before the last window. ``fresh``: read the bytes
    again even if this process hashed the file unchanged before (the ledger's check of a killed run's shard).
    A file another thread is hashing now is not read twice: this call waits for that digest (``ahead``).
    ``threads``: BLAKE3's threads for this file (``EVERY_CORE``: as many as there are cores)."""
    ident = (algorithm, *_identity(path))
    if fresh:
        return _hashed(path, ident, stop, threads)
    if (known := _known.get(ident)) is not None:
        return known
    with _lock:
        busy = _busy.setdefault(ident, threading.Lock())
    while not busy.acquire(timeout=0.05):  # one thread reads a file at a time; the next finds its digest
        if stop is not None and stop.is_set():  # a failed run's receipt does not wait for the other's digest
            return None
    try:
        if (known := _known.get(ident)) is not None:
            return known
        return _hashed(path, ident, stop, threads)
    finally:
        busy.release()


def _hashed(path: Path, ident: tuple, stop: threading.Event | None, threads: int = 1) -> str | None:
    h = blake3.blake3(max_threads=threads) if ident[0] == "blake3" else ALGORITHMS[ident[0]]()
    if not hash_into(h, path, stop):
        return None
    digest = h.hexdigest()
    if (ident[0], *_identity(path)) == ident:  # not written to while it was read
        with _lock:
            _known[ident] = digest
    return digest


def hash_into(h, path: Path, stop: threading.Event | None = None, budget: int | None = None) -> bool:
    """Feed ``h`` the bytes of ``path`` (the first ``budget`` of them, where given), a ``WINDOW`` of its mapping at a
    time (see the module doc); False if ``stop`` was set before the end."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        end = size if budget is None else min(size, budget)
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if end else None
        except (OSError, ValueError):
            mapped = None
        if mapped is None:
            return _read_into(h, f, end if budget is not None else None, stop)
        with mapped:
            view = memoryview(mapped)
            try:
                end = min(end, len(mapped))
                for at in range(0, end, WINDOW):
                    if stop is not None and stop.is_set():
                        return False
                    h.update(view[at:min(at + WINDOW, end)])
                    _unmapped(mapped, at, min(at + WINDOW, end))
            finally:
                view.release()
    return True


def _unmapped(mapped: mmap.mmap, start: int, end: int) -> None:
    """The pages of bytes ``start`` to ``end`` out of this process's memory (they stay in the page cache): a mapping
    keeps every page it touched resident, so a 5 GB shard hashed through one counted 5 GB in the process's RSS
    (measured). Not ``MADV_SEQUENTIAL``: that let the kernel drop the pages from the cache, which a conversion then
    read from disk."""
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        start -= start % mmap.PAGESIZE  # where a page begins (the bytes before it are hashed already)
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def _read_into(h, f, left: int | None, stop: threading.Event | None) -> bool:
    buf = memoryview(bytearray(HASH_CHUNK))  # read into again and again: no fresh pages to fault in for each chunk
    while n := f.readinto(buf if left is None else buf[:min(HASH_CHUNK, left)]):
        if stop is not None and stop.is_set():
            return False
        h.update(buf[:n])
        if left is not None:
            left -= n
    return True


@contextmanager
def ahead(files) -> Iterator[None]:
    """``files`` hashed on a thread while the block runs (the receipt's sources, while a conversion checks and plans:
    a 16 GB model's 3 CPU-s of hashing then run beside the imports and planning, on the core they leave idle,
    instead of beside the quantizing workers later); the receipt then finds their digests. Stopped at the
    block's end, within a window, where it has not finished (the run failed)."""
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [file_digest(f, stop) for f in files], name="ffn-tools-hash-ahead",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
