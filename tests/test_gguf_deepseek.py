"""DeepSeek V2/V3 in GGUF (llama.cpp's deepseek2): written as convert_hf_to_gguf.py writes it, read back with
Hugging Face names, verified, and run by llama.cpp.

The converter stacks the routed experts, keeps the shared experts and the router bias (V3's
``e_score_correction_bias``, its ``exp_probs_b``), and splits each MLA ``kv_b_proj`` per head into ``k_b``
(transposed) and ``v_b``; the reader joins them back. The fixtures (``tiny_models.ARCHS``): V3 with a q LoRA and
sigmoid grouped routing as DeepSeek-V3's config.json says, V2 as V2-Lite (no q LoRA, softmax greedy routing,
27 layers: the only depth at which llama.cpp reads a deepseek2 GGUF without q_lora_rank; as fast as 2 here,
measured), both with a dense first layer and one shared expert, on vocabularies of llama.cpp whose pre-tokenizer
its converter recognises: GPT-2's (50,257 tokens), and for the GGUF -> torch test, which checks the tokenizer, V3
on llama-bpe (Llama 3's 128,256).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ffn_tools.converters import open_any
from ffn_tools.api import verify
from helpers import run_cli
from test_gguf import _edit

ARCHS = ("deepseek_v3", "deepseek_v2")


# f32 for both, bf16 for V3: the suite's time
@pytest.mark.parametrize("arch,outtype", [("deepseek_v3", "f32"), ("deepseek_v2", "f32"), ("deepseek_v3", "bf16")])
def test_reads_bit_exact_with_hf_names(gguf_model, gguf_ref, arch, outtype):
    """Every tensor reads back under the source's name as the converter stored it: kv_b_proj joined from k_b and
    v_b, routed experts one by one, shared experts, the router and its bias; f32 the source's bits, bf16 its
    bf16 cast (norms, router and bias stay F32)."""
    src = load_file(str(gguf_model(arch) / "model.safetensors"))
    with open_any(gguf_ref(arch, outtype)) as g:
        assert g.family.model_type == arch and set(g) == set(src)
        kv = "model.layers.1.self_attn.kv_b_proj.weight"
        assert g.types[kv] == outtype.upper() and g.info(kv).start is None  # made from two tensors
        differ = [n for n in src if not torch.equal(g[n], src[n].to(g[n].dtype))]
        assert differ == []
        assert {g[n].dtype for n in src} == ({torch.float32} if outtype == "f32" else {torch.float32, torch.bfloat16})
        assert g[kv].dtype == (torch.float32 if outtype == "f32" else torch.bfloat16)


def test_q8_0_reads_kv_b_within_its_coarser_half(gguf_model, gguf_ref):
    """q8_0: k_b's rows (qk_nope_head_dim 16) are no Q8_0 block, so the converter keeps it F16; v_b is Q8_0. The
    joined kv_b_proj reads dequantized as Q8_0, within one int8 step of the source."""
    src = load_file(str(gguf_model("deepseek_v3") / "model.safetensors"))
    with open_any(gguf_ref("deepseek_v3", "q8_0")) as g:
        kv = "model.layers.0.self_attn.kv_b_proj.weight"
        assert g.quantized(kv).params == {"bits": 8, "group_size": 32, "mode": "Q8_0"}
        err = (g[kv] - src[kv]).abs().max() / src[kv].abs().max()
        assert 0 < err < 1 / 127


@pytest.mark.parametrize("arch,outtype", [("deepseek_v3", "bf16"), ("deepseek_v3", "q8_0"), ("deepseek_v2", "bf16")])
def test_same_file_as_convert_hf_to_gguf(gguf_model, gguf_ref, tmp_path, arch, outtype):
    """Byte for byte the converter's file; k_b and v_b (no recipe) written by the converter itself."""
    out = tmp_path / "ours.gguf"
    r = json.loads(run_cli("-q", "convert", gguf_model(arch), "--to", "gguf", "-o", out, "--outtype", outtype,
                           "--json").stdout)
    assert out.read_bytes() == gguf_ref(arch, outtype).read_bytes()
    w = r["written"]
    assert not w["recipes_disproven"] and {"blk.{L}.ffn_gate_exps.weight", "blk.{L}.ffn_gate_shexp.weight"} <= set(
        w["recipes_proven"])
    assert sorted({n.split(".", 2)[2] for n in w["by_converter"]}) == ["attn_k_b.weight", "attn_v_b.weight"]


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_and_llama_cpp_logits(gguf_model, gguf_ref, arch):
    """f32: every FFN bit-identical, every other tensor identical, the MLA/MoE metadata agreeing key by key,
    llama.cpp builds the model and its logits agree with transformers' (measured: max abs 5e-7 (V3) and 9e-7
    (V2) on logits of size ~1)."""
    r = verify(gguf_model(arch), gguf_ref(arch, "f32"), backends=["reference"], logits=True)
    assert r.passed, r.failures()
    assert all(x.exact == "identical" for x in r.results)
    assert r.outside.passed and r.outside.within == 0
    assert r.load.client == "llama.cpp" and r.load.ok and r.load.architecture == "deepseek2"
    assert r.logits["client_b"] == "llama.cpp" and r.logits["max_abs"] < 5e-6 and r.logits["top1_agreement"] == 1.0
    assert not r.config.problems and r.config.compared >= 20


def test_verify_q8_0(gguf_model, gguf_ref):
    r = verify(gguf_model("deepseek_v3"), gguf_ref("deepseek_v3", "q8_0"), backends=["reference"])
    assert r.passed, r.failures()
    assert len(r.results) == 6 and r.tolerance.row.endswith("8-bit") and r.load.ok


def test_gguf_to_torch_gives_the_source_logits(gguf_model, gguf_ref, tmp_path):
    """f32 GGUF -> torch: config.json rebuilt from the metadata (MLA sizes, routing) builds the source's model in
    transformers: the same tensors, bit for bit, and the same logits, exactly. The rebuilt tokenizer encodes as
    the source's; verify passes: the llama-bpe tokenizer transformers makes holds <|endoftext|> (id 128256) as an
    added token outside its BPE vocabulary, the converter wrote it as one of the GGUF's tokens, so the rebuilt
    tokenizer.json has it in both (the same ids either way): a spelling a vocabulary cannot give back, which
    verify compares by what the tokenizers do (issue 37.8; it failed verify before)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = gguf_model("deepseek_v3-llama-bpe"), tmp_path / "back"  # V3 on Llama 3's vocabulary
    run_cli("-q", "convert", gguf_ref("deepseek_v3-llama-bpe", "f32"), "--to", "torch", "-o", out)
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (src, out))
    for key in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
                "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace", "routed_scaling_factor",
                "norm_topk_prob", "n_group", "topk_group", "num_key_value_heads", "num_experts_per_tok"):
        assert ca[key] == cb[key], key
    tokens = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        la, lb = (AutoModelForCausalLM.from_pretrained(p).eval()(tokens).logits for p in (src, out))
    assert torch.equal(la, lb)
    ta, tb = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(out)
    for text in ("The quick brown fox jumps over the lazy dog.", "Grüße  aus   München<|endoftext|>", "a    b"):
        assert ta(text)["input_ids"] == tb(text)["input_ids"]
    r = verify(src, out, backends=["reference"])
    assert r.failures() == [] and r.side_files.passed
    assert any(n.startswith("tokenizer.json: ") and "compared by behaviour instead" in n for n in r.side_files.notes)
    assert all(x.exact == "identical" for x in r.results) and r.outside.passed and not r.config.problems


DEFECTS = {
    # k_b and v_b hold each other's data (the same element count: qk_nope_head_dim == v_head_dim)
    "k_b v_b swapped": (lambda t: {"tensors": {"blk.1.attn_k_b.weight": lambda a: t["blk.1.attn_v_b.weight"].reshape(a.shape),
                                              "blk.1.attn_v_b.weight": lambda a: t["blk.1.attn_k_b.weight"].reshape(a.shape)}},
                        "model.layers.1.self_attn.kv_b_proj.weight"),
    "expert gate scaled": (lambda t: {"tensors": {"blk.1.ffn_gate_exps.weight": lambda a: a * np.array([1, 1, 1.01, 1],
                                                                                                          np.float32)[:, None, None]}},
                           "layer 1 expert 2"),
    # the source's bias is transformers' zero-initialised buffer: shifted, expert 1 is preferred
    "router bias shifted": (lambda t: {"tensors": {"blk.1.exp_probs_b.bias": lambda a: a + np.array([0, 0.5, 0, 0],
                                                                                                  np.float32)}},
                           "model.layers.1.mlp.gate.e_score_correction_bias"),
    "softmax gating": (lambda t: {"fields": {"deepseek2.expert_gating_func": 1}},
                       "scoring_func: A 'sigmoid', B 'softmax' (deepseek2.expert_gating_func)"),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_verify_fails_planted_defects(gguf_model, gguf_ref, tmp_path, defect):
    from ffn_tools.converters.gguf.header import Reader

    ref = gguf_ref("deepseek_v3", "f32")
    t = {x.name: np.array(x.data) for x in Reader(ref).tensors}
    edits, expect = DEFECTS[defect]
    bad = _edit(ref, tmp_path / "bad.gguf", **edits(t))
    r = run_cli("verify", gguf_model("deepseek_v3"), bad, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1, r.output
    assert expect in r.output, r.output
