"""ffn-tools `convert --to mlx` against `mlx_lm.convert` on the same bf16 Llama-shaped checkpoint.

Builds the checkpoint once under bench-data/ (``--size 1g``: d_model 2048, d_ffn 5632, 12 layers, 1.1 GB;
``--size 8b``: Llama-3-8B's shape, 16 GB in 4 shards; written with safetensors directly plus a LlamaConfig
config.json and a tiny word-level tokenizer, which mlx_lm.convert needs), then
runs each tool in its own subprocess, plain and with 4-bit quantization, and prints wall time and peak RSS
(the child's ru_maxrss: the largest process of its tree, so with ffn-tools' quantize workers, on an idle
multi-core machine, each worker is at most that size) of each, and ffn-tools / mlx_lm as ratios against the
targets. CPU time (user + sys) is printed too: on a busy machine it is the steadier comparison.

    .venv/bin/python benchmarks/bench_mlx.py [--repeat N] [--size 1g|8b] [--kinds plain q4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench-data"
SIZES = {"1g": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=32,
                    num_key_value_heads=4, vocab_size=8192),
         "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256)}
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size
SRC = DATA / "llama-1g-bf16"
SHAPE = SIZES["1g"]
# (time ratio, RSS ratio) targets: ffn-tools / mlx_lm.convert.
TARGETS = {"plain": (0.25, 0.20), "q4": (0.60, 0.30)}
CPU_TARGET = {"q4": 1.0}  # CPU-seconds ratio (issue 34: workers write their bytes into the output themselves)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer (mlx_lm.convert loads and saves one; there is no hub to fetch one from)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)


def build(path: Path, shape: dict | None = None, tokenizer=None) -> None:
    """Write the checkpoint of ``shape`` (default ``SHAPE``) shard by shard (at most ``SHARD_BYTES`` each, with an
    index when more than one), with safetensors, as transformers' save_pretrained lays it out, a random tensor at
    a time (never the model in memory); ``tokenizer(dir)`` writes its tokenizer (default: a word-level one of
    ``vocab_size`` words)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    shape = shape or SHAPE
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def layer(n):
        p = f"model.layers.{n}"
        return {f"{p}.input_layernorm.weight": 1 + w(h), f"{p}.post_attention_layernorm.weight": 1 + w(h),
                f"{p}.self_attn.q_proj.weight": w(h, h), f"{p}.self_attn.k_proj.weight": w(kv, h),
                f"{p}.self_attn.v_proj.weight": w(kv, h), f"{p}.self_attn.o_proj.weight": w(h, h),
                f"{p}.mlp.gate_proj.weight": w(i, h), f"{p}.mlp.up_proj.weight": w(i, h),
                f"{p}.mlp.down_proj.weight": w(h, i)}

    parts = [lambda: {"model.embed_tokens.weight": w(v, h)}, *(lambda n=n: layer(n) for n in
                                                             range(shape["num_hidden_layers"])),
             lambda: {"model.norm.weight": 1 + w(h), "lm_head.weight": w(v, h)}]
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict] = [{}]
    for part in parts:  # a shard is written once the next part would overflow it
        tensors = part()
        size = sum(t.numel() * 2 for t in tensors.values())
        if shards[-1] and sum(t.numel() * 2 for t in shards[-1].values()) + size > SHARD_BYTES:
            save_file(shards[-1], str(tmp / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
            shards[-1] = {k: None for k in shards[-1]}
            shards.append({})
        shards[-1].update(tensors)
    save_file(shards[-1], str(tmp / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
    shards[-1] = {k: None for k in shards[-1]}
    if len(shards) == 1:
        (tmp / "shard-1.tmp").rename(tmp / "model.safetensors")
    else:
        names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
        for k, name in enumerate(names):
            (tmp / f"shard-{k + 1}.tmp").rename(tmp / name)
        weight_map = {t: names[k] for k, shard in enumerate(shards) for t in shard}
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    LlamaConfig(**shape, tie_word_embeddings=False, dtype="bfloat16", bos_token_id=1, eos_token_id=2,
                architectures=["LlamaForCausalLM"],  # convert_hf_to_gguf.py picks its model class by it
                pad_token_id=0).save_pretrained(tmp)
    (tokenizer or (lambda d: write_tokenizer(d, v)))(tmp)
    tmp.rename(path)


def same_tensors(a: Path, b: Path) -> str | None:
    """None when the two MLX outputs hold the same tensors, byte for byte (read from their safetensors
    headers with pread, a tensor at a time; shard names and order may differ), else the first difference."""
    from ffn_tools.io.safetensors_format import read_header
    from ffn_tools.io.store import read_bytes

    def entries(d: Path) -> dict:
        return {n: (f, e) for f in sorted(d.glob("*.safetensors")) for n, e in read_header(f)[0].items()}

    ea, eb = entries(a), entries(b)
    if set(ea) != set(eb):
        return f"tensor names differ: {sorted(set(ea) ^ set(eb))[:5]}"
    for name, (fa, x) in ea.items():
        fb, y = eb[name]
        if (x.dtype, tuple(x.shape)) != (y.dtype, tuple(y.shape)):
            return f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        n = x.end - x.start
        if read_bytes(fa, x.start, n) != read_bytes(fb, y.start, n):
            return f"{name}: bytes differ"
    return None


def measure(cmd: list[str], out: Path) -> tuple[float, int, float]:
    """Wall seconds, peak RSS (bytes) and CPU seconds of ``cmd`` run in a child process; ``out`` is removed first."""
    shutil.rmtree(out, ignore_errors=True)
    pid_start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child: exec the command with its output silenced
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.execv(cmd[0], cmd)
    _, status, usage = os.wait4(pid, 0)
    seconds = time.perf_counter() - pid_start
    if os.waitstatus_to_exitcode(status) != 0:
        subprocess.run(cmd, check=True)  # rerun visibly to show the error
    return seconds, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def commands(kind: str, out: Path) -> dict[str, list[str]]:
    py = sys.executable
    ffn = [str(Path(py).parent / "ffn-tools"), "-q", "convert", str(SRC), "--to", "mlx", "-o", str(out / "ffn"),
           *(["--quantize", "4", "--group-size", "64"] if kind == "q4" else [])]
    q = "quantize=True, q_bits=4, q_group_size=64" if kind == "q4" else "quantize=False"
    # -P: the repository's own kernels/ must not shadow the kernels package transformers imports
    mlx = [py, "-P", "-c",
           f"from mlx_lm import convert; convert(hf_path={str(SRC)!r}, mlx_path={str(out / 'mlx')!r}, {q})"]
    return {"ffn": ffn, "mlx": mlx}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3,
                    help="Runs per tool and setting, alternating tools; the best time and the largest RSS are kept.")
    ap.add_argument("--size", choices=tuple(SIZES), default="1g")
    ap.add_argument("--kinds", nargs="+", choices=tuple(TARGETS), default=list(TARGETS))
    args = ap.parse_args()
    global SRC, SHAPE
    SHAPE = SIZES[args.size]
    SRC = DATA / f"llama-{args.size}-bf16"
    if not SRC.exists():
        print(f"building {SRC} ...", flush=True)
        build(SRC)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    size = 0
    for p in SRC.glob("*.safetensors"):  # read once so that neither tool pays for a cold page cache
        with p.open("rb") as f:
            while chunk := f.read(64 << 20):
                size += len(chunk)
    print(f"input: {SRC} ({size / 1e9:.2f} GB bf16, d_model {SHAPE['hidden_size']}, d_ffn "
          f"{SHAPE['intermediate_size']}, {SHAPE['num_hidden_layers']} layers)")
    out = DATA / "mlx-out"
    ok = True
    results = {}
    for kind in args.kinds:
        cmds = commands(kind, out)
        runs: dict[str, list] = {tool: [] for tool in cmds}
        for _ in range(args.repeat):  # alternate, so that both see the same machine load
            for tool, cmd in cmds.items():
                runs[tool].append(measure(cmd, out / tool))
        best = {tool: (min(t for t, _, _ in r), max(m for _, m, _ in r), min(c for _, _, c in r))
                for tool, r in runs.items()}
        diff = same_tensors(out / "ffn", out / "mlx")
        ok &= diff is None
        print(f"{kind:>5}: same tensors as mlx_lm.convert: {'yes' if diff is None else 'NO: ' + diff}")
        (ft, fr, fc), (mt, mr, mc) = best["ffn"], best["mlx"]
        tt, tr = TARGETS[kind]
        t_ratio, r_ratio = ft / mt, fr / mr
        ct = CPU_TARGET.get(kind)
        ok &= t_ratio <= tt and r_ratio <= tr and (ct is None or fc / mc <= ct)
        results[kind] = {"ffn_tools": {"seconds": ft, "peak_rss": fr, "cpu_seconds": fc},
                         "mlx_lm": {"seconds": mt, "peak_rss": mr, "cpu_seconds": mc},
                         "time_ratio": t_ratio, "rss_ratio": r_ratio, "cpu_ratio": fc / mc}
        print(f"{kind:>5}: ffn-tools {ft:6.2f} s {fr / 2**20:6.0f} MiB (cpu {fc:5.2f} s) | mlx_lm.convert {mt:6.2f} s "
              f"{mr / 2**20:6.0f} MiB (cpu {mc:5.2f} s) | time {t_ratio:.2f}x (target <= {tt}) "
              f"RSS {r_ratio:.2f}x (target <= {tr}) cpu {fc / mc:.2f}x{f' (target <= {ct})' if ct else ''}")
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(results))
    print("all targets met" if ok else "TARGET MISSED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
