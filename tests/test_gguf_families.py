"""Phi-3, Qwen2, Gemma 2 and Gemma 3 (text) through GGUF: ``convert --to gguf`` against llama.cpp's own
convert_hf_to_gguf.py, the reader, ``verify`` and llama.cpp's logits.

The tiny models have real tokenizers the converter accepts: Qwen2 llama.cpp's own vocabulary, Phi-3 and Gemma a
sentencepiece model trained at test time (``gguf_models.sentencepiece_tokenizer``). Gemma's converter stores
every ``*norm.weight`` plus one (Gemma's RMSNorm scales by ``1 + weight``): the reader takes it off again
(rounding: ``fl(fl(w + 1) - 1)``), verify compares A's weight plus one, as the converter computes it, with the
stored bits.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ffn_tools.converters import open_any
from ffn_tools.checks.rounded import plus as as_converted
from ffn_tools.api import verify
from gguf_models import convert_reference
from helpers import run_cli
from test_gguf import _edit

FAMILIES = ["phi3", "qwen2", "gemma2", "gemma3"]
GEMMA = ["gemma2", "gemma3"]
ARCH = {"phi3": "phi3", "qwen2": "qwen2", "gemma2": "gemma2", "gemma3": "gemma3"}  # general.architecture


# q8_0 for two families only: the suite's time (each Qwen2 conversion runs its 151,936-token vocabulary)
@pytest.mark.parametrize("arch,outtype", [*((a, "bf16") for a in FAMILIES), ("phi3", "q8_0"), ("gemma2", "q8_0")])
def test_same_file_as_convert_hf_to_gguf(gguf_model, gguf_ref, tmp_path, arch, outtype):
    out = tmp_path / "ours.gguf"
    r = json.loads(run_cli("-q", "convert", gguf_model(arch), "--to", "gguf", "-o", out, "--outtype", outtype,
                           "--json").stdout)
    assert out.read_bytes() == gguf_ref(arch, outtype).read_bytes()
    assert r["architecture"] == {"gemma3": "Gemma3ForCausalLM"}.get(arch, r["architecture"])


@pytest.mark.parametrize("arch", FAMILIES)
def test_f32_reads_back_with_hf_names(gguf_model, gguf_ref, arch):
    """Every tensor of the converter's f32 file reads back under its Hugging Face name, bit for bit; Gemma's
    norms within the rounding of ``w + 1`` of A's (half a float32 ulp of ``w + 1``), their stored bits A's
    plus one exactly as the converter computes it."""
    src = load_file(str(gguf_model(arch) / "model.safetensors"))
    with open_any(gguf_ref(arch, "f32")) as g:
        assert set(g) == set(src)
        norms = {n for n in src if n.endswith("norm.weight")}
        assert set(g.shifts) == (norms if arch in GEMMA else set())
        assert [n for n in src if n not in g.shifts and not torch.equal(g[n], src[n])] == []
        for n in g.shifts:
            assert torch.equal(g.read_stored(n), as_converted(src[n], 1.0)), n
            err = (g[n] - src[n]).abs()
            assert g[n].dtype == torch.float32 and float(err.max()) <= 2 ** -24 * float((src[n] + 1).abs().max()), n
        rounded = sum(not torch.equal(g[n], src[n]) for n in g.shifts)
        assert rounded == (len(norms) if arch in GEMMA else 0)  # w + 1 - 1 rounds: not A's bits
        assert g.config["model_type"] == {"gemma3": "gemma3_text"}.get(arch, arch)
        act = "hidden_activation" if arch in GEMMA else "hidden_act"  # the key the family's config class reads
        assert g.config[act] == ("gelu_pytorch_tanh" if arch in GEMMA else "silu") and act in json.loads(
            (gguf_model(arch) / "config.json").read_text())


@pytest.mark.parametrize("arch,outtype", [*((a, "f32") for a in FAMILIES), ("phi3", "q8_0"), ("gemma3", "q8_0")])
def test_verify_and_logits_through_llama_cpp(gguf_model, gguf_ref, arch, outtype):
    """verify passes the converter's file: llama.cpp builds it, every tensor and metadata key agrees (Gemma's
    norms bit for bit against A's plus one), and llama.cpp's logits agree with transformers'."""
    r = verify(gguf_model(arch), gguf_ref(arch, outtype), backends=["reference"], logits=True)
    assert r.passed, r.failures()
    assert r.load.ok and r.load.architecture == ARCH[arch]
    assert r.logits["client_b"] == "llama.cpp" and r.logits["passed"]
    assert not r.config.problems and r.side_files.identical
    o = r.outside
    assert o.passed and not o.only_a and not o.only_b
    if arch in GEMMA:  # the norms the converter stored plus one, compared so, bit for bit
        assert any("stored plus one" in n for n in r.notes), r.notes
    if arch in GEMMA and outtype == "f32":  # q8_0's row is coarser than float16's already
        assert any("logits: llama.cpp computes the FFN's gelu_tanh in float16" in n for n in r.notes), r.notes
        assert r.logits["tolerance"]["row"].endswith("llama.cpp's gelu_tanh in float16 (logits)")
    if outtype == "f32":
        assert o.within == 0 and all(x.exact == "identical" for x in r.results)
        assert r.logits["top1_agreement"] == 1.0
        # llama.cpp's float16 GELU table: ~3e-4 on these logits; SwiGLU models agree to float32 rounding
        assert r.logits["max_abs"] < (1e-3 if arch in GEMMA else 5e-5), r.logits


def test_gemma_metadata_checks_compare_softcapping_and_window(gguf_model, gguf_ref):
    """The keys llama.cpp reads Gemma's softcapping and sliding window from are compared, and for Gemma 3
    the sliding layers' own rope base."""
    r = verify(gguf_model("gemma2"), gguf_ref("gemma2", "f32"), backends=["reference"], load_check=False)
    assert r.passed and r.config.compared >= 13
    r3 = verify(gguf_model("gemma3"), gguf_ref("gemma3", "f32"), backends=["reference"], load_check=False)
    assert r3.passed and r3.config.compared >= 13


@pytest.mark.parametrize("arch,defect,expect", [
    ("gemma2", "norm zeroed", "model.layers.1.input_layernorm.weight"),
    ("gemma2", "norm not plus one", "model.layers.0.post_feedforward_layernorm.weight"),
    ("gemma2", "final softcap", "final_logit_softcapping: A 30.0, B 20.0"),
    ("gemma2", "attn softcap", "attn_logit_softcapping: A 50.0, B 40.0"),
    ("gemma2", "window", "sliding_window: A 6, B 8"),
    ("gemma3", "q_norm zeroed", "model.layers.2.self_attn.q_norm.weight"),
    ("gemma3", "output norm zeroed", "model.norm.weight"),
    ("gemma3", "swa rope base", "sliding_rope_theta: A 10000.0, B 20000.0"),
    ("gemma3", "final softcap", "final_logit_softcapping: A 30.0, B 20.0"),
])
def test_verify_fails_planted_gemma_defects(gguf_model, gguf_ref, tmp_path, arch, defect, expect):
    src, ref = gguf_model(arch), gguf_ref(arch, "f32")
    hf = load_file(str(src / "model.safetensors"))
    edits = {
        "norm zeroed": dict(tensors={"blk.1.attn_norm.weight": lambda a: a * 0}),
        "norm not plus one": dict(tensors={"blk.0.post_ffw_norm.weight":
                                           lambda a: hf["model.layers.0.post_feedforward_layernorm.weight"].numpy()}),
        "final softcap": dict(fields={f"{arch}.final_logit_softcapping": 20.0}),
        "attn softcap": dict(fields={f"{arch}.attn_logit_softcapping": 40.0}),
        "window": dict(fields={f"{arch}.attention.sliding_window": 8}),
        "q_norm zeroed": dict(tensors={"blk.2.attn_q_norm.weight": lambda a: a * 0}),
        "output norm zeroed": dict(tensors={"output_norm.weight": lambda a: a * 0}),
        "swa rope base": dict(fields={f"{arch}.rope.freq_base_swa": 20000.0}),
    }[defect]
    bad = _edit(ref, tmp_path / "bad.gguf", **edits)
    r = run_cli("verify", src, bad, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1, r.output
    assert expect in r.output, r.output


@pytest.mark.parametrize("arch,key,value,expect", [
    ("gemma2", "query_pre_attn_scalar", 32, "query_pre_attn_scalar: A 32, but llama.cpp assumes 16"),
    ("gemma3", "layer_types", ["full_attention"] * 6,
     "layer_types: 5 of 6 layers differ (0: A full_attention, llama.cpp sliding_attention, 1: A full_attention"),
])
def test_what_llama_cpp_assumes_is_compared(gguf_model, gguf_ref, tmp_path, arch, key, value, expect):
    """llama.cpp takes Gemma's query scale from head_dim and which layers slide from a fixed pattern, not
    from the GGUF: a checkpoint whose config says otherwise converts to a GGUF llama.cpp runs differently
    (measured: query_pre_attn_scalar 32 moves the logits by 2.6e-2), which verify says (exit 1)."""
    src = tmp_path / "model"
    shutil.copytree(gguf_model(arch), src)
    config = json.loads((src / "config.json").read_text())
    config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    r = run_cli("verify", src, gguf_ref(arch, "f32"), "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1, r.output
    assert expect in r.output and f"(the GGUF has no key for it: llama.cpp assumes it for {arch})" in r.output, r.output


def test_phi3_qkv_and_gate_up_fused_read_back(gguf_model, gguf_ref):
    """Phi-3's fused qkv_proj and gate_up_proj are stored as they are (attn_qkv, ffn_up of 2I rows) and
    its two FFNs are found through the fused layout."""
    s = json.loads(run_cli("inspect", gguf_ref("phi3", "q8_0"), "--json").stdout)
    assert sum(g["count"] for g in s["ffn"].values()) == 2 and s["unmatched_ffn_like"] == []
    with open_any(gguf_ref("phi3", "f32")) as g:
        assert tuple(g.info("model.layers.0.mlp.gate_up_proj.weight").shape) == (192, 64)
        assert g.config["original_max_position_embeddings"] == 4096


def test_gemma_gguf_to_torch(gguf_model, gguf_ref, tmp_path):
    """f32 Gemma 2 GGUF -> torch: transformers loads it and every tensor but the norms is the source's bit for
    bit; the norms carry the rounding of ``w + 1`` (within 2**-24 of ``|w + 1|``), which verify reports."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "back"
    run_cli("-q", "convert", gguf_ref("gemma2", "f32"), "--to", "torch", "-o", out)
    a, b = load_file(str(gguf_model("gemma2") / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    assert [n for n in a if not torch.equal(a[n], b[n])] == sorted(n for n in a if n.endswith("norm.weight"))
    assert all(float((a[n] - b[n]).abs().max()) <= 2 ** -24 * float((a[n] + 1).abs().max()) for n in a)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Gemma2ForCausalLM" and model.config.hidden_activation == "gelu_pytorch_tanh"


def test_split_gemma_gguf(gguf_model, tmp_path):
    """A split Gemma GGUF reads as one: the shifted norms of every part."""
    convert_reference(gguf_model("gemma2"), tmp_path / "g.gguf", "f32", "--split-max-tensors", "8")
    parts = sorted(tmp_path.glob("g-*-of-*.gguf"))
    with open_any(parts[0]) as g:
        assert len(g.files) == len(parts) == 3
        assert len(g.shifts) == 9 and np.isfinite(g["model.norm.weight"].numpy()).all()


def test_gemma_gguf_against_gguf(gguf_ref):
    """Two GGUFs of one Gemma (f32 and q8_0): the norms both store plus one compare by their stored bits."""
    r = verify(gguf_ref("gemma2", "f32"), gguf_ref("gemma2", "q8_0"), backends=["reference"], load_check=False)
    assert r.passed, r.failures()
    assert any("9 bit for bit" in n for n in r.notes), r.notes
    bad = verify(gguf_ref("gemma2", "f32"), gguf_ref("gemma3", "f32"), backends=["reference"], load_check=False)
    assert not bad.passed
