"""Timings and load measurements that unit tests leave out (a machine under load is slower, not wrong): each
prints what it measured beside its bar. The tests hold what cannot depend on load: the decision given measured
numbers (tests/test_mlx.py: ``busy_cores`` from given /proc/stat readings, ``idle_cores`` from given busy
cores), the same fields and tensors as gguf-py (tests/test_gguf.py), the refusal naming the count
(tests/test_hardening.py).

    busy      a process spinning on one core, seen at once by the MLX export's ``busy_cores`` (its pool's worker
              count comes from the last quarter second, not the 1-minute load average). Bar: >= 0.8 of a core
              (on an idle machine; another process's load adds to it).
    header    ``converters/gguf/header.Reader`` against gguf-py's ``GGUFReader`` on a GGUF holding a 151,936-token
              vocabulary and 150,000 merges (Qwen's size). Bar: ours < 1/3 of theirs (measured on Qwen3-MoE's
              GGUF: 1.8 s and 0.12 s).
    msgpack   a Flax msgpack claiming 30 million items in 1 KB, refused by ``inspect``. Bar: < 5 s (the work is
              bounded by the file, not the claim).

``verify --generate``'s added time is ``bench_generate.py``'s.

    .venv/bin/python benchmarks/bench_timings.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def busy(repeat: int) -> None:
    from ffn_tools.converters.mlx import workers

    seen = []
    for _ in range(repeat):
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)
            seen.append(workers.busy_cores())
        finally:
            spin.kill()
            spin.wait()
    if None in seen:
        print("busy     no /proc/stat here: not measured")
        return
    low = min(x for x in seen if x is not None)
    print(f"busy     a spinning process read as {low:.2f} busy cores (least of {repeat}); bar >= 0.8: "
          f"{'met' if low >= 0.8 else 'NOT met'}; idle_cores() now {workers.idle_cores()} of "
          f"{len(os.sched_getaffinity(0))}")


def header(repeat: int, tmp: Path) -> None:
    import numpy as np
    from gguf import GGUFReader, GGUFWriter

    from ffn_tools.converters.gguf.header import Reader

    path = tmp / "vocab.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    n = 151_936
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(n)])
    w.add_token_types([1] * n)
    w.add_token_merges([f"tok{i} tok{i + 1}" for i in range(150_000)])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    theirs, ours = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        GGUFReader(str(path))
        t1 = time.perf_counter()
        Reader(str(path))
        t2 = time.perf_counter()
        theirs.append(t1 - t0)
        ours.append(t2 - t1)
    a, b = min(theirs), min(ours)
    print(f"header   gguf-py {a:.2f} s, header.Reader {b:.3f} s (best of {repeat}): {a / b:.1f}x; bar < 1/3: "
          f"{'met' if b < a / 3 else 'NOT met'}")


def msgpack(repeat: int, tmp: Path) -> None:
    from click.testing import CliRunner

    from ffn_tools.cli import cli

    p = tmp / "flax_model.msgpack"
    p.write_bytes(b"\x81\xa1a\xdd" + struct.pack(">I", 30_000_000) + b"\x01" * 1000)
    took = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = CliRunner().invoke(cli, ["inspect", str(p)])
        took.append(time.perf_counter() - t0)
        assert r.exit_code == 2 and "30000000" in r.output, r.output
    print(f"msgpack  refused in {min(took):.3f} s (best of {repeat}); bar < 5 s: "
          f"{'met' if min(took) < 5 else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        busy(args.repeat)
        header(args.repeat, Path(d))
        msgpack(args.repeat, Path(d))


if __name__ == "__main__":
    main()
