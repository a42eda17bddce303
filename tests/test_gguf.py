"""GGUF read through the checkpoint surface, and verify against the Hugging Face checkpoint it came from.

The GGUFs are llama.cpp's own: ``convert_hf_to_gguf.py`` run on tiny transformers checkpoints with real
llama.cpp vocabularies (``gguf_models``). Defects are planted by editing a copy of a GGUF in place through
gguf's own reader (``GGUFReader(path, "r+")``: tensor data and metadata values are writable views).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ffn_tools.converters import detect_format, open_any
from ffn_tools.api import verify
import gguf_models
from gguf_models import convert_reference
from helpers import once, run_cli


def hf_tensors(model):
    return load_file(str(model / "model.safetensors"))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral"])
def test_f32_reads_bit_exact_with_hf_names(gguf_model, gguf_ref, arch):
    """Every tensor of the converter's f32 GGUF reads back as the source's, under its name: q/k rows back in
    transformers' order, stacked experts as per-expert tensors."""
    src = hf_tensors(gguf_model(arch))
    path = gguf_ref(arch, "f32")
    assert detect_format(path) == "gguf"
    with open_any(path) as g:
        assert set(g) == set(src)
        differ = [n for n in src if not torch.equal(g[n], src[n])]
        assert differ == []
        assert g.config["model_type"] == arch
        assert g.config["num_hidden_layers"] == 2 and g.config["hidden_size"] == 64
        assert all(g.quantized(n) is None for n in g)
        lone = next(n for n in src if n.endswith("down_proj.weight") or n.endswith("w2.weight"))
        assert bytes(g.read_raw(lone)) == src[lone].numpy().tobytes()


@pytest.mark.parametrize("outtype,dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_f16_bf16_read_as_stored(gguf_model, gguf_ref, outtype, dtype):
    """The converter casts 2-D weights to the outtype and keeps norms f32; they read back exactly so."""
    src = hf_tensors(gguf_model("llama"))
    with open_any(gguf_ref("llama", outtype)) as g:
        for n, t in src.items():
            want = t if t.dim() == 1 else t.to(dtype)
            assert g[n].dtype == want.dtype and torch.equal(g[n], want), n


def test_q8_0_reads_dequantized_with_its_type(gguf_model, gguf_ref):
    src = hf_tensors(gguf_model("llama"))
    with open_any(gguf_ref("llama", "q8_0")) as g:
        name = "model.layers.0.mlp.gate_proj.weight"
        assert g.quantized(name).params == {"bits": 8, "group_size": 32, "mode": "Q8_0"}
        assert g.quantized("model.norm.weight") is None
        err = (g[name] - src[name]).abs().max() / src[name].abs().max()
        assert 0 < err < 1 / 127  # Q8_0: one int8 step of each 32-weight block's absmax
        assert "Q8_0 read dequantized" in g.label


def test_split_gguf_opens_from_any_part(gguf_model, tmp_path):
    out = convert_reference(gguf_model("llama"), tmp_path / "llama.gguf", "f32", "--split-max-tensors", "8")
    parts = sorted(tmp_path.glob("llama-*-of-*.gguf"))
    assert len(parts) == 3 and not out.exists()
    src = hf_tensors(gguf_model("llama"))
    with open_any(parts[1]) as g:
        assert len(g.files) == 3 and set(g) == set(src)
        assert all(torch.equal(g[n], src[n]) for n in src)
    parts[2].unlink()
    r = run_cli("inspect", parts[0], ok=False)
    assert "llama-00003-of-00003.gguf missing" in r.output


@pytest.mark.parametrize("arch,ffns", [("llama", 2), ("qwen3_moe", 8), ("mixtral", 8)])
def test_inspect_counts_every_ffn(gguf_ref, arch, ffns):
    for outtype in ("f32", "q8_0"):
        s = json.loads(run_cli("inspect", gguf_ref(arch, outtype), "--json").stdout)
        assert s["format"].startswith("gguf")
        assert sum(g["count"] for g in s["ffn"].values()) == ffns, s["ffn"]
        assert s["unmatched_ffn_like"] == []


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_verify_passes_the_converter_output(gguf_model, gguf_ref, outtype):
    r = verify(gguf_model("llama"), gguf_ref("llama", outtype), backends=["reference"], load_check=False)
    assert r.passed, r.failures()
    assert r.config.compared >= 8 and not r.config.problems
    assert r.side_files.identical and "384 tokens" in r.side_files.identical[0]
    exact = {x.exact for x in r.results}
    assert exact == ({"identical"} if outtype == "f32" else {"skipped"} if outtype == "q8_0" else exact)


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_verify_dense_families_with_load_check(gguf_model, gguf_ref, arch):
    """Mistral (llama.cpp's llama architecture, q/k permuted) and Qwen3 (q/k norms, no permutation) in bf16:
    everything agrees and llama.cpp builds both."""
    r = verify(gguf_model(arch), gguf_ref(arch, "bf16"), backends=["reference"])
    assert r.passed, r.failures()
    assert r.load.client == "llama.cpp" and r.load.ok
    assert r.outside.passed and not r.outside.only_a and not r.outside.only_b
    assert r.tokenization.compared == 37 and not r.tokenization.differ  # llama.cpp tokenizes as transformers


def test_verify_moe(gguf_model, gguf_ref):
    r = verify(gguf_model("qwen3_moe"), gguf_ref("qwen3_moe", "q8_0"), backends=["reference"], load_check=False)
    assert r.passed
    assert len(r.results) == 8 and r.tolerance.row.endswith("8-bit")


@pytest.mark.parametrize("arch,outtype", [("qwen3_moe", "f32"), ("llama", "q8_0")])
def test_header_reader_builds_what_gguf_py_builds(gguf_ref, arch, outtype):
    """``header.Reader`` (what ffn-tools opens GGUFs with) gives gguf-py's GGUFReader's fields (every part's
    bytes and dtype, indices, types, offsets) and tensors, on a byte-level BPE vocabulary (GPT-2's 50,257
    tokens and 50,000 merges: gguf-py reads it in 1.8 s here, Qwen's 151,936 in 6.2 s) and a sentencepiece one
    (scores, token types). How much faster is ``benchmarks/bench_timings.py``'s (a time, not a unit test's)."""
    from gguf import GGUFReader

    from ffn_tools.converters.gguf.header import Reader

    path = gguf_ref(arch, outtype)
    theirs = GGUFReader(path)
    ours = Reader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, f in theirs.fields.items():
        g = ours.fields[key]
        assert (g.offset, g.name, g.data, g.types) == (f.offset, f.name, f.data, f.types), key
        assert [(bytes(p), p.dtype, p.shape) for p in g.parts] == [(bytes(p), p.dtype, p.shape) for p in f.parts], key
        assert g.contents() == f.contents(), key
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in theirs.tensors]
    assert all(np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)) for a, b in zip(ours.tensors, theirs.tensors))


@pytest.mark.parametrize("vocab", ["gpt-2", "llama-spm"])
def test_transformers_reads_the_same_tokenizer_through_the_header_reader(vocab):
    """``sidefiles.header_reader`` (transformers' GGUF reader given ``header.Reader`` for gguf-py's GGUFReader, and
    its own reader a plain ndarray for its memmap: how convert reads a GGUF's tokenizer) gives the tokenizer
    transformers builds on its own: the same
    tokenizer.json, special tokens and encodings, on a byte-level BPE vocabulary with merges (GPT-2's) and a
    sentencepiece one with scores (Llama's); and gguf-py's class is back in place after it. Given a reader of the
    file (convert's, which opened it), transformers reads through that one."""
    import gguf
    from transformers import AutoTokenizer

    from ffn_tools.converters.gguf.header import Reader
    from ffn_tools.converters.gguf.sidefiles import header_reader

    models = gguf_models.require_llama_cpp() / "models"
    theirs = AutoTokenizer.from_pretrained(models, gguf_file=f"ggml-vocab-{vocab}.gguf")
    from transformers.integrations.gguf import reader as own  # transformers 5's own reader: over a plain ndarray

    original, mapped = gguf.GGUFReader, own._mapped
    path = models / f"ggml-vocab-{vocab}.gguf"
    opened = Reader(path)
    for given in (None, opened):  # a reader of the file given: transformers gets it, not a second parse
        with header_reader(given):
            assert gguf.GGUFReader is not original and own._mapped is not mapped
            assert (gguf.GGUFReader(str(path)) is opened) == (given is opened)
            assert gguf.GGUFReader(models / "ggml-vocab-bert-bge.gguf") is not opened  # another file
            ours = AutoTokenizer.from_pretrained(models, gguf_file=path.name)
        assert gguf.GGUFReader is original and own._mapped is mapped
        assert type(ours) is type(theirs) and len(ours) == len(theirs) > 30000
        assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
        assert ours.special_tokens_map == theirs.special_tokens_map
        for text in ("The quick brown fox, 1234567890.", "  Grüße\n\taus München"):
            assert ours(text)["input_ids"] == theirs(text)["input_ids"]


def _edit(path, dst, tensors=None, fields=None):
    """A copy of GGUF ``path`` at ``dst`` with tensors (gguf name -> f(array) -> array) and metadata values
    (key -> value) replaced in place, through gguf's reader (ffn-tools' faster-parsing subclass of it)."""
    from ffn_tools.converters.gguf.header import Reader

    shutil.copy(path, dst)
    r = Reader(dst, "r+")
    by_name = {t.name: t for t in r.tensors}
    for name, fn in (tensors or {}).items():
        t = by_name[name]
        t.data[...] = fn(np.array(t.data))
    for key, value in (fields or {}).items():
        r.fields[key].parts[-1][0] = value
    r.mapped.flush()
    del r
    return dst


@pytest.mark.parametrize("defect", ["swap", "q unpermuted", "rope base", "eps", "down scaled", "norm zeroed"])
def test_verify_fails_planted_defects(gguf_model, gguf_ref, tmp_path, defect):
    from gguf import GGUFReader

    src, ref = gguf_model("llama"), gguf_ref("llama", "f32")
    t = {x.name: np.array(x.data) for x in GGUFReader(ref).tensors}
    hf = hf_tensors(src)
    edits = {
        "swap": dict(tensors={"blk.1.ffn_gate.weight": lambda a: t["blk.1.ffn_up.weight"],
                              "blk.1.ffn_up.weight": lambda a: t["blk.1.ffn_gate.weight"]}),
        "q unpermuted": dict(tensors={"blk.0.attn_q.weight": lambda a: hf["model.layers.0.self_attn.q_proj.weight"].numpy()}),
        "rope base": dict(fields={"llama.rope.freq_base": 20000.0}),
        "eps": dict(fields={"llama.attention.layer_norm_rms_epsilon": 1e-5}),
        "down scaled": dict(tensors={"blk.0.ffn_down.weight": lambda a: a * 1.01}),
        "norm zeroed": dict(tensors={"blk.1.attn_norm.weight": lambda a: a * 0}),
    }[defect]
    bad = _edit(ref, tmp_path / "bad.gguf", **edits)
    r = run_cli("verify", src, bad, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1, r.output
    expect = {"swap": "layer 1", "q unpermuted": "q_proj", "rope base": "rope_theta: A 10000.0, B 20000.0",
              "eps": "rms_norm_eps", "down scaled": "layer 0", "norm zeroed": "input_layernorm"}[defect]
    assert expect in r.output


def test_load_check_and_logits_through_llama_cpp(gguf_model, gguf_ref, tmp_path):
    """llama.cpp itself builds the GGUF (the load check) and its logits agree with transformers' (f32: within
    5e-6 of logits of size ~1e-2, far inside the widened float32 row); a GGUF lacking a tensor it needs is
    refused by llama.cpp, which verify reports as a failure."""
    src, ref = gguf_model("llama"), gguf_ref("llama", "f32")
    r = verify(src, ref, backends=["reference"], logits=True)
    assert r.passed, r.failures()
    assert r.load.client == "llama.cpp" and r.load.ok and r.load.architecture == "llama"
    assert r.logits["client_b"] == "llama.cpp" and r.logits["max_abs"] < 5e-6
    assert r.logits["top1_agreement"] == 1.0
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(ref)  # the same file less blk.1.ffn_down.weight, written by gguf's own writer
    w = GGUFWriter(tmp_path / "short.gguf", "llama")
    for key, f in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if f.types[0].name == "ARRAY" else None)
    for t in reader.tensors:
        if t.name != "blk.1.ffn_down.weight":
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    r = run_cli("verify", src, tmp_path / "short.gguf", "--backend", "reference", ok=None)
    assert r.exit_code == 1
    assert "would not load: llama.cpp cannot build the model" in r.output


@pytest.mark.parametrize("ftype,types,row", [("Q4_0", {"Q4_0", "Q8_0"}, "4-bit"), ("Q4_K_M", {"Q5_0", "Q8_0"}, "5-bit")])
def test_llama_quantize_outputs_read_and_verify(gguf_model, gguf_ref, tmp_path, ftype, types, row):
    """llama-quantize's own code (llama-cpp-python's llama_model_quantize) quantizes the converter's f32 file;
    every type it writes reads dequantized and verify passes each FFN in its type's row. (Q4_K_M on a
    64-wide model: llama-quantize falls back to Q5_0/Q8_0 where rows are not multiples of 256.)"""
    import ctypes

    import llama_cpp

    out = tmp_path / f"{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    assert llama_cpp.llama_model_quantize(str(gguf_ref("llama", "f32")).encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    with open_any(out) as g:
        assert {p["mode"] for n in g if (p := g.quantized(n).params if g.quantized(n) else None)} == types
    r = verify(gguf_model("llama"), out, backends=["reference"], load_check=False)
    assert r.passed, r.failures()
    assert r.tolerance.row.endswith(row)


@pytest.mark.parametrize("ftype,types", [("Q4_K_M", {"Q4_K", "Q6_K"}), ("Q5_K_S", {"Q5_K"}), ("Q6_K", {"Q6_K"}),
                                         ("Q3_K_M", {"Q3_K"}), ("Q2_K", {"Q2_K"}), ("IQ4_XS", {"IQ4_XS"})])
def test_k_quants_of_a_256_wide_model_read_and_verify(wide_llama, tmp_path, ftype, types):
    """Rows of 256 (K-quant super-blocks): llama-quantize writes the real K and IQ types, not their 64-wide
    fallbacks; each reads dequantized by gguf-py and verify passes every FFN in the row of its bits."""
    import ctypes

    import llama_cpp

    src, f32 = wide_llama
    out = tmp_path / f"{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), ctypes.byref(params)) == 0
    with open_any(out) as g:
        modes = {p["mode"] for n in g if (p := g.quantized(n).params if g.quantized(n) else None)}
    assert types <= modes, modes
    r = verify(src, out, backends=["reference"], load_check=False)
    assert r.passed, r.failures()
    assert len(r.results) == 2


@pytest.fixture(scope="session")
def wide_llama(shared_dir):
    """A Llama with 256-wide rows (hidden 256, intermediate 512) and its converter f32 GGUF, made once per run
    (``shared_dir``): read-only."""

    def make(d):
        src = gguf_models.build("llama", d / "model", hidden_size=256, intermediate_size=512, head_dim=64)
        gguf_models.convert_reference(src, d / "f32.gguf", "f32")

    d = once(shared_dir / "gguf-wide-llama", make)
    return d / "model", d / "f32.gguf"


def test_extract_from_gguf_is_bit_exact(gguf_model, gguf_ref, tmp_path):
    run_cli("-q", "extract", gguf_ref("qwen3_moe", "f32"), "-o", tmp_path / "ffn")
    r = verify(gguf_model("qwen3_moe"), tmp_path / "ffn", backends=["reference"])
    assert r.passed and len(r.results) == 8 and all(x.exact == "identical" for x in r.results)


def test_unreadable_ggufs_are_refused_by_name(gguf_ref, tmp_path):
    """A tensor no Hugging Face name is known for, and an architecture ffn-tools does not read, are refused
    (exit 2, one line naming them), never read as something else."""
    from gguf import GGUFReader, GGUFWriter

    def rewrite(dst, arch, extra=None):
        reader = GGUFReader(gguf_ref("llama", "f32"))
        w = GGUFWriter(dst, arch)
        for key, f in reader.fields.items():
            if not key.startswith("GGUF.") and key != "general.architecture":
                w.add_key_value(key.replace("llama.", f"{arch}."), f.contents(), f.types[0],
                                f.types[-1] if f.types[0].name == "ARRAY" else None)
        for t in reader.tensors:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        for name, data in (extra or {}).items():
            w.add_tensor(name, data)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        return dst

    odd = rewrite(tmp_path / "odd.gguf", "llama", {"blk.0.mystery.weight": np.ones((4, 4), np.float32)})
    r = run_cli("inspect", odd, ok=False)
    assert "1 tensor(s) of no Hugging Face name known for llama: blk.0.mystery.weight" in r.output
    r = run_cli("inspect", rewrite(tmp_path / "g.gguf", "gptneox"), ok=False)
    assert "general.architecture 'gptneox' is not one ffn-tools reads" in r.output


def _rewrite(src, dst, fields=None, drop=(), strings=None):
    """A copy of GGUF ``src`` at ``dst`` through gguf's own writer, with metadata values replaced (key -> value),
    keys dropped (by prefix) and string keys added (``strings``: key -> text). ``src`` is read by ffn-tools'
    ``header.Reader``: gguf-py's GGUFReader with the same fields and tensors
    (``test_header_reader_builds_what_gguf_py_builds``), parsing a 32,000-token vocabulary in a fraction of the
    time."""
    from gguf import GGUFWriter

    from ffn_tools.converters.gguf.header import Reader

    reader = Reader(src)
    w = GGUFWriter(dst, "llama")
    for key, f in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture", *drop)):
            continue
        value = (fields or {}).get(key, f.contents())
        w.add_key_value(key, value, f.types[0], f.types[-1] if f.types[0].name == "ARRAY" else None)
    for key, text in (strings or {}).items():
        w.add_string(key, text)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


def test_tokenization_through_llama_cpp(gguf_model, gguf_ref):
    """llama.cpp tokenizes the built-in corpus from each converter output's vocabulary as transformers does
    from the source: the sentencepiece Llama (tokenizer.model read by the converter: real scores) and the
    byte-level BPE Qwen2 vocabulary."""
    from ffn_tools.checks.corpus import CORPUS
    from ffn_tools.converters.gguf.header import Reader  # gguf-py's GGUFReader's fields, parsed faster

    scores = Reader(gguf_ref("llama-spm", "f32")).fields["tokenizer.ggml.scores"].contents()
    assert len(set(scores)) > 30000  # the converter read tokenizer.model, not tokenizer.json's placeholders
    for arch in ("llama-spm", "qwen3"):
        r = verify(gguf_model(arch), gguf_ref(arch, "f32"), backends=["reference"], load_check=False)
        assert r.passed, r.failures()
        assert r.tokenization.compared == len(CORPUS) and r.tokenization.differ == []
        assert "all 37 texts of the built-in corpus tokenize the same" in r.tokenization.line()


def test_tokenizer_json_only_llama_fails_tokenization(gguf_model, tmp_path):
    """A sentencepiece Llama with tokenizer.json and no tokenizer.model: convert_hf_to_gguf.py writes score
    -1000 for every token and no merges. Its tokens are the source's (the token-by-token comparison passes)
    but llama.cpp tokenizes many texts otherwise: verify fails on tokenization, exit 1, naming the first text."""
    from ffn_tools.converters.gguf.header import Reader  # gguf-py's GGUFReader's fields, parsed faster

    src = gguf_models.copy_model(gguf_model("llama-spm"), tmp_path / "model")
    (src / "tokenizer.model").unlink()
    out = convert_reference(src, tmp_path / "json-only.gguf", "f32")
    fields = Reader(out).fields
    assert set(fields["tokenizer.ggml.scores"].contents()) == {-1000.0} and "tokenizer.ggml.merges" not in fields
    r = run_cli("verify", src, out, "--backend", "reference", "--no-load-check", "--json", ok=None)
    v = json.loads(r.stdout)
    assert r.exit_code == 1 and v["side_files"]["passed"]  # the tokens alone: the same
    t = v["tokenization"]
    assert t["compared"] == 37 and len(t["differ"]) == 16, [d["text"] for d in t["differ"]]
    assert v["failures"] == [
        "tokenization: 16 of 37 texts tokenize differently in llama.cpp (B) than in A's transformers tokenizer; "
        "first: 'The quick brown fox jumps over the lazy dog.': A [1, 450, 4996, 17354, 1701, 29916, 432, 17204, "
        "975, 278, 17366, 11203, 29889] (13 tokens), B [1, 450, 4996, 17354, 1701, 29916, 12500, 29879, 975, 278, "
        "17366, 11203, 29889] (13 tokens)"]
    r = run_cli("verify", src, out, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1
    assert ("tokenization (A's transformers tokenizer vs llama.cpp on B's vocabulary): 16 of 37 texts of the "
            "built-in corpus tokenize differently") in r.output
    assert r.output.splitlines()[-1].startswith("FAIL: tokenization differs; first: tokenization: 16 of 37 texts")


def test_tokenization_fails_swapped_tokens_and_says_when_it_did_not_run(gguf_model, gguf_ref, tmp_path):
    """Two tokens of the GGUF's vocabulary exchanged (written by gguf's writer): llama.cpp tokenizes the first
    text otherwise, which the tokenization check names. Without A's tokenizer, or B's, the check says it did not
    run (never a pass of it)."""
    from ffn_tools.converters.gguf.header import Reader  # gguf-py's GGUFReader's fields, parsed faster

    src, ref = gguf_model("llama-spm"), gguf_ref("llama-spm", "f32")
    tokens = Reader(ref).fields["tokenizer.ggml.tokens"].contents()
    assert tokens[450] == "▁The" and tokens[4996] == "▁quick"
    tokens[450], tokens[4996] = tokens[4996], tokens[450]
    bad = _rewrite(ref, tmp_path / "swapped.gguf", {"tokenizer.ggml.tokens": tokens})
    r = run_cli("verify", src, bad, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1, r.output
    assert ("  - tokenization: 1 of 37 texts tokenize differently in llama.cpp (B) than in A's transformers "
            "tokenizer; first: 'The quick brown fox jumps over the lazy dog.': A [1, 450, 4996, 17354") in r.output
    assert "B [1, 4996, 450, 17354" in r.output

    bare = tmp_path / "bare"  # A without tokenizer files
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, bare / name)
    r = verify(bare, ref, backends=["reference"], load_check=False)
    assert r.passed and r.tokenization.skipped.startswith("A has no tokenizer transformers loads")
    assert "tokenization not compared (A has no tokenizer transformers loads" in r.verdict
    no_vocab = _rewrite(ref, tmp_path / "no-vocab.gguf", drop=("tokenizer.",))
    r = verify(src, no_vocab, backends=["reference"], load_check=False)
    assert r.tokenization.skipped == "B has no tokenizer.ggml.tokens" and not r.passed
    assert "tokenization: not compared (B has no tokenizer.ggml.tokens)" in r.lines()


def _with_config(model, dst, **values):
    """A copy of checkpoint ``model`` at ``dst`` whose config.json has ``values`` (transformers 5 keeps the rope
    base in ``rope_parameters``: ``rope_theta`` is set there too)."""
    shutil.copytree(model, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(values)
    if "rope_theta" in values and isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"]["rope_theta"] = values["rope_theta"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_a_missing_rope_base_is_llama_cpps_default(gguf_model, gguf_ref, tmp_path, base):
    """A GGUF without ``llama.rope.freq_base`` runs at llama.cpp's default base, 10000: verify compares A's base
    with that, failing a model trained at 500000 (Llama 3's) and passing one trained at 10000."""
    src = _with_config(gguf_model("llama"), tmp_path / "a", rope_theta=base)
    bad = _rewrite(gguf_ref("llama", "f32"), tmp_path / "b.gguf", drop=("llama.rope.freq_base",))
    r = run_cli("verify", src, bad, "--backend", "reference", "--no-load-check", ok=None)
    if base == 10000.0:
        assert r.exit_code == 0, r.output
    else:
        assert r.exit_code == 1, r.output
        assert "rope_theta: A 500000.0, B 10000.0 (no llama.rope.freq_base: llama.cpp's default)" in r.output


def test_chat_template_is_compared(gguf_model, gguf_ref, tmp_path):
    """The chat template llama.cpp formats a chat with (``tokenizer.chat_template``) is compared with A's: the
    same text passes; one with a default system prompt added, or none, fails naming it."""
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    src = tmp_path / "a"
    shutil.copytree(gguf_model("llama"), src)
    (src / "chat_template.jinja").write_text(template)
    ref = gguf_ref("llama", "f32")
    edited = "<|system|>You are a helpful assistant." + template
    for name, strings, fails in (("same", {"tokenizer.chat_template": template}, None),
                                 ("edited", {"tokenizer.chat_template": edited},
                                  "chat template 'default' differs from character 0 (tokenizer.chat_template)"),
                                 ("none", {}, "chat template 'default': only A has one (tokenizer.chat_template)")):
        b = _rewrite(ref, tmp_path / f"{name}.gguf", drop=("tokenizer.chat_template",), strings=strings)
        r = run_cli("verify", src, b, "--backend", "reference", "--no-load-check", ok=None)
        assert r.exit_code == (1 if fails else 0), (name, r.output)
        if fails:
            assert fails in r.output, r.output
