"""A file's BLAKE3 on a thread, alone and beside a busy Python thread: ``io.digests`` against 1 MiB chunks read.

Conversions hash their sources on a thread while the main thread imports, plans and writes (``digests.ahead``, the
receipt's ``Sources``, the resume ledger). Read in 1 MiB chunks, each chunk hands the GIL back and forth twice, and
beside a busy thread each hand-back waits out its switch interval. ``io.digests`` hashes ``WINDOW`` bytes of the
file's mapping per call. Prints each way's speed (GB/s) and the ratio against the chunks, in the same run, and this
process's peak RSS (a mapping keeps the pages it touched resident unless they are let go: ``digests._unmapped``).

    .venv/bin/python -P benchmarks/bench_hash.py [--gb 2] [FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import blake3

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ffn_tools.io import digests, sample  # noqa: E402


def chunks(path: Path) -> str:
    """The way before: 1 MiB read into one buffer, hashed, again."""
    h, buf = blake3.blake3(), memoryview(bytearray(1 << 20))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


def mapped(path: Path) -> str:
    return digests.file_digest(path, fresh=True) or ""


def busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def timed(fn, path: Path, beside: bool) -> tuple[float, str]:
    stop = threading.Event()
    other = threading.Thread(target=busy, args=(stop,))
    if beside:
        other.start()
    try:
        t = time.perf_counter()
        digest = fn(path)
        return time.perf_counter() - t, digest
    finally:
        stop.set()
        if beside:
            other.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", help="a file to hash (default: one of --gb random bytes under bench-data/)")
    ap.add_argument("--gb", type=float, default=2.0)
    args = ap.parse_args()
    path = Path(args.file) if args.file else ROOT / "bench-data" / f"hash-{args.gb:g}g.bin"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            for _ in range(int(args.gb * 1024 / 64)):
                f.write(os.urandom(64 << 20))
    size = path.stat().st_size
    chunks(path)  # in the page cache for both
    print(f"{path} ({size / 1e9:.2f} GB, in the page cache), window {digests.WINDOW >> 20} MiB")
    for beside in (False, True):
        (tc, dc), (tm, dm) = timed(chunks, path, beside), timed(mapped, path, beside)
        assert dc == dm, "the two digests differ"
        print(f"{'beside a busy thread' if beside else 'alone':>21}: 1 MiB chunks {size / 1e9 / tc:5.2f} GB/s, "
              f"mapped windows {size / 1e9 / tm:5.2f} GB/s: {tc / tm:5.1f}x as fast")
    print(f"peak RSS of this process: {sample.peak() / 2**20:.0f} MB")


if __name__ == "__main__":
    main()
