"""split-gateup against `cp -r` of the same folder (and a naive safetensors script), from one run.

Builds (or reuses, under bench-data/) a sharded bf16 Phi-3-shaped checkpoint: d_model 2048, d_ffn 5632,
12 layers, fused gate_up_proj, ~1.1 GB. Then times, alternating, several rounds of:

    cp -r DIR OUT                                   the floor: a plain copy of the same bytes
    ffn-tools -q split-gateup DIR -o OUT --force    the command users run (a fresh process each time)
    naive: safetensors load_file, chunk, save_file  what people write by hand

and prints medians, the ratios to cp, and each process's peak RSS (from wait4). The page cache is warm
for all of them (every round reads the same input). Targets: split <= 1.3x cp, peak RSS <= 200 MB.

    .venv/bin/python benchmarks/bench_split.py [--layers 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent / "ffn-tools"

NAIVE = r"""
import sys, json, pathlib
from safetensors.torch import load_file, save_file
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
for shard in sorted(src.glob("*.safetensors")):
    t = load_file(shard)
    for k in [k for k in t if k.endswith("gate_up_proj.weight")]:
        g, u = t.pop(k).chunk(2, dim=0)
        t[k.replace("gate_up_proj", "gate_proj")] = g.contiguous()
        t[k.replace("gate_up_proj", "up_proj")] = u.contiguous()
    save_file(t, dst / shard.name, metadata={"format": "pt"})
"""


def build(path: Path, layers: int, d: int = 2048, i: int = 5632, vocab: int = 32064) -> Path:
    """A Phi-3-shaped bf16 checkpoint written with ffn-tools' own streaming writer (500 MB shards)."""
    if (path / "model.safetensors.index.json").is_file():
        return path
    import torch

    from ffn_tools.io.writer import OutTensor, write_sharded

    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.qkv_proj.weight": (3 * d, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_up_proj.weight": (2 * i, d), p + "mlp.down_proj.weight": (d, i),
                       p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    gen = torch.Generator().manual_seed(0)

    def make(shape):
        return lambda: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    items = [OutTensor(n, "BF16", s, 2 * _numel(s), make(s)) for n, s in sorted(shapes.items())]
    tmp = path.with_name(path.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_sharded(tmp, items, max_shard_size=500 * 10**6, metadata={"format": "pt"})
    config = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": d, "intermediate_size": i,
              "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 32,
              "vocab_size": vocab, "hidden_act": "silu", "dtype": "bfloat16", "tie_word_embeddings": True}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, path)
    return path


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def timed(cmd: list[str]) -> tuple[float, float]:
    """Run ``cmd``; return (seconds, peak RSS in MB) of that one process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[:3]} failed: {p.stderr.read().decode()[-2000:]}")
    return dt, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive script (slow, ~1 GB RSS)")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    src = args.data / f"phi3-{args.layers}l"
    if args.build_only:
        build(src, args.layers)
        return
    # Build in a child: Linux carries a process's peak RSS across fork+exec, so this process must stay
    # small for wait4's ru_maxrss to measure each timed command alone.
    subprocess.run([sys.executable, __file__, "--build-only", "--layers", str(args.layers), "--data", str(args.data)],
                   check=True)
    size = sum(f.stat().st_size for f in src.iterdir())
    out = args.data / "out"
    runs = {"cp -r": ["cp", "-r", str(src), str(out)],
            "ffn-tools split-gateup": [str(BIN), "-q", "split-gateup", str(src), "-o", str(out), "--force"]}
    if not args.no_naive:
        runs["naive safetensors script"] = [sys.executable, "-c", NAIVE, str(src), str(out)]
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["cp", "-r", str(src), str(out)], check=True)  # warm the page cache
    for _ in range(args.rounds):
        for name, cmd in runs.items():
            shutil.rmtree(out, ignore_errors=True)
            results[name].append(timed(cmd))
    shutil.rmtree(out, ignore_errors=True)
    base = statistics.median(t for t, _ in results["cp -r"])
    print(f"input: {src} ({size / 1e9:.2f} GB, {len(list(src.glob('*.safetensors')))} shards), "
          f"{args.rounds} rounds, medians")
    print(f"{'':<26}{'seconds':>9}{'x cp -r':>9}{'peak RSS MB':>13}")
    for name, rs in results.items():
        t = statistics.median(t for t, _ in rs)
        rss = max(r for _, r in rs)
        print(f"{name:<26}{t:>9.3f}{t / base:>9.2f}{rss:>13.0f}")
    t = statistics.median(t for t, _ in results["ffn-tools split-gateup"])
    rss = max(r for _, r in results["ffn-tools split-gateup"])
    print(f"target split <= 1.3x cp: {'met' if t / base <= 1.3 else 'NOT met'} ({t / base:.2f}x); "
          f"peak RSS <= 200 MB: {'met' if rss <= 200 else 'NOT met'} ({rss:.0f} MB)")


if __name__ == "__main__":
    main()
