"""SHA-256 of files, each file's bytes hashed once per process.

The resume ledger hashes each shard as it is finished (``io.resume``), the receipt every output and source file
(``io.receipt``): a digest is remembered under the file's identity (resolved path, inode, size, modification
time), so a shard the ledger hashed is not read again for the receipt, and a file changed since is.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

HASH_CHUNK = 1 << 20  # read and hashed at a time (cache-sized; more held no time)

_known: dict[tuple, str] = {}
_lock = threading.Lock()


def _identity(path: Path) -> tuple:
    st = os.stat(path)
    return str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns


def file_sha256(path: Path, stop: threading.Event | None = None, *, fresh: bool = False) -> str | None:
    """The SHA-256 of a file's bytes; None if ``stop`` was set before the last chunk. ``fresh``: read the bytes
    again even if this process hashed the file unchanged before (the ledger's check of a killed run's shard)."""
    ident = _identity(path)
    if not fresh and (known := _known.get(ident)) is not None:
        return known
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(HASH_CHUNK):
            if stop is not None and stop.is_set():
                return None
            h.update(chunk)
    digest = h.hexdigest()
    if _identity(path) == ident:  # not written to while it was read
        with _lock:
            _known[ident] = digest
    return digest
