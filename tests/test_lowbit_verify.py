"""verify of low-bit checkpoints read at their own block and scale (#57 item 3): an FP8 checkpoint of 32 x 32 blocks
whose rows divide evenly over its scales (100 rows over 4 scales: 25 by division, 32 by its config) is verified
right, a defect is named at the block the checkpoint uses, and a B whose values were made reading the scales at
another block (128, a hard-coded size; 25, the division) fails."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import run_cli
from safetensors.torch import load_file, save_file

BLOCK = 32


def fp8_32(w: torch.Tensor, factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as F8_E4M3 codes and one scale per 32 x 32 block (a partial last block where the shape is not a
    multiple of 32), the blocks first scaled by ``factors`` (so neighbouring blocks' scales differ widely)."""
    r, c = w.shape
    rb, cb = -(-r // BLOCK), -(-c // BLOCK)
    f = factors[:rb, :cb].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:r, :c]
    x = w.float() * f
    pad = torch.zeros(rb * BLOCK, cb * BLOCK)
    pad[:r, :c] = x
    scale = pad.reshape(rb, BLOCK, cb, BLOCK).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:r, :c]
    return (x / full).to(torch.float8_e4m3fn), scale


def decoded(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek's ``weight_dequant`` read at ``block``: element (i, j) times ``scale[i // b0, j // b1]`` (an index
    past the scales clamped to the last, as a reader that assumes the block does)."""
    i = (torch.arange(codes.shape[0]) // block[0]).clamp(max=scale.shape[0] - 1)
    j = (torch.arange(codes.shape[1]) // block[1]).clamp(max=scale.shape[1] - 1)
    return codes.float() * scale[i][:, j]


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """A tiny Llama (hidden 64, intermediate 100, 1 layer) with every projection F8_E4M3 in 32 x 32 blocks, as
    DeepSeek V4.1 stores them (``weight_scale_inv``, ``weight_block_size: [32, 32]``)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=100, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("fp8-32") / "model"
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    out = {}
    for n, w in load_file(path / "model.safetensors").items():
        if not n.endswith("proj.weight"):
            out[n] = w
            continue
        factors = torch.exp2(torch.randint(-3, 4, (8, 8), generator=g).float())
        out[n], out[n + "_scale_inv"] = fp8_32(w, factors)
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((path / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [BLOCK, BLOCK]}
    (path / "config.json").write_text(json.dumps(c))
    return path


def _verify(a, b) -> dict:
    r = run_cli("verify", a, b, "--backend", "reference", "--no-load-check", "--json", ok=None)
    return json.loads(r.stdout)


def _problems(j: dict) -> list[str]:
    return [p for f in j["ffns"] for p in f["problems"]]


def _dequantized(src, dst, block):
    """``src``'s FP8 weights written as float32 values read at ``block`` (the config's quantization dropped)."""
    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    out = {n: t for n, t in w.items() if not n.endswith("_scale_inv")}
    for n in out:
        if n + "_scale_inv" in w:
            out[n] = decoded(w[n], w[n + "_scale_inv"], block)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((dst / "config.json").read_text())
    c.pop("quantization_config")
    c.update({k: "float32" for k in ("dtype", "torch_dtype") if k in c})
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_rows_that_divide_are_read_at_the_configs_block(fp8_model):
    """100 rows over 4 scales divide as 25, the config says 32: the scheme reads 32 (which the tests below rely on:
    a reader at 25 is the defect they plant)."""
    from ffn_tools import quant
    from ffn_tools.converters import open_any

    with open_any(fp8_model) as raw:
        c = quant.decoded(raw, every=True)
        m = c.quantized("model.layers.0.mlp.gate_proj.weight")
        assert m is not None and m.args.block == (BLOCK, BLOCK)
        assert tuple(raw.info(m.parts["scale"]).shape) == (4, 2)
        w = load_file(fp8_model / "model.safetensors")
        want = decoded(w[m.weight], w[m.parts["scale"]], (BLOCK, BLOCK))
        assert torch.equal(c[m.weight].float(), want)
        assert not torch.equal(want, decoded(w[m.weight], w[m.parts["scale"]], (25, 32)))


def test_values_read_at_the_right_block_verify(fp8_model, tmp_path):
    j = _verify(fp8_model, _dequantized(fp8_model, tmp_path / "f32", (BLOCK, BLOCK)))
    assert j["passed"], json.dumps({k: v for k, v in j.items() if k != "ffns"})[:3000]


@pytest.mark.parametrize("block", [(128, 128), (25, 25)])
def test_values_read_at_another_block_fail(fp8_model, tmp_path, block):
    """The issue's "a block size read as 128 when it is 32" (and the division's 25): B's values are A's codes
    times the wrong blocks' scales, which verify finds beyond FP8's row."""
    j = _verify(fp8_model, _dequantized(fp8_model, tmp_path / "wrong", block))
    (f,) = j["ffns"]
    assert not j["passed"] and not f["passed"] and f["backends"][0]["cosine"] < 0.99
    assert f["exact"] != "requantized", f  # it claimed "A's codes re-derived, every one" of these wrong values


@pytest.mark.parametrize("name,index,where", [
    ("model.layers.0.mlp.gate_proj.weight_scale_inv", (1, 0), "rows 32-63, columns 0-31"),
    ("model.layers.0.mlp.down_proj.weight_scale_inv", (1, 2), "rows 32-63, columns 64-95"),
    ("model.layers.0.mlp.down_proj.weight_scale_inv", (1, 3), "rows 32-63, columns 96-99"),  # the partial block
])
def test_a_scale_under_kept_codes_is_named_at_its_block(fp8_model, tmp_path, name, index, where):
    """B keeps A's codes with one block's scale doubled: verify names that block's rows and columns as the
    checkpoint's 32 x 32 blocks lie (it said rows 25-49 of a 100-row weight: its block inferred by division)."""
    b = tmp_path / "b"
    shutil.copytree(fp8_model, b)
    w = load_file(b / "model.safetensors")
    w[name] = w[name].clone()
    w[name][index] *= 2
    save_file(w, b / "model.safetensors", metadata={"format": "pt"})
    j = _verify(fp8_model, b)
    assert not j["passed"]
    said = [p for p in _problems(j) + [d for f in j["ffns"] for d in f.get("notes", [])] if "codes are A's" in p]
    text = json.dumps(j)
    assert f"block {list(index)} ({where})" in text, (said, text[:3000])


# --- codes kept into MLX, recorded (ffn_tools.codes.kept) and proved exactly by verify ---

def _mlx_edit(path, name, fn):
    """``path``'s MLX tensor ``name`` replaced by ``fn`` of it (numpy), in whichever shard holds it."""
    import mlx.core as mx
    import numpy as np

    for f in path.glob("*.safetensors"):
        arrays, meta = mx.load(str(f), return_metadata=True)
        if name in arrays:
            arrays[name] = mx.array(fn(np.array(arrays[name])))
            mx.save_safetensors(str(f), arrays, metadata=meta)
            return
    raise KeyError(name)


@pytest.fixture(scope="module")
def fp8_mlx(model_dir, tmp_path_factory):
    """A tiny bf16 Llama's projections as FP8 32 x 32 blocks of power-of-two scales, and its MLX export (mxfp8,
    codes kept): (source, output, the export's summary)."""
    pytest.importorskip("mlx_lm")
    from test_lowbit_mlx import fp8_blocks

    base = tmp_path_factory.mktemp("fp8-mlx")
    src = fp8_blocks(model_dir("llama", torch.bfloat16), base / "fp8", True)
    out = base / "mlx"
    r = json.loads(run_cli("-q", "convert", src, "--to", "mlx", "-o", out, "--json").stdout)
    return src, out, r


def test_fp8_kept_as_mxfp8_is_said_truthfully(fp8_mlx):
    """Every FP8 weight's codes kept as mxfp8: the summary says so, and no line says they were dequantized (it
    said "dequantized 14 F8_E4M3 weights" beside "kept the codes of 14 FP8 weights")."""
    _, _, r = fp8_mlx
    assert any(c.startswith("kept the codes of 14 FP8 weights") for c in r["changes"]), r["changes"]
    assert not any(c.startswith("dequantized") for c in r["changes"]), r["changes"]


def test_fp8_not_all_kept_says_which_and_why(model_dir, tmp_path):
    """One FP8 weight whose scales are not powers of two: it alone is said dequantized, naming it and why."""
    pytest.importorskip("mlx_lm")
    from test_lowbit_mlx import fp8_blocks

    src = fp8_blocks(model_dir("llama", torch.bfloat16), tmp_path / "fp8", True)
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    w = load_file(src / "model.safetensors")
    w[name] = w[name] * 1.5
    save_file(w, src / "model.safetensors", metadata={"format": "pt"})
    r = json.loads(run_cli("-q", "convert", src, "--to", "mlx", "-o", tmp_path / "mlx", "--json").stdout)
    assert any(c.startswith("kept the codes of 13 FP8 weights") for c in r["changes"]), r["changes"]
    (line,) = [c for c in r["changes"] if c.startswith("dequantized")]
    assert line.startswith("dequantized 1 F8_E4M3 weight (times their _scale_inv) to float32") and \
        "not all powers of two" in line and line.endswith("model.layers.1.mlp.up_proj.weight"), line


def test_fp8_mxfp8_codes_are_recorded_and_proved_exactly(fp8_mlx):
    _, out, _ = fp8_mlx
    from safetensors import safe_open

    from ffn_tools.verification.kept import KEPT_KEY

    (f,) = out.glob("*.safetensors")
    with safe_open(f, "np") as s:
        kept = json.loads(s.metadata()[KEPT_KEY])
    assert len(kept) == 14 and "model.layers.0.mlp.gate_proj.weight" in kept
    src = fp8_mlx[0]
    j = _verify(src, out)
    assert j["passed"], j["failures"]
    assert {f["exact"] for f in j["ffns"]} == {"codes"}, [f["notes"] for f in j["ffns"]]
    assert j["outside"]["codes"] == 8  # the attention projections, two layers


@pytest.mark.parametrize("defect", ["doubled", "reciprocal"])
def test_fp8_mxfp8_scale_defect_fails(fp8_mlx, tmp_path, defect):
    """One group's E8M0 exponent one higher (its scale doubled), or every exponent read as the scale's reciprocal:
    verify's kept-codes check fails naming the tensor (a 3-bit FP8 row might pass the first)."""
    src, out, _ = fp8_mlx
    b = tmp_path / "b"
    shutil.copytree(out, b)

    def edit(e):
        e = e.copy()
        if defect == "doubled":
            e[3, 1] += 1
            return e
        return (254 - e.astype("int32")).astype(e.dtype)

    _mlx_edit(b, "model.layers.1.mlp.down_proj.scales", edit)
    j = _verify(src, b)
    bad = {f["ffn"]: f for f in j["ffns"]}["layer 1"]
    assert not j["passed"] and bad["exact"] == "differs", bad
    assert "ffn_tools.codes.kept" in bad["problems"][0] and "down" in bad["problems"][0], bad["problems"]


@pytest.fixture(scope="module")
def gguf_mlx(tmp_path_factory, request):
    """``gguf_mlx(ftype) -> (source GGUF, its MLX export)``: llama-quantize's Q8_0/Q4_0 tiny Llama kept as MLX
    affine (``test_lowbit_gguf``'s file), one export per type."""
    pytest.importorskip("mlx_lm")
    quantized = request.getfixturevalue("quantized")
    made: dict = {}

    def get(ftype: str):
        if ftype not in made:
            src, out = quantized(ftype), tmp_path_factory.mktemp(f"gguf-mlx-{ftype}") / "mlx"
            run_cli("-q", "convert", src, "--to", "mlx", "-o", out)
            made[ftype] = src, out
        return made[ftype]
    return get


from test_lowbit_gguf import quantized  # noqa: E402,F401  (the fixture: llama-quantize's files of a tiny Llama)


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_0"])
def test_gguf_codes_in_mlx_are_proved_exactly(gguf_mlx, ftype):
    src, out = gguf_mlx(ftype)
    j = _verify(src, out)
    assert j["passed"], j["failures"]
    assert {f["exact"] for f in j["ffns"]} == {"codes"}, [(f["exact"], f["notes"]) for f in j["ffns"]]


@pytest.mark.parametrize("defect", ["doubled", "reciprocal"])
def test_gguf_codes_in_mlx_scale_defect_fails(gguf_mlx, tmp_path, defect):
    """A Q4_0 block's scale doubled in B (its bias left: the codes' zero point moves too, as a writer that scaled
    one group would), or every scale read as its reciprocal: the kept-codes check fails naming the tensor."""
    import numpy as np

    src, out = gguf_mlx("Q4_0")
    b = tmp_path / "b"
    shutil.copytree(out, b)

    def edit(s):
        s = s.copy()
        if defect == "doubled":
            s[5, 2] *= 2
            return s
        return np.float32(1) / s

    _mlx_edit(b, "model.layers.1.mlp.up_proj.scales", edit)
    j = _verify(src, b)
    bad = {f["ffn"]: f for f in j["ffns"]}["layer 1"]
    assert not j["passed"] and bad["exact"] == "differs", bad
    assert "ffn_tools.codes.kept" in bad["problems"][0] and "up" in bad["problems"][0], bad["problems"]


# --- NVFP4: a fused gate_up with one ModelOpt global scale per half (weight_scale_2 of two values) ---

@pytest.fixture(scope="module")
def nvfp4_halves(tmp_path_factory):
    """(A, B): a tiny Phi-3 (fused gate_up_proj) in bfloat16 whose up rows are doubled, and its ModelOpt NVFP4
    twin whose gate_up keeps the codes of the model before doubling under ``weight_scale_2 = [g, 2 g]``, so each
    half is read with its own global scale (B's up is A's up quantized, every code)."""
    import ct_models

    path = tmp_path_factory.mktemp("nvfp4-halves")
    twin, ct = ct_models.build("phi3", path, {"g": (["Linear"], ct_models.nvfp4_args())}, fmt="nvfp4-pack-quantized")
    mo = ct_models.to_modelopt(ct, path / "modelopt")
    w = load_file(mo / "model.safetensors")
    t = load_file(twin / "model.safetensors")
    fused = [k[: -len(".weight")] for k in t if k.endswith("gate_up_proj.weight")]
    assert fused
    for base in fused:
        g = w[base + ".weight_scale_2"].reshape(-1)[0]
        w[base + ".weight_scale_2"] = torch.stack([g, 2 * g]).to(torch.float32)
        rows = t[base + ".weight"].shape[0]
        t[base + ".weight"] = t[base + ".weight"].clone()
        t[base + ".weight"][rows // 2:] *= 2  # exact in bfloat16
    save_file(w, mo / "model.safetensors", metadata={"format": "pt"})
    save_file(t, twin / "model.safetensors", metadata={"format": "pt"})
    return twin, mo, fused


def test_nvfp4_global_scale_per_half_is_read_per_half(nvfp4_halves):
    """Each half of the fused gate_up is read with its own global scale: B's up is exactly twice what one global
    scale would give, and verify passes B against A (its codes A's weights re-quantized, every one)."""
    from ffn_tools import quant
    from ffn_tools.converters import open_any
    from ffn_tools.quant import nvfp4

    a, b, fused = nvfp4_halves
    with open_any(b) as raw:
        c = quant.decoded(raw)
        name = fused[0] + ".weight"
        m = c.quantized(name)
        assert m is not None and m.scheme.name == "nvfp4-modelopt"
        parts = c.quantized_parts(name)
        one = nvfp4.dequantize(nvfp4.unpack(parts["weight"]), parts["weight_scale"],
                               parts["weight_scale_2"][:1], True)
        got, rows = c[name], one.shape[0]
        assert torch.equal(got[: rows // 2], one[: rows // 2])
        assert torch.equal(got[rows // 2:].float(), one[rows // 2:].float() * 2)
    j = _verify(a, b)
    assert j["passed"], j["failures"]


def test_nvfp4_a_halfs_global_scale_swapped_fails(nvfp4_halves, tmp_path):
    """The issue's "a half's global scale swapped": [2 g, g] fails verify, naming the FFN."""
    a, b, fused = nvfp4_halves
    bad = tmp_path / "swapped"
    shutil.copytree(b, bad)
    w = load_file(bad / "model.safetensors")
    k = fused[1 % len(fused)] + ".weight_scale_2"
    w[k] = w[k].flip(0).contiguous()
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    j = _verify(a, bad)
    assert not j["passed"]
    assert any(not f["passed"] for f in j["ffns"]), j["failures"]


def test_nvfp4_per_half_scale_refused_by_gguf_saying_why(nvfp4_halves):
    from ffn_tools import quant
    from ffn_tools.converters import open_any

    _, b, fused = nvfp4_halves
    with open_any(b) as raw:
        c = quant.decoded(raw)
        name = fused[0] + ".weight"
        m = c.quantized(name)
        codes = m.scheme.fp4_codes(m, c.quantized_parts(name))
        assert codes.multiplier is None and "one global scale per half" in codes.why


def test_nvfp4_per_half_scales_split_each_to_its_half(nvfp4_halves, tmp_path):
    """split-gateup gives gate the first global scale and up the second (each half keeping the whole pair would
    read gate's rows as two halves), and the split verifies against A."""
    a, b, fused = nvfp4_halves
    out = tmp_path / "split"
    run_cli("split-gateup", b, "-o", out)
    w = load_file(b / "model.safetensors")
    s = load_file(out / "model.safetensors")
    base = fused[0].removesuffix("gate_up_proj")
    g2 = w[fused[0] + ".weight_scale_2"]
    assert torch.equal(s[base + "gate_proj.weight_scale_2"].reshape(-1), g2[:1])
    assert torch.equal(s[base + "up_proj.weight_scale_2"].reshape(-1), g2[1:])
    j = _verify(a, out)
    assert j["passed"], j["failures"]


def test_fuse_of_partial_fp8_blocks_is_refused(fp8_model, tmp_path):
    """Gate and up of 100 rows in 32-row blocks (a partial last block each) fused would put up's first rows inside
    gate's last block: no exact fuse of the scales exists, and it is refused naming the config's block (it wrote
    200 rows over 8 scales, which a reader takes as blocks of 25)."""
    r = run_cli("fuse-gateup", fp8_model, "-o", tmp_path / "fused", ok=False)
    assert "weight_block_size [32, 32]" in r.output and "no exact fuse" in r.output, r.output
    assert not (tmp_path / "fused").exists()
