"""Reading a Meta native checkpoint (2 model-parallel consolidated.NN.pth shards) into Hugging Face safetensors:
ffn-tools `convert --to torch` against what transformers' convert_llama_weights_to_hf does (every shard loaded
whole, concatenated, q/k permuted, saved), on the same ~750 MB bf16 Llama-shaped checkpoint.

Builds it once under bench-data/, runs each in its own process, and prints wall time and peak RSS, the
ratios ffn-tools / baseline, and ffn-tools' RSS above a process that only imports torch next to the
largest tensor: merging one tensor at a time keeps memory near that, not near the checkpoint.

    .venv/bin/python benchmarks/bench_native.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mlx import DATA, measure  # noqa: E402

SRC = DATA / "meta-750m-2mp"
D, I, L, V, HEADS = 2048, 5632, 8, 8192, 32
TARGETS = {"time": 1.0, "rss": 0.5}  # ffn-tools / baseline


def build(out: Path) -> None:
    import torch

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    shards: list[dict] = [{}, {}]

    def put(name, shape, dim):
        t = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
        for s, part in zip(shards, torch.chunk(t, 2, dim=dim) if dim is not None else (t, t)):
            s[name] = part.clone()

    put("tok_embeddings.weight", (V, D), 1)
    put("norm.weight", (D,), None)
    put("output.weight", (V, D), 0)
    for layer in range(L):
        p = f"layers.{layer}."
        for n, shape, dim in (("attention.wq", (D, D), 0), ("attention.wk", (D // 4, D), 0),
                              ("attention.wv", (D // 4, D), 0), ("attention.wo", (D, D), 1),
                              ("feed_forward.w1", (I, D), 0), ("feed_forward.w3", (I, D), 0),
                              ("feed_forward.w2", (D, I), 1)):
            put(f"{p}{n}.weight", shape, dim)
        put(p + "attention_norm.weight", (D,), None)
        put(p + "ffn_norm.weight", (D,), None)
    for r, s in enumerate(shards):
        torch.save(s, tmp / f"consolidated.{r:02d}.pth")
    (tmp / "params.json").write_text(json.dumps({"dim": D, "n_layers": L, "n_heads": HEADS, "n_kv_heads": HEADS // 4,
                                                 "vocab_size": V, "norm_eps": 1e-5, "rope_theta": 500000.0}))
    tmp.rename(out)


BASELINE = """
import sys, torch
from pathlib import Path
from safetensors.torch import save_file
src, out = Path(sys.argv[1]), Path(sys.argv[2])
shards = [torch.load(src / f"consolidated.{r:02d}.pth", map_location="cpu", weights_only=True) for r in range(2)]
D, H, KV = 2048, 32, 8
def permute(w, heads):
    return w.view(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
sd = {"model.embed_tokens.weight": torch.cat([s["tok_embeddings.weight"] for s in shards], 1),
      "model.norm.weight": shards[0]["norm.weight"], "lm_head.weight": torch.cat([s["output.weight"] for s in shards], 0)}
for l in range(8):
    g = lambda n, d: torch.cat([s[f"layers.{l}.{n}.weight"] for s in shards], d)
    p = f"model.layers.{l}."
    sd.update({p + "self_attn.q_proj.weight": permute(g("attention.wq", 0), H),
               p + "self_attn.k_proj.weight": permute(g("attention.wk", 0), KV),
               p + "self_attn.v_proj.weight": g("attention.wv", 0), p + "self_attn.o_proj.weight": g("attention.wo", 1),
               p + "mlp.gate_proj.weight": g("feed_forward.w1", 0), p + "mlp.up_proj.weight": g("feed_forward.w3", 0),
               p + "mlp.down_proj.weight": g("feed_forward.w2", 1),
               p + "input_layernorm.weight": shards[0][f"layers.{l}.attention_norm.weight"],
               p + "post_attention_layernorm.weight": shards[0][f"layers.{l}.ffn_norm.weight"]})
out.mkdir(parents=True, exist_ok=True)
save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
"""


def main() -> None:
    if not SRC.exists():
        print(f"building {SRC} ...", flush=True)
        build(SRC)
    size = sum(p.stat().st_size for p in SRC.glob("*.pth"))
    out = DATA / "bench-native-out"
    py = sys.executable
    ffn = [str(Path(py).parent / "ffn-tools"), "-q", "convert", str(SRC), "--to", "torch", "-o", str(out / "ffn")]
    base = [py, "-c", BASELINE, str(SRC), str(out / "base")]
    floor = [py, "-c", "import torch"]
    runs = {k: min((measure(c, out / k) for _ in range(2)), key=lambda r: r[0]) for k, c in
            (("ffn", ffn), ("base", base), ("floor", floor))}
    shutil.rmtree(out, ignore_errors=True)
    (ft, fr, _), (bt, br, _), (_, floor_rss, _) = runs["ffn"], runs["base"], runs["floor"]
    largest = V * D * 2
    print(f"input: {SRC} ({size / 1e6:.0f} MB, 2 shards, largest merged tensor {largest / 2**20:.0f} MiB)")
    print(f"ffn-tools {ft:5.2f} s {fr / 2**20:6.0f} MiB | baseline {bt:5.2f} s {br / 2**20:6.0f} MiB | "
          f"time {ft / bt:.2f}x (target <= {TARGETS['time']}) RSS {fr / br:.2f}x (target <= {TARGETS['rss']}) | "
          f"ffn-tools above `import torch`: {(fr - floor_rss) / 2**20:.0f} MiB")
    ok = ft / bt <= TARGETS["time"] and fr / br <= TARGETS["rss"]
    print("all targets met" if ok else "TARGET MISSED")


if __name__ == "__main__":
    main()
