"""Content digests of files (BLAKE3), each file's bytes hashed once per process.

The resume ledger hashes each shard as it is finished (``io.resume``), the receipt every output and source file
(``io.receipt``): a digest is remembered under the file's identity (resolved path, inode, size, modification
time), so a shard the ledger hashed is not read again for the receipt, and a file changed since is.

BLAKE3, not SHA-256: 5.4 GB/s a core here against SHA-256's 1.05 (SHA-NI); at SHA-256's speed the hashes were
most of a copy's time and of a quantized export's CPU time (docs/performance.md#receipts). ``b3sum`` checks one by
hand. SHA-256 is still read, for receipts written before (``ALGORITHMS``).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import blake3

HASH_CHUNK = 1 << 20  # read and hashed at a time (cache-sized; more held no time)
ALGORITHM = "blake3"
ALGORITHMS: dict[str, Callable[[], Any]] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}

_known: dict[tuple, str] = {}
_busy: dict[tuple, threading.Lock] = {}  # a file being hashed: held by the thread reading it
_lock = threading.Lock()


def _identity(path: Path) -> tuple:
    st = os.stat(path)
    return str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns


def file_digest(path: Path, stop: threading.Event | None = None, *, fresh: bool = False,
                algorithm: str = ALGORITHM) -> str | None:
    """The hex digest of a file's bytes; None if ``stop`` was set before the last chunk. ``fresh``: read the bytes
    again even if this process hashed the file unchanged before (the ledger's check of a killed run's shard).
    A file another thread is hashing now is not read twice: this call waits for that digest (``ahead``)."""
    ident = (algorithm, *_identity(path))
    if fresh:
        return _hashed(path, ident, stop)
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
        return _hashed(path, ident, stop)
    finally:
        busy.release()


def _hashed(path: Path, ident: tuple, stop: threading.Event | None) -> str | None:
    h = ALGORITHMS[ident[0]]()
    buf = memoryview(bytearray(HASH_CHUNK))  # read into again and again: no fresh pages to fault in for each chunk
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            if stop is not None and stop.is_set():
                return None
            h.update(buf[:n])
    digest = h.hexdigest()
    if (ident[0], *_identity(path)) == ident:  # not written to while it was read
        with _lock:
            _known[ident] = digest
    return digest


@contextmanager
def ahead(files) -> Iterator[None]:
    """``files`` hashed on a thread while the block runs (the receipt's sources, while a conversion checks and plans:
    a 16 GB model's 3 CPU-s of hashing then run beside the imports and planning, on the core they leave idle,
    instead of beside the quantizing workers later); the receipt then finds their digests. Stopped at the
    block's end, within a chunk, where it has not finished (the run failed)."""
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [file_digest(f, stop) for f in files], name="ffn-tools-hash-ahead",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
