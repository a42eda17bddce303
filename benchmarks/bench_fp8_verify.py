"""verify of a DeepSeek-V3-shaped FP8 pair (A and its fuse-gateup) against a plain read-both-and-compare script.

Builds (under bench-data/, reused) a DeepSeek-V3-shaped checkpoint: hidden 7168, MLA attention, every layer MoE
with ``--experts`` routed experts of DeepSeek-V3's own size (moe_intermediate 2048) and its shared expert, every
projection FP8 E4M3 with 128x128 ``weight_scale_inv`` blocks, as DeepSeek ships it (vocabulary cut to 8192: the
embedding is not what is measured). B is ``ffn-tools fuse-gateup A`` (FP8 codes and scales moved by rows, byte for
byte). Then times, page cache warm, best of ``--rounds``:

    plain   a script that reads every tensor of A and of B and compares B's bytes with A's (B's fused gate_up
            split in two by rows): the floor of any byte-equal check
    verify  ``ffn-tools verify A B --no-load-check`` (every other default): the FFNs compared as stored bytes
            (codes and scales), the first FFN of each kind also run dequantized on the float64 reference

and prints seconds, the ratio (target: verify <= 1.3x plain, per expert and overall) and peak RSS; with two or
more sizes, what one more expert costs each.

    .venv/bin/python benchmarks/bench_fp8_verify.py [--layers 1] [--experts 16 64] [--rounds 2] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import _warm, timed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench-data"
BIN = Path(sys.executable).parent / "ffn-tools"
BLOCK = 128
SHARD_BYTES = 4 * 10**9


def config(layers: int, experts: int) -> dict:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=8192, num_hidden_layers=layers, n_routed_experts=experts, first_k_dense_replace=0,
                           num_experts_per_tok=min(8, experts), n_group=1, topk_group=1).to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    return cfg


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter of transformers' DeepseekV3ForCausalLM for ``cfg``, built on the meta device."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    c = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(c)
    out = {}
    for n, p in model.state_dict().items():
        if ".mlp.experts." in n and n.endswith(("gate_up_proj", "down_proj")):  # transformers v5 stacks them:
            layer = n.split(".mlp.")[0]  # DeepSeek's checkpoint stores each expert apart
            e, rows, cols = p.shape
            for k in range(e):
                if n.endswith("gate_up_proj"):
                    out[f"{layer}.mlp.experts.{k}.gate_proj.weight"] = (rows // 2, cols)
                    out[f"{layer}.mlp.experts.{k}.up_proj.weight"] = (rows // 2, cols)
                else:
                    out[f"{layer}.mlp.experts.{k}.down_proj.weight"] = (rows, cols)
        else:
            out[n] = tuple(p.shape)
    return out


def build(path: Path, layers: int, experts: int) -> None:
    if (path / "config.json").is_file():
        return
    import torch
    from safetensors.torch import save_file

    cfg = config(layers, experts)
    tmp = path.with_name(path.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shard: dict = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []

    def flush() -> None:
        if shard:
            name = f"part-{len(files):05d}.safetensors"
            save_file(shard, tmp / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            files.append(name)
            shard.clear()

    size = 0
    for name, shape in shapes(cfg).items():
        quantized = name.endswith("proj.weight") and len(shape) == 2 and all(s % BLOCK == 0 for s in shape) \
            and "kv_a_proj" not in name  # DeepSeek keeps a few small ones in bf16; any rule does here
        if quantized:
            w = (torch.randn(shape, generator=gen) * 96).clamp(-448, 448).to(torch.float8_e4m3fn)
            s = torch.rand((shape[0] // BLOCK, shape[1] // BLOCK), generator=gen) * 1e-4 + 1e-5
            tensors = {name: w, name + "_scale_inv": s}
        else:
            tensors = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if size and size + nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard.update(tensors)
        size += nbytes
    flush()
    renamed = {}
    for k, f in enumerate(files):  # model-0000k-of-0000N, as the Hub names them
        renamed[f] = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(tmp / f, tmp / renamed[f])
    index = {"metadata": {}, "weight_map": {n: renamed[f] for n, f in weight_map.items()}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, path)


PLAIN = r"""
import sys, pathlib
import torch
from safetensors import safe_open
a, b = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def opened(root):
    files = {f.name: safe_open(str(f), framework="pt") for f in sorted(root.glob("*.safetensors"))}
    return files, {n: f for f, h in files.items() for n in h.keys()}
fa, wa = opened(a)
fb, wb = opened(b)
def get(files, where, name):
    return files[where[name]].get_tensor(name).clone()  # get_tensor maps the file: clone reads the bytes
def raw(t):
    return t.contiguous().view(-1).view(torch.uint8)
bad = 0
for name in wb:
    t = get(fb, wb, name)
    if "gate_up_proj" in name:
        g, u = t.chunk(2, dim=0)
        pairs = [(get(fa, wa, name.replace("gate_up_proj", p)), x) for p, x in (("gate_proj", g), ("up_proj", u))]
    else:
        pairs = [(get(fa, wa, name), t)]
    bad += sum(not torch.equal(raw(x), raw(y)) for x, y in pairs)
print("differ:", bad)
"""


def measure(layers: int, experts: int, rounds: int, keep: bool) -> dict:
    a = DATA / f"dsv3-fp8-{layers}l-{experts}e"
    b = a.with_name(a.name + "-fused")
    py = sys.executable
    subprocess.run([py, "-P", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import bench_fp8_verify as m; "
                    "m.build(m.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))",
                    str(Path(__file__).resolve().parent), str(a), str(layers), str(experts)], check=True)
    if not (b / "config.json").is_file():
        subprocess.run([str(BIN), "-q", "fuse-gateup", str(a), "-o", str(b), "--max-shard-size", "4GB"], check=True,
                       stdout=subprocess.DEVNULL)
    size = sum(f.stat().st_size for f in a.glob("*.safetensors"))
    _warm(a), _warm(b)
    runs = {"plain": [py, "-P", "-c", PLAIN, str(a), str(b)],  # -P: the repository's kernels/ shadows transformers' one
            "verify": [str(BIN), "verify", str(a), str(b), "--no-load-check"]}
    best = {k: (float("inf"), 0.0, "") for k in runs}
    for _ in range(rounds):
        for name, cmd in runs.items():
            dt, rss, out = timed(cmd)
            best[name] = (min(dt, best[name][0]), max(rss, best[name][1]), out if dt < best[name][0] else best[name][2])
    if not keep:
        shutil.rmtree(a), shutil.rmtree(b)
    verdict = next((ln for ln in reversed(best["verify"][2].splitlines()) if ln.startswith(("PASS", "FAIL"))), "?")
    return {"experts": experts, "ffns": layers * (experts + 1), "gb": size / 1e9, "verdict": verdict,
            "plain_out": best["plain"][2].strip(), **{k: v[:2] for k, v in best.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, nargs="+", default=[16, 64],
                    help="Routed experts per layer, one checkpoint pair each (two or more: the cost of one more "
                         "expert is printed too, from the smallest and the largest).")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="Keep the checkpoints under bench-data/ for another run.")
    args = ap.parse_args()
    print(f"DeepSeek-V3 shapes (hidden 7168, expert d_ffn 2048, FP8 128x128 blocks), {args.layers} layer(s); B = "
          f"fuse-gateup of A; best of {args.rounds}; load average {os.getloadavg()[0]:.1f}")
    rows = [measure(args.layers, e, args.rounds, args.keep) for e in sorted(args.experts)]
    print(f"{'experts':>8}{'A GB':>7}{'plain s':>9}{'verify s':>10}{'ratio':>7}{'plain RSS':>11}"
          f"{'verify RSS':>12}  verdict")
    for r in rows:
        print(f"{r['experts']:>8}{r['gb']:>7.2f}{r['plain'][0]:>9.2f}{r['verify'][0]:>10.2f}"
              f"{r['verify'][0] / r['plain'][0]:>6.2f}x{r['plain'][1]:>9.0f}MB{r['verify'][1]:>10.0f}MB  "
              f"{r['verdict'][:60]}")
        if r["plain_out"] != "differ: 0":
            sys.exit(f"the plain script found differences: {r['plain_out']}")
    if len(rows) > 1:
        lo, hi = rows[0], rows[-1]
        n = (hi["ffns"] - lo["ffns"])
        per = {k: (hi[k][0] - lo[k][0]) / n for k in ("plain", "verify")}
        print(f"one more expert (44 MB of FP8 codes a side): plain {per['plain'] * 1e3:.1f} ms, verify "
              f"{per['verify'] * 1e3:.1f} ms = {per['verify'] / per['plain']:.2f}x (target <= 1.3x)")
    last = rows[-1]
    ratio = last["verify"][0] / last["plain"][0]
    met = "met" if ratio <= 1.3 else "NOT met"
    print(f"overall at {last['gb']:.1f} GB a side: {ratio:.2f}x (target <= 1.3x: {met})")


if __name__ == "__main__":
    main()
