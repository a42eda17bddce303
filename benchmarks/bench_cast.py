"""``convert --to torch --dtype float16`` against ``cp -r`` and the ways people cast a checkpoint, from one run.

Builds (under bench-data/, reused) bench_scale.py's Phi-3-mini-shaped bf16 checkpoint of ``--gb`` (2 GB shards),
reads it once (page cache warm), then times in fresh processes, alternating, ``--rounds`` rounds of:

    cp            ``cp -r DIR OUT``: the floor, the same bytes moved
    ffn-tools     ``ffn-tools -q convert DIR --to torch --dtype float16 -o OUT``
    plain         a shard at a time: safetensors ``load_file``, ``.to(float16)``, ``save_file`` (what people write)
    transformers  ``from_pretrained(DIR, dtype=float16).save_pretrained(OUT)`` (``--transformers``: the whole model
                  in memory, twice)

each after ``bench_scale.settle`` (this VM's host takes back freed memory, and a run's speed otherwise depends on how
long ago the last one ended), and prints each one's median time, CPU seconds and the largest peak RSS (``wait4``), and
ffn-tools' ratio to each. ffn-tools' output must hold the plain script's tensors bit for bit, or the benchmark fails.

    .venv/bin/python benchmarks/bench_cast.py --gb 4 [--rounds 3] [--transformers] [--settle S] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale  # noqa: E402

FFN = str(Path(sys.executable).parent / "ffn-tools")
DATA = bench_scale.ROOT / "bench-data"

PLAIN = r"""
import json, shutil, sys, pathlib, torch
from safetensors.torch import load_file, save_file
a, b = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
b.mkdir()
for f in sorted(a.glob("*.safetensors")):
    save_file({k: v.to(torch.float16) for k, v in load_file(f).items()}, b / f.name, metadata={"format": "pt"})
shutil.copy(a / "model.safetensors.index.json", b)
cfg = json.loads((a / "config.json").read_text())
cfg["dtype"] = "float16"
(b / "config.json").write_text(json.dumps(cfg, indent=2))
"""

TRANSFORMERS = r"""
import sys, torch
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float16).save_pretrained(sys.argv[2])
"""

SAME = r"""
import sys, pathlib, torch
from safetensors import safe_open
a, b = (pathlib.Path(p) for p in sys.argv[1:3])
fa = {n: f for f in sorted(a.glob("*.safetensors")) for n in safe_open(str(f), "pt").keys()}
fb = {n: f for f in sorted(b.glob("*.safetensors")) for n in safe_open(str(f), "pt").keys()}
assert sorted(fa) == sorted(fb), sorted(set(fa) ^ set(fb))
for n in fa:
    x, y = safe_open(str(fa[n]), "pt").get_tensor(n), safe_open(str(fb[n]), "pt").get_tensor(n)
    assert x.dtype == y.dtype == torch.float16 and x.shape == y.shape, n
    assert x.view(torch.int16).equal(y.view(torch.int16)), n  # bits, NaN included
print(len(fa))
"""


def commands(src: Path, out: Path, transformers: bool) -> dict[str, list[str]]:
    cmds = {"cp": ["cp", "-r", str(src), str(out)],
            "ffn-tools": [FFN, "-q", "convert", str(src), "--to", "torch", "--dtype", "float16", "-o", str(out)],
            "plain": [sys.executable, "-P", "-c", PLAIN, str(src), str(out)]}
    if transformers:
        cmds["transformers"] = [sys.executable, "-P", "-c", TRANSFORMERS, str(src), str(out)]
    return cmds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transformers", action="store_true", help="also time transformers' load-and-save")
    ap.add_argument("--settle", type=float, default=None, help=bench_scale.SETTLE_HELP)
    ap.add_argument("--keep", action="store_true", help="keep the built checkpoint")
    args = ap.parse_args()
    wait = bench_scale.settle_seconds(args.settle)
    layers = bench_scale.layers_for("phi3", args.gb)
    src = DATA / f"estimate-phi3-{layers}l"  # bench_estimate.py's: one build serves both
    subprocess.run([sys.executable, "-P", "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                    f"import bench_scale; bench_scale.build(bench_scale.Path({str(src)!r}), 'phi3', {layers})"],
                   check=True)
    bench_scale._warm(src)
    size = sum(f.stat().st_size for f in src.iterdir())
    print(f"{size / 1e9:.2f} GB bf16 -> float16, {args.rounds} rounds, settling {wait:.0f} s before each run",
          flush=True)
    outs = {name: DATA / f"cast-out-{name}" for name in commands(src, DATA, args.transformers)}
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in outs}
    for r in range(args.rounds):
        for name, out in outs.items():
            bench_scale.settle(wait)
            dt, usage, _ = bench_scale.timed_usage(commands(src, out, args.transformers)[name])
            runs[name].append((dt, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024))
            print(f"round {r + 1} {name:12s} {dt:6.2f} s  {usage.ru_utime + usage.ru_stime:6.2f} CPU-s  "
                  f"{usage.ru_maxrss / 1024:7.0f} MB", flush=True)
            if r + 1 < args.rounds or name not in ("ffn-tools", "plain"):  # the last two are compared
                shutil.rmtree(out, ignore_errors=True)
    same = subprocess.run([sys.executable, "-P", "-c", SAME, str(outs["ffn-tools"]), str(outs["plain"])],
                          capture_output=True, text=True)
    if same.returncode:
        raise SystemExit(f"ffn-tools' output is not the plain script's: {same.stderr.strip().splitlines()[-1]}")
    print(f"ffn-tools' {same.stdout.strip()} tensors are the plain script's, bit for bit")
    med = {name: (statistics.median(t for t, _, _ in v), statistics.median(c for _, c, _ in v), max(m for *_, m in v))
           for name, v in runs.items()}
    ours = med["ffn-tools"]
    print(f"{'':12s} {'time':>8s} {'CPU-s':>8s} {'peak RSS':>9s}   ffn-tools / it: time, CPU, RSS")
    for name, (t, c, m) in med.items():
        print(f"{name:12s} {t:7.2f}s {c:8.2f} {m:7.0f}MB   {ours[0] / t:.2f}x {ours[1] / c:.2f}x {ours[2] / m:.2f}x")
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
