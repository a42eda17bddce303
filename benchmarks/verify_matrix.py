"""How much ``verify`` proves: planted defects it must fail (exit 1) and correct conversions it must pass.

Builds tiny real checkpoints (transformers' ``save_pretrained``, a real word-level tokenizer, MLX exports by
``ffn-tools convert``), plants each defect in a copy, and runs ``ffn-tools verify`` (reference backend) in
process. Prints one line per case and the two counts. The defects are the kinds a conversion gets wrong
that keep every weight loadable: config keys the forward reads, tied heads, tokenizer and generation files,
quantized content, weights.

    .venv/bin/python benchmarks/verify_matrix.py [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _config(path: Path, edit) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _json(path: Path, name: str, edit) -> Path:
    data = json.loads((path / name).read_text())
    edit(data)
    (path / name).write_text(json.dumps(data))
    return path


def _swap_tokens(tok: dict) -> None:
    vocab = tok["model"]["vocab"]
    vocab["w7"], vocab["w9"] = vocab["w9"], vocab["w7"]


def _mlx_tensors(path: Path, edit) -> Path:
    import mlx.core as mx

    f = path / "model.safetensors"
    w = dict(mx.load(str(f)))
    edit(w)
    mx.save_safetensors(str(f), w, metadata={"format": "mlx"})
    return path


def _shuffle_rows(w, prefix: str, n: int = 8) -> None:
    import mlx.core as mx

    order = mx.array(list(reversed(range(n))) + list(range(n, w[prefix + ".weight"].shape[0])))
    for part in ("weight", "scales", "biases"):
        w[f"{prefix}.{part}"] = w[f"{prefix}.{part}"][order]


def _swap_gate_up(w, layer: int = 0) -> None:
    p = f"model.layers.{layer}.mlp."
    for part in ("weight", "scales", "biases"):
        w[p + f"gate_proj.{part}"], w[p + f"up_proj.{part}"] = w[p + f"up_proj.{part}"], w[p + f"gate_proj.{part}"]


def build(base: Path) -> dict:
    """The sources: name -> path."""
    import torch
    import transformers
    from helpers import write_tokenizer

    import tiny_models

    out = {}
    for arch, extra in (("llama", {}), ("mistral", {"sliding_window": 8}), ("qwen3_moe", {}), ("phi3", {})):
        p = tiny_models.build(arch, base / arch)
        write_tokenizer(p)
        transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(p)
        if extra:
            _config(p, lambda c, e=extra: c.update(e))
        out[arch] = p
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    out["llama3"] = _config(_copy(out["llama"], base / "llama3"), lambda c: c.update(rope_parameters=rope))
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    out["yarn"] = _config(_copy(out["llama"], base / "yarn"), lambda c: c.update(rope_parameters=yarn))
    for cls, model, name, kw in (("Gemma2Config", "Gemma2ForCausalLM", "gemma2", {}),
                                 ("GemmaConfig", "GemmaForCausalLM", "gemma", {})):
        cfg = getattr(transformers, cls)(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, **kw)
        torch.manual_seed(0)
        getattr(transformers, model)(cfg).save_pretrained(base / name)
        out[name] = base / name
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def cases(src: dict, base: Path, run) -> tuple[list, list]:
    """(defects, correct conversions): each (name, A, make-B)."""
    from helpers import plant

    llama, mlx4, mlx2 = src["llama"], base / "mlx4", base / "mlx2"
    run("convert", llama, "--to", "mlx", "-o", mlx4, "-q")
    run("convert", llama, "--to", "mlx", "-o", mlx2, "-q", "--q-bits", "2")

    def cfg(a, key, value):
        return lambda d: plant(a, d, config=lambda c: _set(c, key, value))

    def mlx_cfg(key, value):
        return lambda d: _config(_copy(mlx4, d), lambda c: c.__setitem__(key, value))

    def gone(a, name):
        return lambda d: (_copy(a, d) / name).unlink() or d

    defects = [
        ("rope_theta x50", llama, cfg(llama, "rope_parameters.rope_theta", 500000.0)),
        ("llama3 rope_scaling dropped", src["llama3"], cfg(src["llama3"], "rope_parameters",
                                                              {"rope_type": "default", "rope_theta": 500000.0})),
        ("yarn rope_scaling dropped", src["yarn"], cfg(src["yarn"], "rope_parameters",
                                                          {"rope_type": "default", "rope_theta": 10000.0})),
        ("rms_norm_eps changed", llama, cfg(llama, "rms_norm_eps", 1e-5)),
        ("heads re-split, same shapes", llama, lambda d: plant(llama, d, config=lambda c: c.update(
            num_attention_heads=8, num_key_value_heads=4, head_dim=8))),
        ("sliding_window dropped", src["mistral"], cfg(src["mistral"], "sliding_window", None)),
        ("config dtype bf16 over fp32 weights", llama, cfg(llama, "dtype", "bfloat16")),
        ("final_logit_softcapping dropped", src["gemma2"], cfg(src["gemma2"], "final_logit_softcapping", None)),
        ("norm_topk_prob flipped", src["qwen3_moe"], cfg(src["qwen3_moe"], "norm_topk_prob", False)),
        ("MLX config rope_theta changed", llama, mlx_cfg("rope_theta", 500000.0)),
        ("tie flipped, lm_head present", llama, cfg(llama, "tie_word_embeddings", True)),
        ("MLX config tie flipped", llama, mlx_cfg("tie_word_embeddings", True)),
        ("tokenizer.json missing", llama, gone(llama, "tokenizer.json")),
        ("two token ids exchanged", llama, lambda d: _json(_copy(llama, d), "tokenizer.json", _swap_tokens)),
        ("chat_template changed", llama, lambda d: _json(_copy(llama, d), "tokenizer_config.json",
                                                          lambda t: t.__setitem__("chat_template", "{{ x }}"))),
        ("generation_config dropped", llama, gone(llama, "generation_config.json")),
        ("generation eos changed", llama, lambda d: _json(_copy(llama, d), "generation_config.json",
                                                           lambda g: g.__setitem__("eos_token_id", 3))),
        ("4-bit MLX: 8 embedding rows shuffled", llama, lambda d: _mlx_tensors(
            _copy(mlx4, d), lambda w: _shuffle_rows(w, "model.embed_tokens"))),
        ("2-bit MLX: gate/up swapped in a layer", llama, lambda d: _mlx_tensors(_copy(mlx2, d), _swap_gate_up)),
        ("config the client refuses (5 heads)", llama, cfg(llama, "num_attention_heads", 5)),
        ("gate/up swapped in a layer", llama, lambda d: plant(llama, d, edit=lambda sd: _swap(
            sd, "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"))),
    ]

    def conv(a, *args):
        return lambda d: run(*(x if x != "OUT" else d for x in args)) and d

    correct = [
        ("cast to bfloat16", llama, conv(llama, "convert", llama, "--to", "torch", "-o", "OUT", "--dtype", "bfloat16")),
        ("re-sharded", llama, conv(llama, "convert", llama, "--to", "torch", "-o", "OUT", "--max-shard-size", "100KB")),
        ("split then fuse (Phi-3)", src["phi3"], lambda d: run("split-gateup", src["phi3"], "-o", base / "phi3-split")
         and run("fuse-gateup", base / "phi3-split", "-o", d) and d),
        ("MLX plain", llama, conv(llama, "convert", llama, "--to", "mlx", "-o", "OUT")),
        ("MLX 8-bit", llama, conv(llama, "convert", llama, "--to", "mlx", "-o", "OUT", "-q", "--q-bits", "8")),
        ("MLX 4-bit", llama, lambda d: _copy(mlx4, d)),
        ("MLX -> torch", llama, lambda d: run("convert", llama, "--to", "mlx", "-o", base / "mlx-plain")
         and run("convert", base / "mlx-plain", "--to", "torch", "-o", d) and d),
        ("Flax", llama, conv(llama, "convert", llama, "--to", "flax", "-o", "OUT")),
        ("MoE MLX 4-bit", src["qwen3_moe"], conv(src["qwen3_moe"], "convert", src["qwen3_moe"], "--to", "mlx", "-o",
                                                 "OUT", "-q")),
        ("tied head saved twice", src["gemma"], lambda d: plant(src["gemma"], d, edit=lambda sd: sd.__setitem__(
            "lm_head.weight", sd["model.embed_tokens.weight"].clone()))),
    ]
    return defects, correct


def _set(cfg: dict, key: str, value) -> None:
    *head, last = key.split(".")
    for k in head:
        cfg = cfg.setdefault(k, {})
    cfg[last] = value


def _swap(sd, a, b) -> None:
    sd[a], sd[b] = sd[b], sd[a]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose name contains this")
    args = ap.parse_args()
    from click.testing import CliRunner

    from ffn_tools.cli import cli

    def run(*argv) -> bool:
        r = CliRunner().invoke(cli, [str(a) for a in argv])
        if r.exit_code != 0:
            raise SystemExit(f"setup failed: ffn-tools {' '.join(map(str, argv))}: {r.output}")
        return True

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        defects, correct = cases(build(base), base, run)
        caught = passed = 0
        for kind, group in (("defect", defects), ("correct", correct)):
            for k, (name, a, make) in enumerate(group):
                if args.only and args.only not in name:
                    continue
                b = make(base / f"{kind}-{k}")
                r = CliRunner().invoke(cli, ["verify", str(a), str(b), "--backend", "reference", "--tokens", "4"])
                verdict = (r.output.strip().splitlines() or ["?"])[-1]
                ok = r.exit_code == 1 if kind == "defect" else r.exit_code == 0
                caught += kind == "defect" and ok
                passed += kind == "correct" and ok
                print(f"{'ok  ' if ok else 'MISS'} {kind:<8} {name:<40} exit {r.exit_code}: {verdict[:150]}", flush=True)
        print(f"\ndefects failing with exit 1: {caught} of {len(defects)}; correct conversions passing: {passed} of "
              f"{len(correct)}")


if __name__ == "__main__":
    main()
