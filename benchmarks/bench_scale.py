"""``ffn-tools verify A A-split`` at real scale: time against a plain script, and peak RSS, per model size.

For each size given to ``--gb`` it builds (under bench-data/, removed afterwards unless --keep) a synthetic
checkpoint of real shapes in bf16, written shard by shard with safetensors' ``save_file`` as a Hub checkpoint
is (shards of at most 2 GB), and B: its split made with ``ffn_tools.gateup.split_gateup`` (``--b split``, the
default), or A cast to float32 shard by shard (``--b float32``: every FFN runs on the float64 reference, on both
sides, and B's FFN is twice A's, so the pair is 3x a bf16 FFN; the largest tensor is B's). The shapes stay the
same at every size (only the number of layers grows), so the largest tensor is the same at every size:

    phi3         Phi-3-mini: d_model 3072, d_ffn 8192, vocab 32064, fused gate_up, untied head (largest 197 MB)
    phi3-medium  Phi-3-medium: d_model 5120, d_ffn 17920, vocab 32064 (largest: gate_up, 367 MB)
    small        d_model 512, d_ffn 1536, vocab 8192 (for sizes below 0.5 GB: the test's)
    qwen3-moe    Qwen3-MoE with 128 routed experts stacked as transformers v5 stores them (gate_up_proj
                 (E, 2I, H)), small sizes: d_model 512, expert d_ffn 256, vocab 8192; B holds 128 x 3
                 separate expert tensors per layer

Then, with the page cache warm (every file read once first), it times in fresh processes, alternating:

    plain     the floor: a script that reads every tensor of A and B (safetensors ``safe_open``, each tensor
              cloned: ``get_tensor`` only maps the file) and runs each of A's FFNs once in float32 on 32
              tokens (F.linear; a layer's experts in one bmm)
    verify    ``ffn-tools -q verify A B --no-load-check`` with every default (all backends available
              here, 32 tokens, the outside comparison, config and side files). B is a split Phi-3 (or
              per-expert Qwen3-MoE), a form transformers does not load: the load check would fail, not
              measure; its cost does not grow with the model (the model is built on the meta device)

and prints, per size, the best time of each and their ratio (target: verify <= 1.5x plain), and each
process's peak RSS from ``os.wait4`` (target: flat as the model grows, at most 1 GB above the largest
tensor). This process imports nothing heavy (Linux carries a parent's RSS into a forked child's peak).

    .venv/bin/python benchmarks/bench_scale.py --gb 1 2 4 8 [--shape phi3] [--rounds 2] [--keep]
    .venv/bin/python benchmarks/bench_scale.py --shape qwen3-moe --gb 0.4
    .venv/bin/python benchmarks/bench_scale.py --shape llama70b-ffn --gb 4 --b float32
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
BIN = Path(sys.executable).parent / "ffn-tools"
SHARD_BYTES = 2 * 10**9
TOKENS = 32  # verify's default
TIME_BAR_GB = 7.5  # the time target applies from about 8 GB (the bar: 8-16 GB)

# name -> model_type, d_model, d_ffn (per expert for MoE), vocab, heads, kv heads, experts (0: dense)
SHAPES = {
    "phi3": ("phi3", 3072, 8192, 32064, 32, 32, 0),
    "phi3-medium": ("phi3", 5120, 17920, 32064, 40, 10, 0),
    "llama70b-ffn": ("phi3", 8192, 28672, 32064, 64, 8, 0),  # Llama-70B's FFN and attention, fused, a small vocabulary
    "small": ("phi3", 512, 1536, 8192, 8, 8, 0),
    "qwen3-moe": ("qwen3_moe", 512, 256, 8192, 8, 4, 128),
    "qwen3-moe-tiny": ("qwen3_moe", 64, 32, 256, 4, 2, 128),  # tests/test_scale.py's
}


def tensors(shape: str, layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the A checkpoint and its shape (PyTorch (out, in))."""
    model_type, d, i, vocab, heads, kv, experts = SHAPES[shape]
    hd = d // heads
    out = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for n in range(layers):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        if experts:  # Qwen3-MoE: q/k/v/o, q_norm/k_norm, a router and the stacked experts
            out.update({p + "self_attn.q_proj.weight": (heads * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
                        p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, heads * hd),
                        p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                        p + "mlp.gate.weight": (experts, d),
                        p + "mlp.experts.gate_up_proj": (experts, 2 * i, d),  # (E, 2I, H)
                        p + "mlp.experts.down_proj": (experts, d, i)})  # (E, H, I)
        else:  # Phi-3: fused qkv and gate_up
            out.update({p + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, d),
                        p + "self_attn.o_proj.weight": (d, d),
                        p + "mlp.gate_up_proj.weight": (2 * i, d), p + "mlp.down_proj.weight": (d, i)})
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def layers_for(shape: str, gb: float) -> int:
    """The layer count whose bf16 checkpoint is closest to ``gb`` GB (at least 1)."""
    fixed = sum(2 * _numel(s) for s in tensors(shape, 0).values())
    per_layer = sum(2 * _numel(s) for s in tensors(shape, 1).values()) - fixed
    return max(1, round((gb * 1e9 - fixed) / per_layer))


def config(shape: str, layers: int) -> dict:
    model_type, d, i, vocab, heads, kv, experts = SHAPES[shape]
    cfg = {"model_type": model_type, "hidden_size": d, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "vocab_size": vocab, "hidden_act": "silu", "dtype": "bfloat16",
           "tie_word_embeddings": False, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
    if experts:
        return {**cfg, "architectures": ["Qwen3MoeForCausalLM"], "head_dim": d // heads, "intermediate_size": 4 * i,
                "moe_intermediate_size": i, "num_experts": experts, "num_experts_per_tok": 8,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    return {**cfg, "architectures": ["Phi3ForCausalLM"], "intermediate_size": i}


def build(path: Path, shape: str, layers: int) -> None:
    """A (reused when there): bf16 random weights, written shard by shard (<= SHARD_BYTES each)."""
    if (path / "model.safetensors.index.json").is_file():
        return
    import torch
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shapes = tensors(shape, layers)
    shards: list[list[str]] = [[]]
    size = 0
    for name, s in shapes.items():  # in model order, as save_pretrained shards
        if size and size + 2 * _numel(s) > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += 2 * _numel(s)
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        sd = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16) for n in names}
        save_file(sd, tmp / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del sd
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(config(shape, layers), indent=2))
    os.replace(tmp, path)


CAST = r"""
import json, os, shutil, sys, pathlib
from safetensors.torch import load_file, save_file
a, b = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
tmp = b.with_name(b.name + ".building")
shutil.rmtree(tmp, ignore_errors=True)
tmp.mkdir()
for f in sorted(a.glob("*.safetensors")):
    save_file({k: v.float() for k, v in load_file(f).items()}, tmp / f.name, metadata={"format": "pt"})
shutil.copy(a / "model.safetensors.index.json", tmp)
cfg = json.loads((a / "config.json").read_text())
cfg.update({k: "float32" for k in ("dtype", "torch_dtype") if k in cfg} or {"dtype": "float32"})
(tmp / "config.json").write_text(json.dumps(cfg, indent=2))
os.replace(tmp, b)
"""

PLAIN = r"""
import json, sys, pathlib
import torch, torch.nn.functional as F
from safetensors import safe_open
a, b, tokens = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
d = json.loads((a / "config.json").read_text())["hidden_size"]
x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(0)) * 0.5
for root in (a, b):
    files = {f.name: safe_open(str(f), framework="pt") for f in sorted(root.glob("*.safetensors"))}
    where = {n: f for f, h in files.items() for n in h.keys()}
    for name in where:
        if root == a and "down_proj" in name:  # read with its gate_up
            continue
        t = files[where[name]].get_tensor(name).clone()  # get_tensor maps the file: clone reads the bytes
        if root == a and "gate_up_proj" in name:
            down = name.replace("gate_up_proj", "down_proj")
            gu, dn = t.float(), files[where[down]].get_tensor(down).clone().float()
            if gu.dim() == 3:  # (E, 2I, H) and (E, H, I): every expert once, in one bmm
                g, u = gu.chunk(2, dim=1)
                xe = x.expand(gu.shape[0], -1, -1)
                torch.bmm(F.silu(torch.bmm(xe, g.transpose(1, 2))) * torch.bmm(xe, u.transpose(1, 2)),
                          dn.transpose(1, 2))
            else:
                g, u = gu.chunk(2, dim=0)
                F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), dn)
"""


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """Run ``cmd`` in a fresh process: (seconds, its peak RSS in MB from wait4, its stdout)."""
    dt, usage, out = timed_usage(cmd)
    return dt, usage.ru_maxrss / 1024, out


def timed_usage(cmd: list[str]):
    """Run ``cmd`` in a fresh process: (seconds, its ``resource.struct_rusage`` from wait4, its stdout)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

    def drain(stream, into):  # both pipes read while the process runs: a full pipe would block it
        for chunk in iter(lambda: stream.read(65536), b""):
            into.append(chunk)

    threads = [threading.Thread(target=drain, args=(p.stdout, chunks["out"])),
               threading.Thread(target=drain, args=(p.stderr, chunks["err"]))]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    for t in threads:
        t.join()
    p.returncode = code = os.waitstatus_to_exitcode(status)
    out, err = (b"".join(chunks[k]).decode() for k in ("out", "err"))
    if code != 0:
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} ... exited {code}:\n{out[-3000:]}\n{err[-3000:]}")
    return dt, usage, out


BALLOON = 0x0005  # virtio device id of a memory balloon
REPORTING = 5  # its VIRTIO_BALLOON_F_REPORTING feature bit


def page_reporting() -> bool:
    """Whether a virtio balloon here reports free pages to the host (which then drops them)."""
    for dev in Path("/sys/bus/virtio/devices").glob("*"):
        try:
            if int((dev / "device").read_text(), 16) == BALLOON and (dev / "features").read_text()[REPORTING] == "1":
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


SETTLE = 30.0  # seconds a run waits for the memory the last one freed to go back to the host (see ``settle``)
SETTLE_HELP = ("seconds between one run's end and the next's start (default: 30 where free pages are reported to a "
               "host, else 0)")


def settle_seconds(given: float | None) -> float:
    """A benchmark's ``--settle``: as given, else ``SETTLE`` where free pages are reported (``page_reporting``)."""
    return given if given is not None else SETTLE if page_reporting() else 0.0


def settle(seconds: float) -> None:
    """Every earlier write on the disk, and the memory it freed given back to the host: on a virtual machine whose
    balloon reports free pages (``page_reporting``), a write into memory freed a few seconds ago is fast, and one into
    memory the host took back faults every page in again (bench_estimate.py's docstring has the figures)."""
    os.sync()
    time.sleep(seconds)


def _warm(path: Path) -> None:
    for f in sorted(path.iterdir()):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(1 << 24):
                pass


def measure(args, gb: float) -> dict:
    shape = args.shape
    layers = layers_for(shape, gb)
    a = args.data / f"scale-{shape}-{layers}l"
    b = a.with_name(a.name + "-" + args.b)
    py = sys.executable
    t0 = time.perf_counter()
    subprocess.run([py, __file__, "--build-only", str(a), "--shape", shape, "--layers", str(layers)], check=True)
    if not (b / "config.json").is_file():
        make = CAST if args.b == "float32" else ("import sys; from ffn_tools.gateup import split_gateup; "
                                                 "split_gateup(sys.argv[1], sys.argv[2], force=True)")
        subprocess.run([py, "-P", "-c", make, str(a), str(b)], check=True, stdout=subprocess.DEVNULL)
    built = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in a.glob("*.safetensors"))
    largest = max(2 * _numel(s) for s in tensors(shape, layers).values()) * (2 if args.b == "float32" else 1)
    _warm(a), _warm(b)
    runs = {"plain": [py, "-c", PLAIN, str(a), str(b), str(TOKENS)],
            "verify": [str(BIN), "-q", "verify", str(a), str(b), "--no-load-check", *args.verify_args]}
    best = {k: (float("inf"), 0.0) for k in runs}
    out = ""
    for _ in range(args.rounds):
        for name, cmd in runs.items():
            dt, rss, text = timed(cmd)
            best[name] = (min(best[name][0], dt), max(best[name][1], rss))
            out = text if name == "verify" else out
    if not args.keep:
        shutil.rmtree(a), shutil.rmtree(b)
    verdict = next((ln for ln in reversed(out.splitlines()) if ln.startswith(("PASS", "FAIL"))), out[-300:])
    return {"gb": size / 1e9, "layers": layers, "largest": largest / 2**20, "built": built,
            "plain": best["plain"], "verify": best["verify"], "verdict": verdict,
            "ran": next((ln for ln in out.splitlines() if ln.startswith("ran: ")), "")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="checkpoint sizes in GB")
    ap.add_argument("--shape", choices=[*SHAPES, "auto"], default="auto",
                    help="shapes of the model (auto: phi3 from 0.5 GB up, else small)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data")
    ap.add_argument("--keep", action="store_true", help="keep the built checkpoints (reused by a later run)")
    ap.add_argument("--verify-arg", dest="verify_args", action="append", default=[],
                    help="an extra argument to ffn-tools verify (repeatable), e.g. --verify-arg=--backend=reference")
    ap.add_argument("--b", choices=["split", "float32"], default="split",
                    help="B: A's split (stored bytes equal A's; default), or A cast to float32 (every FFN runs "
                         "on the float64 reference, both sides)")
    ap.add_argument("--build-only", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.shape == "auto":
        args.shape = "phi3" if min(args.gb) >= 0.5 else "small"
    if args.build_only:
        build(args.build_only, args.shape, args.layers)
        return
    _, d, i, *_ = SHAPES[args.shape]
    print(f"shape {args.shape} (d_model {d}, d_ffn {i}), bf16, B {args.b}; best of {args.rounds}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    results = []
    for gb in args.gb:
        r = measure(args, gb)
        results.append(r)
        (tp, rp), (tv, rv) = r["plain"], r["verify"]
        print(f"{r['gb']:.2f} GB ({r['layers']} layers, largest tensor {r['largest']:.0f} MB): verify {tv:.1f} s / "
              f"plain {tp:.1f} s = {tv / tp:.2f}x; peak RSS verify {rv:.0f} MB, plain {rp:.0f} MB; verify "
              f"{rv - r['largest']:.0f} MB above the largest tensor", flush=True)
        print(f"    {r['verdict'][:200]}", flush=True)
        if r["ran"]:
            print(f"    {r['ran'][:200]}", flush=True)
    if len(results) > 1:
        lo, hi = results[0], results[-1]
        print(f"flatness: verify peak RSS {lo['verify'][1]:.0f} MB at {lo['gb']:.2f} GB -> {hi['verify'][1]:.0f} MB "
              f"at {hi['gb']:.2f} GB ({hi['verify'][1] / lo['verify'][1]:.2f}x for {hi['gb'] / lo['gb']:.1f}x the size)")
    # the time bar is for real sizes (8-16 GB): below, verify's fixed cost (imports, the first FFN on every
    # backend, ~7 s here) dominates a floor of a few seconds
    large = [r for r in results if r["gb"] >= TIME_BAR_GB]
    worst = max((r["verify"][0] / r["plain"][0] for r in large), default=None)
    above = max(r["verify"][1] - r["largest"] for r in results)
    time_line = (f"{'met' if worst <= 1.5 else 'NOT met'} (worst {worst:.2f}x at >= {TIME_BAR_GB:g} GB)" if worst
                 else f"not measured (no size >= {TIME_BAR_GB:g} GB)")
    flat = ""
    if len(results) > 1:  # flat: not the tensors read kept (a leak of each adds them all), only noise
        lo, hi = results[0], results[-1]
        grown, data = hi["verify"][1] - lo["verify"][1], 2 * (hi["gb"] - lo["gb"]) * 1000  # A and B, MB
        ok = hi["verify"][1] <= 1.3 * lo["verify"][1] and grown <= data / 2
        flat = f"; verify's peak RSS flat across sizes (<= 1.3x, < half the data added): {'met' if ok else 'NOT met'}"
    print(f"targets: verify <= 1.5x plain at 8-16 GB: {time_line}; "
          f"peak RSS <= 1024 MB above the largest tensor: {'met' if above <= 1024 else 'NOT met'} ({above:.0f} MB)"
          + flat)


if __name__ == "__main__":
    main()
