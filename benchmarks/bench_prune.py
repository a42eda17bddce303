"""``ffn-tools prune-experts`` on a stacked MoE against `cp -r` of the same folder, from one run (issue #56's bar:
pruning a 16 GB stacked MoE runs at `cp` speed in bounded memory).

Builds (under bench-data/, removed afterwards unless --keep) a synthetic bf16 Qwen3-MoE whose 128 routed experts are
stacked as transformers v5 stores them (``mlp.experts.gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)), with
``bench_scale.py``'s builder (shards of at most 2 GB, as the Hub's): shape ``qwen3-30b`` is Qwen3-30B-A3B's
(d_model 2048, expert d_ffn 768, 151,936 tokens: a layer's gate_up stack is 805 MB), ``qwen3-moe`` bench_scale's small
one. Then times in fresh processes, alternating, each output removed before the next run:

    cp        cp -r A OUT: the floor, a copy of every byte
    first     ffn-tools -q prune-experts A --keep 0-95 -o OUT: 25 % of the experts dropped, the kept ones one
              contiguous run of each stack
    spread    ffn-tools -q prune-experts A --drop 3,7,11,...: every 4th expert dropped, 32 runs of each stack

and prints the median and best time of each, the ratios to cp (target: cp's speed, the median within 1.05x: cp's own
rounds spread by up to 20 % here; the prune writes 3/4 of the expert bytes, and hashes its sources and outputs for
its receipt), each process's peak RSS from ``os.wait4`` (target: bounded, at most 1 GB above the largest
tensor whatever the size) and the output's size and files. Between runs the disk is synced and, where free pages go
back to a host, the memory let settle (``bench_scale.settle``).

    .venv/bin/python benchmarks/bench_prune.py --gb 16 [--shape qwen3-30b] [--rounds 3] [--keep]
    .venv/bin/python benchmarks/bench_prune.py --gb 0.3 --shape qwen3-moe
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_scale  # noqa: E402  (its builder, shapes and timing: this process imports nothing heavy)

bench_scale.SHAPES.setdefault("qwen3-30b", ("qwen3_moe", 2048, 768, 151936, 32, 4, 128))


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(args) -> dict:
    shape, experts = args.shape, bench_scale.SHAPES[args.shape][-1]
    layers = bench_scale.layers_for(shape, args.gb)
    a = args.data / f"prune-{shape}-{layers}l"
    out = args.data / "prune-out"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(HERE / "bench_prune.py"), "--build-only", str(a), "--shape", shape,
                    "--layers", str(layers)], check=True)
    built = time.perf_counter() - t0
    keep = experts - experts // 4
    ffn = [str(bench_scale.BIN), "-q", "prune-experts", str(a), "-o", str(out)]
    runs = {"cp": ["cp", "-r", str(a), str(out)],
            "first": [*ffn, "--keep", f"0-{keep - 1}"],
            "spread": [*ffn, "--drop", ",".join(str(e) for e in range(3, experts, 4))]}
    best = {k: (float("inf"), 0.0) for k in runs}
    times: dict[str, list[float]] = {k: [] for k in runs}
    sizes, files = {}, {}
    settle = bench_scale.settle_seconds(args.settle)
    for _ in range(args.rounds):
        for name, cmd in runs.items():
            shutil.rmtree(out, ignore_errors=True)
            bench_scale.settle(settle)
            dt, rss, _ = bench_scale.timed(cmd)
            best[name] = (min(best[name][0], dt), max(best[name][1], rss))
            times[name].append(dt)
            sizes[name] = _size(out)
            files[name] = len(list(out.glob("*.safetensors")))
    shutil.rmtree(out, ignore_errors=True)
    largest = max(2 * bench_scale._numel(s) for s in bench_scale.tensors(shape, layers).values())
    result = {"gb": _size(a) / 1e9, "layers": layers, "largest": largest / 2**20, "built": built, "best": best,
              "times": times, "sizes": sizes, "files": files}
    if not args.keep:
        shutil.rmtree(a)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=16.0, help="checkpoint size in GB")
    ap.add_argument("--shape", choices=["qwen3-30b", "qwen3-moe"], default="qwen3-30b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", type=Path, default=HERE.parent / "bench-data")
    ap.add_argument("--keep", action="store_true", help="keep the built checkpoint (reused by a later run)")
    ap.add_argument("--settle", type=float, default=None, help=bench_scale.SETTLE_HELP)
    ap.add_argument("--build-only", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_only:
        bench_scale.build(args.build_only, args.shape, args.layers)
        return
    _, d, i, _, _, _, e = bench_scale.SHAPES[args.shape]
    r = measure(args)
    med = {k: statistics.median(v) for k, v in r["times"].items()}
    print(f"{r['gb']:.2f} GB bf16 {args.shape} (d_model {d}, expert d_ffn {i}, {e} experts stacked, {r['layers']} "
          f"layers, largest tensor {r['largest']:.0f} MB; built in {r['built']:.0f} s), {args.rounds} rounds:")
    worst, above = 0.0, 0.0
    for name in ("cp", "first", "spread"):
        dt, rss = r["best"][name]
        ratio = "" if name == "cp" else (f"= {med[name] / med['cp']:.2f}x cp (median), "
                                         f"{dt / r['best']['cp'][0]:.2f}x (best)")
        if name != "cp":
            worst, above = max(worst, med[name] / med["cp"]), max(above, rss - r["largest"])
        rounds = ", ".join(f"{t:.1f}" for t in r["times"][name])
        print(f"  {name:7s} median {med[name]:6.1f} s, best {dt:6.1f} s (rounds {rounds}); peak RSS {rss:5.0f} MB; "
              f"output {r['sizes'][name] / 1e9:.2f} GB in {r['files'][name]} files {ratio}")
    rss_ok = "met" if above <= 1024 else "NOT met"
    print(f"targets: prune at cp's speed (median <= 1.05x): {'met' if worst <= 1.05 else 'NOT met'} "
          f"(worst {worst:.2f}x); peak RSS <= 1024 MB above the largest tensor: {rss_ok} ({above:.0f} MB)")


if __name__ == "__main__":
    main()
