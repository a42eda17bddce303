"""Meta and Mistral native checkpoints, built here with torch alone from a transformers twin the way their
publishers lay them out (Meta: 2 model-parallel shards, q/k rows in Meta's rotary order; Mistral: one
consolidated.safetensors, MoE experts under feed_forward), read back with Hugging Face names by every command."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import assert_identical, run_cli, tensors
from safetensors.torch import save_file

import tiny_models

# Hugging Face name -> (native name, model-parallel split dim or None, rotary heads key or None). Written
# independently of converters/native/layout.py, from transformers' convert_llama_weights_to_hf.
_L = "model.layers.{L}"
NATIVE = {
    "model.embed_tokens.weight": ("tok_embeddings.weight", 1, None),
    "model.norm.weight": ("norm.weight", None, None),
    "lm_head.weight": ("output.weight", 0, None),
    f"{_L}.self_attn.q_proj.weight": ("layers.{L}.attention.wq.weight", 0, "n_heads"),
    f"{_L}.self_attn.k_proj.weight": ("layers.{L}.attention.wk.weight", 0, "n_kv_heads"),
    f"{_L}.self_attn.v_proj.weight": ("layers.{L}.attention.wv.weight", 0, None),
    f"{_L}.self_attn.o_proj.weight": ("layers.{L}.attention.wo.weight", 1, None),
    f"{_L}.input_layernorm.weight": ("layers.{L}.attention_norm.weight", None, None),
    f"{_L}.post_attention_layernorm.weight": ("layers.{L}.ffn_norm.weight", None, None),
    f"{_L}.mlp.gate_proj.weight": ("layers.{L}.feed_forward.w1.weight", 0, None),
    f"{_L}.mlp.up_proj.weight": ("layers.{L}.feed_forward.w3.weight", 0, None),
    f"{_L}.mlp.down_proj.weight": ("layers.{L}.feed_forward.w2.weight", 1, None),
    f"{_L}.block_sparse_moe.gate.weight": ("layers.{L}.feed_forward.gate.weight", None, None),
    **{f"{_L}.block_sparse_moe.experts.{{E}}.{w}.weight": (f"layers.{{L}}.feed_forward.experts.{{E}}.{w}.weight", d, None)
       for w, d in (("w1", 0), ("w3", 0), ("w2", 1))},
}


def _native_name(hf: str):
    import re

    for pattern, (native, dim, heads) in NATIVE.items():
        rx = re.escape(pattern).replace(re.escape("{L}"), r"(?P<L>\d+)").replace(re.escape("{E}"), r"(?P<E>\d+)")
        if m := re.fullmatch(rx, hf):
            return native.format(**m.groupdict()), dim, heads
    raise KeyError(hf)


def _meta_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face q/k rows (rotary on halves of each head) in Meta's order (rotary on interleaved pairs)."""
    out = torch.empty_like(w)
    per = w.shape[0] // heads
    for h in range(heads):
        block = w[h * per:(h + 1) * per]
        out[h * per:(h + 1) * per][0::2] = block[: per // 2]
        out[h * per:(h + 1) * per][1::2] = block[per // 2:]
    return out


def params_of(hf_dir) -> dict:
    c = json.loads((hf_dir / "config.json").read_text())
    params = {"dim": c["hidden_size"], "n_layers": c["num_hidden_layers"], "n_heads": c["num_attention_heads"],
              "n_kv_heads": c["num_key_value_heads"], "vocab_size": c["vocab_size"], "norm_eps": c["rms_norm_eps"],
              "rope_theta": (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0)),
              "max_seq_len": c["max_position_embeddings"]}
    if c.get("sliding_window"):  # Mistral 7B v0.1's params.json has it
        params["sliding_window"] = c["sliding_window"]
    if "num_local_experts" in c:
        params["moe"] = {"num_experts": c["num_local_experts"], "num_experts_per_tok": c["num_experts_per_tok"]}
    return params


def to_native(hf_dir, out, ranks: int = 1, fmt: str = "pth", embed_dim: int = 1):
    """``hf_dir`` laid out natively in ``out``: ``ranks`` model-parallel shards (pth) or one safetensors file;
    the embedding split along ``embed_dim`` (Llama 2: its width, 1; Llama 3: the vocabulary, 0)."""
    params = params_of(hf_dir)
    shards = [{} for _ in range(ranks)]
    for name, t in tensors(hf_dir).items():
        native, dim, heads = _native_name(name)
        dim = embed_dim if native == "tok_embeddings.weight" else dim
        if heads:
            t = _meta_rows(t, params[heads])
        pieces = list(torch.chunk(t, ranks, dim=dim)) if dim is not None else [t] * ranks
        for shard, p in zip(shards, pieces):
            shard[native] = p.clone()
    out.mkdir(parents=True)
    (out / "params.json").write_text(json.dumps(params))
    if fmt == "pth":
        for r, shard in enumerate(shards):
            shard["rope.freqs"] = torch.ones(4)  # Llama 2's consolidated shards carry it
            torch.save(shard, out / f"consolidated.{r:02d}.pth")
    else:
        save_file(shards[0], out / "consolidated.safetensors")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (hf_dir / f).is_file():
            shutil.copy(hf_dir / f, out / f)
    return out


@pytest.fixture(scope="module")
def twins(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    return {
        "meta": (model_dir("llama"), to_native(model_dir("llama"), root / "meta", ranks=2)),
        "meta-llama3": (model_dir("llama"), to_native(model_dir("llama"), root / "meta3", ranks=2, embed_dim=0)),
        "mistral": (model_dir("mistral"), to_native(model_dir("mistral"), root / "mistral", fmt="safetensors")),
        "mistral-moe": (model_dir("mixtral"), to_native(model_dir("mixtral"), root / "mixtral", fmt="safetensors")),
    }


@pytest.mark.parametrize("kind", ["meta", "meta-llama3", "mistral", "mistral-moe"])
def test_native_reads_as_its_twin(kind, twins, tmp_path):
    hf, native = twins[kind]
    mine, theirs = (json.loads(run_cli("inspect", p, "--json").stdout) for p in (native, hf))
    assert mine["ffn"] == theirs["ffn"] and mine["format"] == "native"
    run_cli("convert", native, "--to", "torch", "-o", tmp_path / "hf")
    assert_identical(tensors(tmp_path / "hf"), tensors(hf))  # every tensor bit for bit, q/k permuted back
    arch = {"meta": "llama", "meta-llama3": "llama", "mistral": "mistral", "mistral-moe": "mixtral"}[kind]
    assert torch.equal(tiny_models.logits(tmp_path / "hf", arch), tiny_models.logits(hf, arch))
    # Native layouts ship no generation_config.json, which the twin has (save_pretrained derives it from its config):
    # the conversion writes the one transformers' conversion scripts write, and where a side has none verify
    # compares the settings transformers derives (issue 37 item 9)
    # (the tiny twin's config says pad_token_id 0, which no native layout stores: that is what differs)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["_from_model_config"] is True
    pad = "generation_config.json: pad_token_id is 0 in A and missing in B"
    r = run_cli("verify", hf, tmp_path / "hf", "--backend", "reference", "--logits", "--json", ok=None)
    data = json.loads(r.stdout)
    assert data["failures"] == [f"side files: {pad}"] and data["logits"]["passed"], data["failures"]
    r = run_cli("verify", hf, native, "--backend", "reference", "--json", ok=None)
    assert json.loads(r.stdout)["failures"] == ["side files: generation_config.json is in A and missing in B, and what "
                                                "transformers derives from B's config.json differs: pad_token_id 0 in "
                                                "A, None in B"]
    no_pad = tmp_path / "no-pad"  # a twin that says no pad id, as Meta's own conversions do: no difference
    shutil.copytree(hf, no_pad)
    for f in ("config.json", "generation_config.json"):
        cfg = json.loads((no_pad / f).read_text())
        cfg.pop("pad_token_id", None)
        (no_pad / f).write_text(json.dumps(cfg))
    r = run_cli("verify", no_pad, native, "--backend", "reference", "--json", ok=None)
    data = json.loads(r.stdout)
    assert r.exit_code == 0 and "load check not run (Meta's and Mistral's" in data["verdict"], data["failures"]
    assert any("transformers derives the same generation settings from B's config.json" in n
               for n in data["side_files"]["notes"]), data["side_files"]
    assert "PASS" in run_cli("verify", no_pad, tmp_path / "hf", "--backend", "reference").output
    r = run_cli("verify", native, tmp_path / "hf", "--backend", "reference", ok=None)  # the conversion, strictly
    assert r.exit_code == 0 and "PASS" in r.output, r.output


def test_verify_catches_a_gate_up_swap_in_a_native_shard(twins, tmp_path):
    hf, native = twins["meta"]
    bad = tmp_path / "bad"
    shutil.copytree(native, bad)
    shard = torch.load(bad / "consolidated.01.pth", weights_only=True)
    w1, w3 = "layers.1.feed_forward.w1.weight", "layers.1.feed_forward.w3.weight"
    shard[w1], shard[w3] = shard[w3], shard[w1]
    torch.save(shard, bad / "consolidated.01.pth")
    r = run_cli("verify", hf, bad, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1 and "layer 1" in r.output and "FAIL" in r.output, r.output


def test_extract_and_mlx_export_take_a_native_checkpoint(twins, tmp_path):
    hf, native = twins["meta"]
    run_cli("extract", native, "-o", tmp_path / "a")
    run_cli("extract", hf, "-o", tmp_path / "b")
    assert_identical(tensors(tmp_path / "a"), tensors(tmp_path / "b"))
    pytest.importorskip("mlx_lm")
    run_cli("convert", native, "--to", "mlx", "-o", tmp_path / "c")
    run_cli("convert", hf, "--to", "mlx", "-o", tmp_path / "d")
    assert_identical(tensors(tmp_path / "c"), tensors(tmp_path / "d"))


def test_bad_native_checkpoints_are_refused_in_one_line(twins, tmp_path):
    _, native = twins["meta"]
    odd = tmp_path / "odd"
    shutil.copytree(native, odd)
    shard = torch.load(odd / "consolidated.00.pth", weights_only=True)
    shard["layers.0.attention.wz.weight"] = torch.zeros(2, 2)
    torch.save(shard, odd / "consolidated.00.pth")
    r = run_cli("inspect", odd, ok=False)
    assert "no known native name: layers.0.attention.wz.weight" in r.output
    (odd / "params.json").write_text("{not json")
    r = run_cli("inspect", odd, ok=False)
    assert "params.json" in r.output
