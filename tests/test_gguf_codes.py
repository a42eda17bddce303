"""A quantized checkpoint into GGUF from its stored codes (``converters/gguf/kept.py``): each weight in the GGUF
type that holds it bit for bit, checked against compressed-tensors' own decompression (the oracle), loaded and run
by llama.cpp, proven by verify (values exactly the source's codes), and planted defects failing; what no type
holds refused by default, named with the numbers, and with --requantize written as Q8_0 and said."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("compressed_tensors")

import ct_models  # noqa: E402
import gptq_models  # noqa: E402
from helpers import failed_ffns, once, run_cli, tree_digest  # noqa: E402

from ffn_tools.converters import open_any  # noqa: E402
from ffn_tools.converters.gguf.header import Reader  # noqa: E402
from ffn_tools.converters.gguf.reader import field_values  # noqa: E402
from ffn_tools.io.receipt import NAME as RECEIPT  # noqa: E402

VARIANTS = {  # name -> (weights arguments, the GGUF types that hold every block)
    "int4-g32-sym": (dict(bits=4, group_size=32, symmetric=True), {"Q4_0"}),
    "int4-g32-asym": (dict(bits=4, group_size=32, symmetric=False), {"Q4_1", "Q8_0"}),
    "int8-channel-sym": (dict(bits=8, strategy="channel", symmetric=True), {"Q8_0"}),
}
REFUSED = {"int8-g32-asym": dict(bits=8, group_size=32, symmetric=False),  # c - z spans 9 bits: no int8 holds it
           "int4-g16": dict(bits=4, group_size=16, symmetric=True)}  # a block of 32 would hold two scales


@pytest.fixture(scope="module")
def source(gguf_model, shared_dir):
    """``source(variant) -> (twin, compressed)``: a tiny compressed-tensors Llama written by compressed-tensors'
    own compressor, with the sentencepiece tokenizer llama.cpp's converter reads (``gguf_model``'s)."""
    tok = gguf_model("llama")

    def get(variant: str):
        def make(tmp):
            if variant in VARIANTS or variant in REFUSED:
                a = ct_models.args(**(VARIANTS[variant][0] if variant in VARIANTS else REFUSED[variant]))
                twin, q = ct_models.build("llama", tmp, {"g": (["Linear"], a)}, vocab_size=384)
            elif variant in ("nvfp4-ct", "nvfp4-modelopt"):  # rows of 64 and 128 values: GGUF's NVFP4 blocks
                twin, q = ct_models.build("llama", tmp, {"g": (["Linear"], ct_models.nvfp4_args())},
                                          fmt="nvfp4-pack-quantized", vocab_size=384, intermediate_size=128)
                if variant == "nvfp4-modelopt":  # compressed-tensors' own converter, inverted (ct_models)
                    q = ct_models.to_modelopt(q, tmp / "modelopt")
                    shutil.rmtree(tmp / "ct")
            elif variant == "fp8-blocks":  # DeepSeek-V3's FP8: weight_scale_inv per 16 x 16 block
                from test_fp8 import quantize_fp8

                twin = tmp / "twin"
                shutil.copytree(tok, twin)
                q = quantize_fp8(twin, tmp / "fp8")
            elif variant == "fp8":
                from compressed_tensors.quantization import QuantizationArgs

                a = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
                twin, q = ct_models.build("llama", tmp, {"g": (["Linear"], a)}, fmt="float-quantized", vocab_size=384)
            else:  # gptq, awq: their packers' layouts (gptq_models)
                twin, q, _ = gptq_models.build(variant, tmp, vocab_size=384)
            for d in (twin, q):
                for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
                    if (tok / f).exists():
                        shutil.copy(tok / f, d / f)
        made = once(shared_dir / f"gguf-codes-{variant}", make)
        return made / "twin", next(p for p in made.iterdir() if p.name != "twin")

    return get


def convert(src, out, *extra):
    r = run_cli("-q", "convert", src, "--to", "gguf", "-o", out, *extra, "--json")
    return json.loads(r.stdout)


def gguf_values(path) -> dict[str, torch.Tensor]:
    """Each Hugging Face weight of the GGUF as llama.cpp's blocks define it (our reader: gguf-py's dequantization)."""
    with open_any(path) as g:
        return {n: g[n].float() for n in g if n.endswith("_proj.weight")}


@pytest.mark.parametrize("variant", [*VARIANTS, "gptq", "awq"])
def test_codes_kept_bit_for_bit(source, tmp_path, variant):
    twin, src = source(variant)
    before = tree_digest(src)
    out = tmp_path / "q.gguf"
    r = convert(src, out)
    assert tree_digest(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["q.gguf", f"q.gguf.{RECEIPT}"]
    kept = [t for t in r["codes"] if t["action"] == "kept"]
    assert len(kept) == len(r["codes"]) == 14  # every quantized Linear
    assert all(t["blocks_exact"] == t["blocks"] > 0 for t in kept)
    types = {t["type"] for t in kept}
    assert types <= (VARIANTS[variant][1] if variant in VARIANTS else {"Q4_0", "Q4_1", "Q8_0"}), types
    assert any("kept the codes of 14 quantized tensors" in c for c in r["changes"])
    stored = {t.name: t.tensor_type.name for t in Reader(out, "r").tensors}
    assert stored["blk.0.ffn_gate.weight"] in types and field_values(Reader(out, "r"))["ffn_tools.codes.kept"]
    values = gguf_values(out)
    with open_any(src) as ckpt:  # GGUF's values are the codes' s * (c - z), before the source's own rounding
        for name, m in ckpt.modules.items():
            codes = m.scheme.int_codes(m, ckpt.quantized_parts(name))
            assert torch.equal(values[name], codes.values()), name
            if variant in VARIANTS:  # ... which rounds them as compressed-tensors' own decompression does
                oracle = ct_models.decompressed(src, name[: -len(".weight")])
                assert torch.equal(values[name].to(oracle.dtype).view(torch.int16), oracle.view(torch.int16)), name
    if variant in ("int8-channel-sym", "gptq"):  # their blocks are checked above; verify runs on the others
        return
    # llama.cpp loads it, every parameter; for the Q4_0 one also its logits against transformers' of the
    # compressed-tensors model (its own decompression), within the 4-bit row
    logits = ["--logits"] if variant == "int4-g32-sym" else []
    v = json.loads(run_cli("verify", src, out, "--backend", "reference", *logits, "--json").stdout)
    assert v["passed"] and v["load_check"]["ok"]
    assert [f["exact"] for f in v["ffns"]] == ["codes", "codes"] and v["outside"]["codes"] == 8
    if logits:
        assert v["logits"]["client_b"] == "llama.cpp" and v["logits"]["top1_agreement"] >= 0.9


def _block_bytes(path, name):
    t = next(t for t in Reader(path, "r").tensors if t.name == name)
    return int(t.data_offset), int(t.n_bytes), t.tensor_type.name


@pytest.fixture(scope="module")
def q4_0(source, shared_dir):
    """(source, its Q4_0 GGUF from the codes), converted once."""
    _, src = source("int4-g32-sym")
    return src, once(shared_dir / "gguf-codes-q4_0", lambda tmp: tmp.mkdir() or convert(src, tmp / "q.gguf")) / "q.gguf"


@pytest.mark.parametrize("defect", ["scale-shifted", "gate-up-swapped"])
def test_verify_fails_planted_defects(q4_0, tmp_path, defect):
    """A Q4_0 block's scale taken from the next block (4-bit tolerance rows pass that), gate and up swapped:
    verify fails the layer, saying B's values are not A's codes."""
    src, out = q4_0
    data = bytearray(out.read_bytes())
    g, n, qtype = _block_bytes(out, "blk.1.ffn_up.weight")
    assert qtype == "Q4_0"
    if defect == "scale-shifted":
        data[g:g + 2] = data[g + 18:g + 20]  # block 0's float16 d := block 1's
    else:
        u, m, _ = _block_bytes(out, "blk.1.ffn_gate.weight")
        data[g:g + n], data[u:u + n] = data[u:u + n], data[g:g + n]
    failed = failed_ffns(src, bytes(data), tmp_path)
    assert [f["ffn"] for f in failed] == ["layer 1"] and failed[0]["exact"] == "differs"
    assert "holds A's codes" in " ".join(failed[0]["problems"])


@pytest.mark.parametrize("variant,why", [("int4-g16", "groups of 16 columns"), ("fp8", "no GGUF type holds"),
                                         ("int8-g32-asym", "do not fit Q8_0"), ("fp8-blocks", "no GGUF type holds")])
def test_refused_naming_why(source, tmp_path, variant, why):
    """Weights no GGUF type holds exactly: refused before llama.cpp's converter starts, naming them, why and the
    ways on; nothing written."""
    _, src = source(variant)
    out = tmp_path / "q.gguf"
    r = run_cli("convert", src, "--to", "gguf", "-o", out, ok=False)
    assert why in r.output and "--requantize" in r.output and "14 of 14 quantized weights" in r.output
    assert "model.layers.0." in r.output and not list(tmp_path.iterdir())


@pytest.mark.parametrize("variant", ["int4-g16", "fp8-blocks"])
def test_requantized_when_asked(source, tmp_path, variant):
    """--requantize: those weights written as Q8_0 of their dequantized values, each said; the plan shows the
    refusal without it; llama.cpp loads the file and verify passes it against the source within its row."""
    _, src = source(variant)
    out = tmp_path / "q.gguf"
    if variant == "int4-g16":
        assert "groups of 16" in run_cli("convert", src, "--to", "gguf", "-o", out, "--dry-run", ok=False).output
    r = convert(src, out, "--requantize")
    assert {t["action"] for t in r["codes"]} == {"requantized"} and {t["type"] for t in r["codes"]} == {"Q8_0"}
    assert sum("re-quantized" in c and "(--requantize)" in c for c in r["changes"]) == 14
    assert "ffn_tools.codes.kept" not in field_values(Reader(out, "r"))
    if variant == "fp8-blocks":  # within the source's row: its quantization's error, and Q8_0's
        v = json.loads(run_cli("verify", src, out, "--backend", "reference", "--json").stdout)
        assert v["passed"] and v["load_check"]["ok"]


def test_requantize_and_explicit_outtypes(source, tmp_path):
    """--outtype bf16 writes a quantized input dequantized, as before (said); --requantize with it, or with an
    input that holds no quantized weights, is refused."""
    twin, src = source("int4-g32-sym")
    r = convert(src, tmp_path / "d.gguf", "--outtype", "bf16")
    assert "codes" not in r and any("dequantized" in c for c in r["changes"])
    assert {t.tensor_type.name for t in Reader(tmp_path / "d.gguf", "r").tensors} <= {"BF16", "F32"}
    r = run_cli("convert", src, "--to", "gguf", "-o", tmp_path / "x.gguf", "--outtype", "bf16", "--requantize",
                ok=False)
    assert "--requantize is for a quantized input written from its codes" in r.output
    r = run_cli("convert", twin, "--to", "gguf", "-o", tmp_path / "x.gguf", "--requantize", ok=False)
    assert "holds no quantized weights" in r.output


def test_q4_1_block_layout_is_gguf_pys():
    """The Q4_1 and Q8_0 blocks ``encode`` writes read back through gguf-py's own dequantization as the codes'
    values (an asymmetric 4-bit tensor whose -s*z are float16 numbers, and an 8-bit one)."""
    from gguf import GGMLQuantizationType, quants

    from ffn_tools.converters.gguf import kept
    from ffn_tools.quant import IntCodes

    g = torch.Generator().manual_seed(0)
    for bits, qtype in ((4, "Q4_1"), (4, "Q4_0"), (8, "Q8_0")):
        codes = torch.randint(0, 1 << bits, (8, 64), generator=g, dtype=torch.int16)
        zero = torch.full((8, 2), 1 << (bits - 1), dtype=torch.int16)
        if qtype == "Q4_1":
            zero = torch.randint(0, 16, (8, 2), generator=g, dtype=torch.int16)
        scale = (torch.rand(8, 2, generator=g) * 0.01 + 0.001).to(torch.float16).to(torch.float32)
        scale = scale.to(torch.bfloat16).to(torch.float32) if qtype == "Q4_1" else scale  # 8 bits: -s*z in fp16
        c = IntCodes(codes, zero, scale, 32, bits)
        choice = kept.choose(c)
        assert choice.qtype == qtype and choice.exact == choice.blocks == 16, choice
        blocks = kept.encode(c, qtype)
        back = quants.dequantize(blocks, getattr(GGMLQuantizationType, qtype)).reshape(8, 64)
        assert np.array_equal(back, c.values().numpy()), qtype


def test_mlx_4bit_kept_as_q4_1(gguf_model, tmp_path):
    """mlx_lm's 4-bit affine (scales and biases per 64 columns) goes in as Q4_1 (d = scale, m = bias), every block
    exact: llama.cpp runs it as mlx_lm runs the MLX model (verify --logits), every weight holding MLX's codes."""
    pytest.importorskip("mlx.core")
    mlx = tmp_path / "mlx"
    run_cli("-q", "convert", gguf_model("llama", torch.bfloat16), "--to", "mlx", "-o", mlx, "-q")
    out = tmp_path / "q.gguf"
    r = convert(mlx, out)  # bfloat16 scales and biases: float16 numbers (float32 ones, of a float32 model, are not)
    assert {(t["action"], t["type"]) for t in r["codes"]} == {("kept", "Q4_1")}
    assert all(t["blocks_exact"] == t["blocks"] for t in r["codes"])
    assert {"token_embd.weight", "output.weight"} <= {t["tensor"] for t in r["codes"]}  # mlx_lm quantizes them too
    v = json.loads(run_cli("verify", mlx, out, "--backend", "reference", "--logits", "--json").stdout)
    assert v["passed"] and v["logits"]["client_a"] == "mlx_lm" and v["logits"]["client_b"] == "llama.cpp"
    assert [f["exact"] for f in v["ffns"]] == ["codes", "codes"] and v["outside"]["codes"] == 10


def test_nvfp4_modelopt_kept_as_llama_cpps_own_repack(source, tmp_path):
    """ModelOpt NVFP4 goes in as GGUF NVFP4 blocks with each weight's scale_2 as its .scale: every tensor the bytes
    llama.cpp's own converter repacks from that checkpoint; verify holds them to the codes, llama.cpp runs them as
    transformers runs the dequantized source, and an inverted .scale fails."""
    from gguf_models import convert_reference

    _, src = source("nvfp4-modelopt")
    out = tmp_path / "q.gguf"
    r = convert(src, out)
    assert {(t["action"], t["type"]) for t in r["codes"]} == {("kept", "NVFP4")}
    assert all(t["blocks_exact"] == t["blocks"] for t in r["codes"])
    ref = convert_reference(src, tmp_path / "ref.gguf", "auto")
    ours, theirs = ({t.name: t for t in Reader(p, "r").tensors} for p in (out, ref))
    assert set(ours) == set(theirs) and sum(n.endswith(".scale") for n in ours) == 14
    assert all(ours[n].tensor_type == theirs[n].tensor_type and bytes(ours[n].data) == bytes(theirs[n].data)
               for n in ours)
    v = json.loads(run_cli("verify", src, out, "--backend", "reference", "--json").stdout)
    assert v["passed"] and [f["exact"] for f in v["ffns"]] == ["codes", "codes"] and v["outside"]["codes"] == 8
    deq = tmp_path / "deq"
    run_cli("-q", "convert", src, "--to", "torch", "-o", deq)
    v = json.loads(run_cli("verify", deq, out, "--backend", "reference", "--logits", "--json").stdout)
    assert v["passed"] and v["logits"]["client_b"] == "llama.cpp" and v["logits"]["cosine"] > 0.9999
    data = bytearray(out.read_bytes())
    at, n, _ = _block_bytes(out, "blk.1.ffn_up.scale")
    scale = np.frombuffer(bytes(data[at:at + 4]), np.float32)[0]
    data[at:at + 4] = np.float32(1 / scale).tobytes()  # the global scale inverted: the known mix-up
    failed = failed_ffns(src, bytes(data), tmp_path)
    assert [f["ffn"] for f in failed] == ["layer 1"] and "holds A's codes" in " ".join(failed[0]["problems"])


def test_nvfp4_compressed_tensors_global_scale_refused(source, tmp_path):
    """compressed-tensors divides by its global scale; llama.cpp multiplies by a .scale: not exact unless the
    reciprocal is a float32 number, so refused, saying so (--requantize: test_requantized_when_asked)."""
    _, src = source("nvfp4-ct")
    r = run_cli("convert", src, "--to", "gguf", "-o", tmp_path / "q.gguf", ok=False)
    assert "its reciprocal is not a float32 number" in r.output and "ModelOpt's scale_2" in r.output
    assert not list(tmp_path.iterdir())
