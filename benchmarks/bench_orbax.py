"""Hugging Face -> Orbax on the 1.1 GB bf16 Llama-shaped checkpoint of bench_mlx.py, in the Hugging Face Flax tree and
in MaxText's scanned layout: ffn-tools `convert --to orbax [--orbax-layout maxtext]` against `cp -r` of the input and
against the libraries' own restore-then-save path (every tensor loaded with safetensors, turned into the tree as
MaxText's converters turn it (kernels W.T, layers stacked on axis 1, the query scaled), then
`orbax.checkpoint.StandardCheckpointer().save`); and back to safetensors against `PyTreeCheckpointer().restore` of the
whole tree then `save_file`.

Each runs in its own process; the best wall time of ``--repeat`` runs and the largest peak RSS are kept; the input
is read once first. The round trips are checked bit for bit. At 1 GB the process start (Python, torch, jax and
tensorstore imported: about two seconds here) is most of ffn-tools' time, so the ratio to cp is printed as measured.

    .venv/bin/python benchmarks/bench_orbax.py [--repeat N]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mlx  # noqa: E402
from bench_dcp import best, run_dir  # noqa: E402
from bench_mlx import DATA  # noqa: E402

SRC = DATA / "llama-1g-bf16"
TARGETS = {"cp": 1.5, "time": 0.5, "rss": 0.2}

LIBRARY_TO = """
import sys, json, numpy as np, ml_dtypes, orbax.checkpoint as ocp, torch
from pathlib import Path
from safetensors.torch import load_file
src, out, layout = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
cfg = json.loads((src / "config.json").read_text())
hf = {}
for f in sorted(src.glob("*.safetensors")):
    hf.update(load_file(f))
def np_(t):
    return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
if layout == "hf":
    tree = {}
    for k, v in hf.items():
        parts = k.split(".")
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        if v.ndim == 2 and parts[-2] != "embed_tokens":
            node["kernel"] = np_(v.T.contiguous())
        else:
            node["embedding" if v.ndim == 2 else parts[-1]] = np_(v)
else:  # MaxText's converter: per-layer tensors stacked on axis 1, kernels (in, out), query scaled
    L, H, hd = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"]
    def stack(name, f):
        return np.stack([f(hf[f"model.layers.{l}.{name}"]) for l in range(L)], axis=1)
    T = lambda w: np_(w.T.contiguous())
    q = lambda w: np_((w.to(torch.float32) * np.float32(hd ** -0.5)).to(torch.bfloat16).T.contiguous().reshape(-1, H, hd))
    heads = lambda n: (lambda w: np_(w.T.contiguous().reshape(-1, n, hd)))
    layers = {"mlp": {"wi_0": {"kernel": stack("mlp.gate_proj.weight", T)}, "wi_1": {"kernel": stack("mlp.up_proj.weight", T)},
                      "wo": {"kernel": stack("mlp.down_proj.weight", T)}},
              "self_attention": {"query": {"kernel": stack("self_attn.q_proj.weight", q)},
                                 "key": {"kernel": stack("self_attn.k_proj.weight", heads(kv))},
                                 "value": {"kernel": stack("self_attn.v_proj.weight", heads(kv))},
                                 "out": {"kernel": np.stack([np_(hf[f"model.layers.{l}.self_attn.o_proj.weight"].T.contiguous().reshape(H, hd, -1)) for l in range(L)], axis=1)}},
              "pre_self_attention_layer_norm": {"scale": stack("input_layernorm.weight", np_)},
              "post_self_attention_layer_norm": {"scale": stack("post_attention_layernorm.weight", np_)}}
    tree = {"params": {"params": {"token_embedder": {"embedding": np_(hf["model.embed_tokens.weight"])},
                                  "decoder": {"layers": layers, "decoder_norm": {"scale": np_(hf["model.norm.weight"])},
                                              "logits_dense": {"kernel": T(hf["lm_head.weight"])}}}}}
del hf
with ocp.StandardCheckpointer() as c:
    c.save(str(out.resolve()), tree)
"""

LIBRARY_BACK = """
import sys, numpy as np, orbax.checkpoint as ocp, torch
from pathlib import Path
from safetensors.torch import save_file
src, out = Path(sys.argv[1]), Path(sys.argv[2])
tree = ocp.PyTreeCheckpointer().restore(str(src.resolve()))
flat = {}
def walk(node, path):
    for k, v in node.items():
        if isinstance(v, dict):
            walk(v, path + [k])
        else:
            a = np.asarray(v)
            t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype.name == "bfloat16" else torch.from_numpy(a)
            flat[".".join(path + [k])] = t.T.contiguous() if k == "kernel" else t
walk(tree, [])
out.mkdir(parents=True, exist_ok=True)
save_file(flat, str(out / "model.safetensors"))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    py, tool = sys.executable, str(Path(sys.executable).parent / "ffn-tools")
    out, cp = run_dir("bench-orbax-out", args.repeat)
    print(f"cp -r                     {cp[0]:6.2f} s {cp[1] / 2**20:6.0f} MiB")
    ok = True
    for layout in ("hf", "maxtext"):
        ffn = best([tool, "-q", "convert", str(SRC), "--to", "orbax", "--orbax-layout", layout, "-o",
                    str(out / f"ffn-{layout}")], out / f"ffn-{layout}", args.repeat)
        lib = best([py, "-c", LIBRARY_TO, str(SRC), str(out / f"lib-{layout}"), layout], out / f"lib-{layout}",
                   args.repeat)
        back = best([tool, "-q", "convert", str(out / f"ffn-{layout}"), "--to", "torch", "-o", str(out / "back")],
                    out / "back", args.repeat)
        same = bench_mlx.same_tensors(SRC, out / "back")
        rc, rt, rr = ffn[0] / cp[0], ffn[0] / lib[0], ffn[1] / lib[1]
        print(f"HF -> Orbax ({layout:7}): ffn-tools {ffn[0]:6.2f} s {ffn[1] / 2**20:6.0f} MiB | library {lib[0]:6.2f} s "
              f"{lib[1] / 2**20:6.0f} MiB | vs cp {rc:.2f}x (<= {TARGETS['cp']}) | vs library time {rt:.2f}x "
              f"(<= {TARGETS['time']}) RSS {rr:.2f}x (<= {TARGETS['rss']})")
        if layout == "hf":
            lib_back = best([py, "-c", LIBRARY_BACK, str(out / "lib-hf"), str(out / "lib-back")], out / "lib-back",
                            args.repeat)
            print(f"Orbax (hf) -> HF      : ffn-tools {back[0]:6.2f} s {back[1] / 2**20:6.0f} MiB | library "
                  f"{lib_back[0]:6.2f} s {lib_back[1] / 2**20:6.0f} MiB | time {back[0] / lib_back[0]:.2f}x RSS "
                  f"{back[1] / lib_back[1]:.2f}x")
        else:
            print(f"Orbax (maxtext) -> HF : ffn-tools {back[0]:6.2f} s {back[1] / 2**20:6.0f} MiB")
        print(f"  round trip {layout}: " + ("bit-exact" if same is None else f"DIFFERS: {same}"))
        ok = ok and same is None and rc <= TARGETS["cp"] and rt <= TARGETS["time"] and rr <= TARGETS["rss"]
    shutil.rmtree(out, ignore_errors=True)
    print("all targets met" if ok else "TARGET MISSED")


if __name__ == "__main__":
    main()
