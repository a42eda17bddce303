"""Every writing command and ``verify`` on one model at two sizes: peak memory against issue 34's bound.

The bound (issue 34, item 1): a command's peak RSS <= 2 GB + the largest tensor, whatever the model's size, and
flat as the model grows. For each size given to ``--gb`` this builds (under bench-data/, a tensor at a time with
``bench_mlx.build``) a bf16 Llama-shaped checkpoint with Llama-3-8B's layers (d_model 4096, d_ffn 14336, 8 KV heads)
and llama.cpp's 32,000-token SentencePiece vocabulary (``bench_gguf.build``), as many layers as make the size; the
largest tensor (the embedding and the head, 262 MB) is the same at every size. Then it runs, each in a fresh
process, one after the other (outputs removed as soon as measured, so the disk holds at most two models):

    mlx          convert A --to mlx
    mlx-q4       convert A --to mlx --quantize 4 --group-size 64
    gguf         convert A --to gguf (bf16)
    gguf-q8_0    convert A --to gguf --outtype q8_0
    torch-f16    convert A --to torch --dtype float16 (a cast)
    fuse         fuse-gateup A -> B
    verify       verify A B --no-load-check (every other default)
    split        split-gateup B -> C

and prints, per command and size, the peak of the sum of the RSS of the command's process tree (sampled every
50 ms from /proc: the workers of ``-q`` and the GGUF converter's processes count together; a shared page counts
once per process, so this over-counts) and the largest single process (``wait4``'s ru_maxrss), with the bound and
the ratio between the largest and the smallest size. Nothing is timed here (the other benchmarks time each
command against its baseline); the sampler itself costs a few percent of a core. This process imports nothing
heavy and builds in a child (Linux carries a parent's peak RSS into a forked child's ru_maxrss).

    .venv/bin/python benchmarks/bench_memory.py --gb 1 20      # ~20 min on 2 cores, ~45 GB of disk at the peak
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
BIN = str(Path(sys.executable).parent / "ffn-tools")
LAYER = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
VOCAB = 32000  # llama-spm's
BOUND = 2 * 10**9  # + the largest tensor
PAGE = os.sysconf("SC_PAGE_SIZE")


def layer_bytes() -> int:
    h, i = LAYER["hidden_size"], LAYER["intermediate_size"]
    kv = h // LAYER["num_attention_heads"] * LAYER["num_key_value_heads"]
    return 2 * (2 * h * h + 2 * kv * h + 3 * h * i + 2 * h)


def fixed_bytes() -> int:
    return 2 * (2 * VOCAB * LAYER["hidden_size"] + LAYER["hidden_size"])


def largest() -> int:
    return 2 * VOCAB * LAYER["hidden_size"]


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (each thread's ``children``: a child started from a thread is listed there)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def run(cmd: list[str]) -> tuple[int, int, float]:
    """``cmd`` in a fresh process: (peak of its tree's summed RSS, its largest process's peak RSS, seconds)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], sum(_rss(q) for q in _tree(p.pid)))

    errors: list[bytes] = []
    threads = [threading.Thread(target=sample), threading.Thread(target=lambda: errors.append(p.stderr.read()))]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(p.pid, 0)
    stop.set()
    for t in threads:
        t.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed:\n{b''.join(errors).decode()[-3000:]}")
    return peak[0], usage.ru_maxrss * 1024, time.perf_counter() - t0


def measure(gb: float, data: Path) -> dict:
    layers = max(1, round((gb * 1e9 - fixed_bytes()) / layer_bytes()))
    a, b, out = data / f"memory-{layers}l", data / f"memory-{layers}l-fused", data / f"memory-{layers}l-out"
    if not (a / "config.json").is_file():
        t0 = time.perf_counter()
        # in a process of its own: Linux carries a parent's peak RSS into a forked child's ru_maxrss
        subprocess.run([sys.executable, "-P", __file__, "--build-only", str(a), "--layers", str(layers)], check=True)
        print(f"  built {a.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in a.glob("*.safetensors"))
    steps = {
        "mlx": [BIN, "-q", "convert", a, "--to", "mlx", "-o", out],
        "mlx-q4": [BIN, "-q", "convert", a, "--to", "mlx", "--quantize", "4", "--group-size", "64", "-o", out],
        "gguf": [BIN, "-q", "convert", a, "--to", "gguf", "-o", out.with_suffix(".gguf")],
        "gguf-q8_0": [BIN, "-q", "convert", a, "--to", "gguf", "--outtype", "q8_0", "-o", out.with_suffix(".gguf")],
        "torch-f16": [BIN, "-q", "convert", a, "--to", "torch", "--dtype", "float16", "-o", out],
        "fuse": [BIN, "-q", "fuse-gateup", a, "-o", b],
        "verify": [BIN, "-q", "verify", a, b, "--no-load-check"],
        "split": [BIN, "-q", "split-gateup", b, "-o", out],
    }
    peaks = {}
    for name, cmd in steps.items():
        if name == "split":  # A is no longer needed: the disk holds B and C, not three models
            shutil.rmtree(a)
        tree, one, seconds = run([str(c) for c in cmd])
        peaks[name] = {"tree": tree, "process": one, "seconds": seconds}
        for o in data.glob(f"{out.name}*"):  # the output, and a one-file output's receipt beside it
            if o.is_dir():
                shutil.rmtree(o)
            else:
                o.unlink()
        print(f"  {name:10s} {tree / 2**20:7.0f} MiB (tree), {one / 2**20:7.0f} MiB (largest process), "
              f"{seconds:6.1f} s", flush=True)
    shutil.rmtree(b)
    return {"gb": size / 1e9, "layers": layers, "peaks": peaks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, nargs="+", default=[1.0, 20.0], help="model sizes in GB")
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--build-only", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_only:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_gguf import build

        build(args.build_only, {**LAYER, "num_hidden_layers": args.layers}, "llama-spm", streamed=True)
        return
    bound = BOUND + largest()
    print(f"Llama-3-8B layers, {VOCAB} tokens, bf16; largest tensor {largest() / 2**20:.0f} MiB; bound 2 GB + it = "
          f"{bound / 2**20:.0f} MiB; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    results = []
    for gb in args.gb:
        print(f"{gb:g} GB:", flush=True)
        results.append(measure(gb, args.data))
    worst = max(p["tree"] for r in results for p in r["peaks"].values())
    print(f"bound: every command's peak (tree) <= {bound / 2**20:.0f} MiB: {'met' if worst <= bound else 'NOT met'} "
          f"(worst {worst / 2**20:.0f} MiB)")
    if len(results) > 1:
        lo, hi = results[0], results[-1]
        for name in lo["peaks"]:
            a, b = lo["peaks"][name]["tree"], hi["peaks"][name]["tree"]
            print(f"flatness {name:10s} {a / 2**20:6.0f} MiB at {lo['gb']:.1f} GB -> {b / 2**20:6.0f} MiB at "
                  f"{hi['gb']:.1f} GB ({b / a:.2f}x for {hi['gb'] / lo['gb']:.1f}x the size)")
    if args.json:
        args.json.write_text(json.dumps({"bound": bound, "results": results}, indent=1))
    if worst > bound:
        sys.exit(1)


if __name__ == "__main__":
    main()
