"""A GGUF input written as GGUF from its codes (``converters/gguf/codes.py``, ``kept.choose_blocks``): a file made
by llama.cpp's own converter and quantizer (Q4_K_M: Q4_K and Q6_K; Q8_0) converted with the default
``--outtype auto`` keeps every quantized tensor's blocks byte for byte, and verify proves the values kept."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ffn_tools.converters import open_any
from ffn_tools.converters.gguf.header import Reader
from ffn_tools.converters.gguf.reader import field_values
from gguf_models import convert_reference
from helpers import failed_ffns, once, run_cli


@pytest.fixture(scope="module")
def quantized(shared_dir):
    """``quantized(ftype) -> Path``: llama-quantize's ``ftype`` file of a tiny Llama with 256-wide rows
    (K-quants' super-block), from convert_hf_to_gguf.py's bf16 file (the kquant tests' model, shared)."""
    import gguf_models
    from test_gguf_kquant import llama_quantize

    def make(tmp):  # the same as test_gguf_kquant's ``wide``: one build per run where both run
        gguf_models.build("llama", tmp / "model", torch.bfloat16, hidden_size=256, intermediate_size=512,
                          head_dim=64)
        convert_reference(tmp / "model", tmp / "bf16.gguf", "bf16")
    made = once(shared_dir / "kquant-llama", make)

    def get(ftype: str):
        return once(shared_dir / f"lowbit-{ftype}", lambda tmp: tmp.mkdir() or llama_quantize(
            made / "bf16.gguf", tmp / "q.gguf", ftype, {})) / "q.gguf"
    return get


def tensors(path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in Reader(path, "r").tensors}


def test_bpe_gguf_to_gguf_without_tokenizer_files_is_its_source(gguf_ref, tmp_path):
    """A byte-level BPE GGUF as llama.cpp's converter writes it (Qwen3-MoE, GPT-2's vocabulary, Q8_0 experts and F16
    tensors), alone in its directory, to GGUF with --outtype auto: every tensor and every metadata value the
    source's (ffn-tools' codes key aside). The converter reads the tokenizer rebuilt from the GGUF's metadata. While
    transformers' reader made the padding token "!" special, the converter did not recognise that tokenizer's
    pre-tokenizer by its encodings (it refused: "BPE pre-tokenizer was not recognized") and wrote "!" as CONTROL
    (llama.cpp decodes those as nothing). "!" stays ordinary in the rebuilt tokenizer now (``sidefiles.ordinary_pad``):
    the converter recognises it and writes the source's token types, with neither of the worker's corrections
    (``_pre_fallback``, ``_token_types_as_source``, kept for tokenizers a rebuild still changes)."""
    src = tmp_path / "in" / "model.gguf"
    src.parent.mkdir()
    src.write_bytes(gguf_ref("qwen3_moe", "q8_0").read_bytes())
    out = tmp_path / "out.gguf"
    r = json.loads(run_cli("-q", "convert", src, "--to", "gguf", "-o", out, "--json").stdout)
    assert tensors(out) == tensors(src)
    meta, before = field_values(Reader(out, "r")), field_values(Reader(src, "r"))
    assert {k: v for k, v in meta.items() if not k.startswith("ffn_tools.")} == before
    assert before["tokenizer.ggml.pre"] == "gpt-2" and before["tokenizer.ggml.token_type"][0] == 1  # "!": NORMAL
    said = r["changes"]
    assert not any(c.startswith(("tokenizer.ggml.pre", "tokenizer.ggml.token_type")) for c in said), said


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
def test_gguf_to_gguf_keeps_every_block(quantized, tmp_path, ftype):
    src = quantized(ftype)
    out = tmp_path / "out.gguf"
    r = json.loads(run_cli("-q", "convert", src, "--to", "gguf", "-o", out, "--json").stdout)
    a, b = tensors(src), tensors(out)
    assert a.keys() == b.keys()
    lossy = {n for n, (t, _) in a.items() if t not in ("F32", "F16", "BF16")}
    assert len(lossy) >= 14  # every projection, the embedding and the output
    if ftype == "Q4_K_M":
        assert {a[n][0] for n in lossy} >= {"Q4_K", "Q6_K"}
    for n in lossy:  # the quantized tensors: their blocks, byte for byte (q/k rows un- and re-permuted)
        assert b[n] == a[n], n
    kept = [t for t in r["codes"] if t["action"] == "kept"]
    assert len(kept) == len(r["codes"]) == len(lossy) and all(t["blocks_exact"] == t["blocks"] > 0 for t in kept)
    meta, before = field_values(Reader(out, "r")), field_values(Reader(src, "r"))
    assert set(meta["ffn_tools.codes.kept"]) == lossy
    # the metadata is the source's (general.name, file type, the tokenizer rebuilt and written again), ours added
    assert {k: v for k, v in meta.items() if not k.startswith("ffn_tools.")} == before
    if ftype == "Q4_K_M":  # verify: each kept tensor's values are A's, exactly
        v = json.loads(run_cli("verify", src, out, "--backend", "reference", "--json").stdout)
        assert v["passed"] and v["load_check"]["ok"]
        assert {f["exact"] for f in v["ffns"]} == {"codes"}
        # a planted defect a 4-bit tolerance row passes: one Q4_K super-block's scale d taken from the next block
        t = next(t for t in Reader(out, "r").tensors if t.name == "blk.1.ffn_up.weight")
        assert t.tensor_type.name == "Q4_K"
        data, at = bytearray(out.read_bytes()), int(t.data_offset)
        k = next(i for i in range(1, 64) if data[at + 144 * i:at + 144 * i + 2] != data[at:at + 2])
        data[at:at + 2] = data[at + 144 * k:at + 144 * k + 2]
        failed = failed_ffns(src, bytes(data), tmp_path)
        assert [f["ffn"] for f in failed] == ["layer 1"] and "holds A's codes" in " ".join(failed[0]["problems"])


def test_gguf_int_codes_are_gguf_py_values(quantized):
    """Q8_0, Q4_0 and Q4_1 blocks read as integer codes (``IntCodes``): their values are gguf-py's dequantization."""
    for ftype in ("Q8_0", "Q4_0", "Q4_1"):
        with open_any(quantized(ftype)) as g:
            name = "model.layers.0.self_attn.q_proj.weight"  # rows re-permuted: the reader's order
            m = g.quantized(name)
            parts = g.quantized_parts(name)
            codes = m.scheme.int_codes(m, parts)
            assert codes is not None and codes.bits == (8 if ftype == "Q8_0" else 4) and g.types[name] == ftype
            assert torch.equal(codes.values(), g[name].float()), ftype
            assert torch.equal(m.scheme.exact_values(m, parts), g[name].float())
            assert int(codes.codes.min()) >= 0 and int(codes.codes.max()) < 2 ** codes.bits


@pytest.fixture(scope="module")
def w4a4(gguf_model, shared_dir):
    """A tiny ModelOpt NVFP4 W4A4 Llama: compressed-tensors' NVFP4 compressor's weights in ModelOpt's layout
    (``ct_models.to_modelopt``), each Linear with the float32 ``input_scale`` ModelOpt writes for its activations,
    and the sentencepiece tokenizer llama.cpp's converter reads."""
    pytest.importorskip("compressed_tensors")
    import shutil

    import ct_models
    from safetensors.torch import load_file, save_file

    tok = gguf_model("llama")

    def make(tmp):
        _, ct = ct_models.build("llama", tmp, {"g": (["Linear"], ct_models.nvfp4_args())},
                                fmt="nvfp4-pack-quantized", vocab_size=384, intermediate_size=128)
        q = ct_models.to_modelopt(ct, tmp / "modelopt")
        sd = load_file(q / "model.safetensors")
        gen = torch.Generator().manual_seed(0)
        for k in [k for k in sd if k.endswith(".weight_scale_2")]:  # amax / (6 * 448), as ModelOpt calibrates
            sd[k.replace(".weight_scale_2", ".input_scale")] = (torch.rand((), generator=gen) * 4 + 1) / 2688
        save_file(sd, q / "model.safetensors", metadata={"format": "pt"})
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
            if (tok / f).exists():
                shutil.copy(tok / f, q / f)
        for d in (ct, tmp / "twin"):
            shutil.rmtree(d, ignore_errors=True)
    return once(shared_dir / "lowbit-nvfp4-w4a4", make) / "modelopt"


def test_nvfp4_w4a4_input_scales_as_llama_cpps_converter(w4a4, tmp_path):
    """ModelOpt NVFP4 W4A4 into GGUF from its codes: the .input_scale tensors llama.cpp's converter writes are
    written, each with the converter's bytes (its blocks and .scale too); the GGUF reads back, and into GGUF
    again keeps all three."""
    from gguf_models import convert_reference

    out = tmp_path / "q.gguf"
    r = json.loads(run_cli("-q", "convert", w4a4, "--to", "gguf", "-o", out, "--json").stdout)
    assert {(t["action"], t["type"]) for t in r["codes"]} == {("kept", "NVFP4")}
    ref = convert_reference(w4a4, tmp_path / "ref.gguf", "auto")
    ours, theirs = tensors(out), tensors(ref)
    assert sum(n.endswith(".input_scale") for n in theirs) == 14  # every Linear: the converter writes them
    assert ours == theirs  # names, types and bytes: .weight, .scale and .input_scale
    with open_any(out) as g:  # the reader takes .input_scale as the weight's, not an unknown tensor
        assert "model.layers.0.mlp.gate_proj.weight" in g and not any("input_scale" in n for n in g)
    again = tmp_path / "again.gguf"  # and that GGUF into GGUF: its NVFP4 blocks, .scale and .input_scale kept
    r = json.loads(run_cli("-q", "convert", out, "--to", "gguf", "-o", again, "--json").stdout)
    assert {(t["action"], t["type"]) for t in r["codes"]} == {("kept", "NVFP4")}
    assert tensors(again) == theirs


@pytest.fixture(scope="module")
def two_groups(gguf_model, shared_dir):
    """A tiny compressed-tensors Llama of two config groups, as llm-compressor writes a mixed recipe: FP8 per
    channel attention (``float-quantized``) and int4 group-32 MLP (``pack-quantized``), by compressed-tensors'
    own compressor (format ``mixed-precision``)."""
    pytest.importorskip("compressed_tensors")
    import shutil

    import compressed_tensors.quantization as cq
    import ct_models
    from compressed_tensors.quantization import QuantizationArgs

    tok = gguf_model("llama")
    fmts = {"re:.*self_attn.*": "float-quantized", "re:.*mlp.*": "pack-quantized"}

    def make(tmp):
        scheme = cq.QuantizationScheme  # ct_models.build names no group format: each group's given here
        cq.QuantizationScheme = lambda targets, weights: scheme(targets=targets, weights=weights,
                                                                 format=fmts[targets[0]])
        try:
            fp8 = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
            _, q = ct_models.build("llama", tmp, {"attn": (["re:.*self_attn.*"], fp8),
                                                  "mlp": (["re:.*mlp.*"], ct_models.args(4, group_size=32))},
                                   fmt=None, vocab_size=384)
        finally:
            cq.QuantizationScheme = scheme
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
            if (tok / f).exists():
                shutil.copy(tok / f, q / f)
    return once(shared_dir / "lowbit-two-groups", make) / "ct"


def test_two_groups_each_in_the_type_that_holds_it(two_groups, tmp_path):
    """FP8 attention + int4 MLP into GGUF: by default refused for the FP8 group alone, saying the int4 group keeps
    its codes; with --requantize the FP8 group is Q8_0 of its values, said per tensor, and the int4 group is still
    its codes as Q4_0 (values exactly its ``IntCodes``), verified."""
    cfg = json.loads((two_groups / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mixed-precision" and len(cfg["config_groups"]) == 2
    refused = run_cli("convert", two_groups, "--to", "gguf", "-o", tmp_path / "r.gguf", ok=False)
    msg = refused.output
    assert "8 of 14 quantized weights" in msg and "self_attn" in msg and "mlp." not in msg.split("(the other")[0]
    assert "the other 6 keep their codes exactly: 6 int4 group 32 symmetric (pack-quantized) as Q4_0" in msg
    assert not list(tmp_path.iterdir())
    out = tmp_path / "q.gguf"
    r = json.loads(run_cli("-q", "convert", two_groups, "--to", "gguf", "-o", out, "--requantize", "--json").stdout)
    by = {t["tensor"]: (t["action"], t["type"]) for t in r["codes"]}
    assert {v for k, v in by.items() if "attn" in k} == {("requantized", "Q8_0")} and len(by) == 14
    assert {v for k, v in by.items() if "ffn" in k} == {("kept", "Q4_0")}
    said = [c for c in r["changes"] if c.startswith("re-quantized ")]
    assert len(said) == 8 and all("fp8 per channel" in c for c in said)
    assert any(c.startswith("kept the codes of 6 quantized tensors (int4") for c in r["changes"])
    with open_any(out) as g, open_any(two_groups) as src:
        for name, m in src.modules.items():
            if ".mlp." in name:
                assert torch.equal(g[name].float(), m.scheme.int_codes(m, src.quantized_parts(name)).values())
    v = json.loads(run_cli("verify", two_groups, out, "--backend", "reference", "--json").stdout)
    assert v["passed"] and [f["exact"] for f in v["ffns"]] == ["codes", "codes"]
