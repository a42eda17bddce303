"""FP8 block-scaled checkpoints (DeepSeek-V3 / Qwen3-FP8 style: F8_E4M3 weights beside weight_scale_inv per
block) and per-row scaled ones (compressed-tensors' weight_scale), quantized here with torch alone from a
transformers twin: scales travel with their weights through split, fuse and extract, bit for bit, and verify
dequantizes both sides."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import run_cli, tensors
from safetensors.torch import load_file, save_file

from ffn_tools.gateup import fuse_gateup, split_gateup

BLOCK = 16  # tiny models: d_model 64, d_ffn 96, expert d_ffn 48 are multiples of it


def quantize_fp8(src, dst, block: int | None = BLOCK):
    """``src`` with every 2-D projection weight as F8_E4M3 and its scale: ``weight_scale_inv`` per ``block`` x
    ``block`` (amax / 448, as DeepSeek-V3's), or ``weight_scale`` per row when ``block`` is None."""
    out = {}
    for name, w in load_file(src / "model.safetensors").items():
        if not name.endswith("proj.weight") or w.dim() != 2:
            out[name] = w
            continue
        r, c = w.shape
        if block is None:
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448
            out[name], out[name + "_scale"] = (w / scale).to(torch.float8_e4m3fn), scale.float()
            continue
        blocks = w.reshape(r // block, block, c // block, block)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
        out[name] = (blocks / scale[:, None, :, None]).reshape(r, c).to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale.float()
    dst.mkdir(parents=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     **({"weight_block_size": [block, block]} if block else {})}
    (dst / "config.json").write_text(json.dumps(config))
    for side in src.iterdir():  # tokenizer, generation_config: a quantizer keeps them
        if side.suffix not in (".safetensors", ".json") or side.name == "generation_config.json":
            shutil.copy(side, dst / side.name)
    return dst


def raw_identical(a, b) -> None:
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    for n in ta:
        assert ta[n].dtype == tb[n].dtype and torch.equal(ta[n].view(torch.uint8), tb[n].view(torch.uint8)), n


@pytest.mark.parametrize("arch, block", [("phi3", BLOCK), ("llama", BLOCK), ("llama", None), ("qwen3_moe", BLOCK)])
def test_scales_travel_with_their_weights(arch, block, model_dir, tmp_path):
    q = quantize_fp8(model_dir(arch), tmp_path / "q", block)
    s = json.loads(run_cli("inspect", q, "--json").stdout)
    assert not s["unmatched_ffn_like"] and s["quantized"][0]["dtype"] == "F8_E4M3"
    assert s["quantized"][0]["block"] == ([BLOCK, BLOCK] if block else [1, 64])
    if arch == "phi3":  # fused: split, then fuse back
        split_gateup(q, tmp_path / "a")
        fuse_gateup(tmp_path / "a", tmp_path / "b")
        raw_identical(q, tmp_path / "b")
        assert "model.layers.0.mlp.gate_proj.weight_scale_inv" in tensors(tmp_path / "a")
    else:  # separate: fuse (experts stacked for MoE), then split back
        fuse_gateup(q, tmp_path / "a", stack_experts=arch == "qwen3_moe")
        split_gateup(tmp_path / "a", tmp_path / "b")
        raw_identical(q, tmp_path / "b")
    run_cli("extract", q, "-o", tmp_path / "x")
    run_cli("extract", tmp_path / "a", "-o", tmp_path / "y")
    raw_identical(tmp_path / "x", tmp_path / "y")
    assert any(n.endswith("gate.weight_scale" + ("_inv" if block else "")) for n in tensors(tmp_path / "x"))


@pytest.mark.parametrize("arch", ["phi3", "qwen3_moe"])
def test_verify_dequantizes_and_catches_a_swap(arch, model_dir, tmp_path):
    twin = model_dir(arch)
    q = quantize_fp8(twin, tmp_path / "q")
    r = run_cli("verify", twin, q, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    fused = tmp_path / "f"
    (split_gateup if arch == "phi3" else fuse_gateup)(q, fused)
    r = run_cli("verify", q, fused, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    sep = fused if arch == "phi3" else q
    bad = tmp_path / "bad"
    shutil.copytree(sep, bad)
    w = load_file(bad / "model.safetensors")
    p = "model.layers.1.mlp." + ("" if arch == "phi3" else "experts.0.")
    for suffix in ("", "_scale_inv"):
        g, u = f"{p}gate_proj.weight{suffix}", f"{p}up_proj.weight{suffix}"
        w[g], w[u] = w[u], w[g]
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    r = run_cli("verify", q, bad, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1 and "FAIL" in r.output, r.output


def test_a_scale_that_cannot_be_split_exactly_is_refused(model_dir, tmp_path):
    q = quantize_fp8(model_dir("phi3"), tmp_path / "q")
    r = run_cli("split-gateup", q, "-o", tmp_path / "out", "--layout", "interleaved", ok=False)
    assert "no exact split of the scale exists" in r.output and not (tmp_path / "out").exists()


def test_fp8_to_mlx_dequantizes_where_mlx_lm_has_no_fp8_form(model_dir, tmp_path):
    pytest.importorskip("mlx_lm")
    from ffn_tools.converters import convert

    q = quantize_fp8(model_dir("phi3"), tmp_path / "q")
    summary = convert(q, "mlx", tmp_path / "mlx")
    assert any(c.startswith("dequantized 8 F8_E4M3 weights") for c in summary["changes"])
    r = run_cli("verify", q, tmp_path / "mlx", "--backend", "reference", ok=None)  # loads in mlx_lm, same values
    assert r.exit_code == 0 and "PASS" in r.output and "loads in mlx_lm" in r.output, r.output


def test_fp8_deepseek_v3_to_mlx_is_what_mlx_lm_convert_writes(tmp_path):
    """mlx_lm's DeepSeek-V3 sanitize dequantizes weight_scale_inv (128 x 128 blocks) itself: the export runs it."""
    mlx_lm = pytest.importorskip("mlx_lm")
    import contextlib
    import io

    import zoo
    from helpers import assert_identical, write_tokenizer

    from ffn_tools.converters import convert

    src = tmp_path / "ds"
    zoo.build("deepseek_v3", src, keep=("attention_bias", "mlp_bias", "tie_word_embeddings"),
              extra={"n_group": 1, "topk_group": 1})
    write_tokenizer(src, 160)
    out = {}
    for k, w in load_file(src / "model.safetensors").items():  # one 128 x 128 block covers a tiny weight
        if k.endswith("proj.weight") and w.dim() == 2 and "kv_b_proj" not in k:
            scale = w.abs().amax().clamp(min=1e-12).reshape(1, 1) / 448
            out[k], out[k + "_scale_inv"] = (w / scale).to(torch.float8_e4m3fn), scale.float()
        else:
            out[k] = w
    save_file(out, src / "model.safetensors", metadata={"format": "pt"})
    convert(src, "mlx", tmp_path / "mine")
    ref = tmp_path / "ref-src"
    shutil.copytree(src, ref)
    (ref / "config.json").write_text((tmp_path / "mine" / "config.json").read_text())  # the keys export added
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm.convert(str(ref), str(tmp_path / "theirs"))
    assert_identical(tensors(tmp_path / "mine"), tensors(tmp_path / "theirs"))
    mlx_lm.load(str(tmp_path / "mine"))


def test_the_load_check_applies_transformers_fp8_quantizer(model_dir, tmp_path):
    """issue 37 item 9: a correct FP8 block-scaled checkpoint (quant_method fp8, weight_block_size, weight_scale_inv
    beside each weight) loads in transformers through its FP8 quantizer: the load check applies it as
    from_pretrained does, so the scales are the quantizer's parameters, not 14 unexpected tensors."""
    pytest.importorskip("accelerate")
    twin = model_dir("llama")
    q = quantize_fp8(twin, tmp_path / "q")
    r = run_cli("verify", twin, q, "--backend", "reference", ok=None)
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    assert "loads in transformers (LlamaForCausalLM, fp8 quantizer): every parameter provided" in r.output
    bad = tmp_path / "bad"  # a scale under a name the quantizer does not read is still caught
    shutil.copytree(q, bad)
    w = load_file(bad / "model.safetensors")
    w["model.layers.0.mlp.down_proj.weight_scale_x"] = w.pop("model.layers.0.mlp.down_proj.weight_scale_inv")
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    r = run_cli("verify", twin, bad, "--backend", "reference", ok=None)
    assert r.exit_code == 1 and "weight_scale_x" in r.output, r.output


def _verify_json(a, b) -> dict:
    r = run_cli("verify", a, b, "--backend", "reference", "--no-load-check", "--json", ok=None)
    return json.loads(r.stdout)


@pytest.mark.parametrize("arch", ["qwen3_moe", "phi3"])
def test_a_copy_of_fp8_codes_is_compared_as_stored_bytes_not_dequantized(arch, model_dir, tmp_path, monkeypatch):
    from ffn_tools.quant.fp8 import Fp8Blocks

    q = quantize_fp8(model_dir(arch), tmp_path / "q")
    other = tmp_path / "other"
    (split_gateup if arch == "phi3" else fuse_gateup)(q, other)
    decoded: list[str] = []
    decode = Fp8Blocks.decode
    monkeypatch.setattr(Fp8Blocks, "decode", lambda self, m, parts: decoded.append(m.weight) or decode(self, m, parts))
    for a, b in ((q, other), (other, q)):  # fused against separate, both ways round
        decoded.clear()
        j = _verify_json(a, b)
        ffns = j["ffns"]
        assert all(f["exact"] == "identical" for f in ffns), [(f["ffn"], f["exact"]) for f in ffns]
        assert any("byte for byte: compared as stored bytes" in n for n in j["notes"]), j["notes"]
        mlp = sorted({n for n in decoded if ".mlp." in n})
        first = "model.layers.0.mlp." + ("experts.0." if arch == "qwen3_moe" else "")
        assert mlp and all(n.startswith(first) for n in mlp), mlp  # only the first FFN of its kind is run
        skipped = [f for f in ffns if f["backends"][0]["path"].startswith("not computed")]
        assert len(skipped) == len(ffns) - 1
        assert j["outside"]["within_tolerance"] == 0 and j["outside"]["identical"] > 0  # attention: as bytes too
        assert not [n for n in decoded if ".self_attn." in n]


def test_an_fp8_tensor_outside_the_ffns_whose_bytes_differ_is_compared_dequantized(model_dir, tmp_path):
    q = quantize_fp8(model_dir("llama"), tmp_path / "q")
    b = tmp_path / "b"
    shutil.copytree(q, b)
    w = load_file(b / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    codes = "model.layers.1.self_attn.o_proj.weight"
    stepped = w[codes].view(torch.uint8).clone()
    stepped[0, 0] ^= 1  # one code a step off, its scale kept: a re-quantization's rounding
    w[codes] = stepped.view(torch.float8_e4m3fn)
    save_file(w, b / "model.safetensors", metadata={"format": "pt"})
    out = _verify_json(q, b)["outside"]
    assert out["within_tolerance"] == 1 and out["passed"]
    w = load_file(q / "model.safetensors")  # A's codes kept, one scale x1.001: no re-quantization does that
    w[name] = w[name] * 1.001
    save_file(w, b / "model.safetensors", metadata={"format": "pt"})
    out = _verify_json(q, b)["outside"]
    assert not out["passed"] and any(d.startswith("model.layers.1.self_attn.o_proj.weight: B's codes are A's byte "
                                                  f"for byte but its scale {name} is not A's") for d in out["differ"]), out


def test_fp8_stored_bytes_that_differ_are_named_and_compared_dequantized(model_dir, tmp_path):
    q = quantize_fp8(model_dir("qwen3_moe"), tmp_path / "q")
    fused = tmp_path / "f"
    fuse_gateup(q, fused)
    w = load_file(fused / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.gate_up_proj.weight"
    codes = w[name].view(torch.uint8).clone()
    codes[0, 0] ^= 1  # one code a step off, its scale kept (a re-quantization's rounding): not A's bytes
    w[name] = codes.view(torch.float8_e4m3fn)
    save_file(w, fused / "model.safetensors", metadata={"format": "pt"})
    j = _verify_json(q, fused)
    by = {f["ffn"]: f for f in j["ffns"]}
    bad = by["layer 1 expert 2"]
    assert bad["exact"] != "identical" and not bad["backends"][0]["path"].startswith("not computed")
    assert any("stored bytes differ (gate's weight (" + name in n for n in bad["notes"]), bad["notes"]
    assert bad["passed"] and not bad["problems"], bad
    assert sum(f["exact"] == "identical" for f in j["ffns"]) == len(j["ffns"]) - 1


@pytest.mark.parametrize("a, bit", [("separate", 1 << 13), ("fused", 1 << 13), ("separate", 2 << 23)])
def test_a_scale_changed_under_a_copy_of_its_codes_fails_naming_its_block(a, bit, model_dir, tmp_path):
    """issue 60 item 9: one exponent bit of one block's scale (x4, at DeepSeek-V3's sizes) under codes that are A's
    byte for byte passed as "stored bytes differ: compared dequantized, within the tolerance row" (here, where one
    block is a larger share of a tiny expert, a mantissa bit, x1.0006, does). A re-quantization that changes a
    scale changes its block's codes: this is a defect, named by tensor and block, whichever form A stores."""
    q = quantize_fp8(model_dir("qwen3_moe"), tmp_path / "q")
    fused = tmp_path / "f"
    fuse_gateup(q, fused)
    w = load_file(fused / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.gate_up_proj.weight_scale_inv"  # (6, 4): gate's row blocks 0-2, up's 3-5
    bits = w[name].view(torch.int32).clone()
    bits[4, 1] += bit  # 1 << 13: a mantissa bit; 2 << 23: exponent + 2, the block's scale x4
    w[name] = bits.view(torch.float32)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in fused.iterdir():
        shutil.copy(f, bad / f.name)
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    r = run_cli("verify", q if a == "separate" else fused, bad, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1 and "FAIL" in r.output, r.output
    line = (f"up: B's codes are A's byte for byte but its scale {name} is not A's at 1 of 12 blocks, first block "
            "[4, 1] (rows 64-79, columns 16-31)" if a == "separate" else
            f"gate_up: B's codes are A's byte for byte but its scale {name} is not A's at 1 of 24 blocks, first "
            "block [4, 1] (rows 64-79, columns 16-31)")
    assert line in " ".join(r.output.split()), r.output
    assert "a defect, not rounding" in " ".join(r.output.split())


def test_a_nonfinite_fp8_code_in_both_is_still_run_and_named(model_dir, tmp_path):
    q = quantize_fp8(model_dir("qwen3_moe"), tmp_path / "q")
    w = load_file(q / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    codes = w[name].view(torch.uint8).clone()
    codes[0, 0] = 0x7F  # E4M3FN's NaN
    w[name] = codes.view(torch.float8_e4m3fn)
    save_file(w, q / "model.safetensors", metadata={"format": "pt"})
    fused = tmp_path / "f"
    fuse_gateup(q, fused)
    j = _verify_json(q, fused)
    bad = {f["ffn"]: f for f in j["ffns"]}["layer 1 expert 3"]
    assert bad["exact"] == "identical"  # the same bytes on both sides ...
    assert not bad["backends"][0]["path"].startswith("not computed") and not bad["passed"]  # ... but not finite: run and failed


def test_verify_of_an_fp8_checkpoint_passes_on_its_own_bfloat16_config(model_dir, tmp_path):
    """issue 60 item 8: DeepSeek-V3's config says bfloat16 over FP8 weights; verify counted the weights by their
    dequantized (float32) view and failed even ``verify A A``. Unquantized weights stored in another dtype than the
    config's are still named."""
    q = quantize_fp8(model_dir("llama", torch.bfloat16), tmp_path / "q")
    assert json.loads((q / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    r = run_cli("verify", q, q, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 0 and "PASS" in r.output and "stored in float32" not in r.output, r.output
    wide = tmp_path / "wide"
    shutil.copytree(q, wide)
    w = load_file(wide / "model.safetensors")
    save_file({k: v.float() if v.dtype == torch.bfloat16 else v for k, v in w.items()}, wide / "model.safetensors",
              metadata={"format": "pt"})
    r = run_cli("verify", q, wide, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1 and "B's config.json says bfloat16, but its weights are stored in float32" in r.output


def _transformers_state(path, dtype=None) -> dict:
    """What transformers' from_pretrained holds after loading ``path`` (an FP8 one through its quantizer: on a
    machine without a GPU it dequantizes, with its own formula)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fp8_to_torch_keeps_the_quantization_config_its_codes_need(model_dir, tmp_path):
    """issue 60 item 24: convert --to torch kept the FP8 codes and scales but dropped quantization_config, so
    transformers loaded the codes as weights (values up to 448) with exit 0. The config travels with the codes:
    transformers reads the output as it reads the input."""
    pytest.importorskip("accelerate")
    from ffn_tools.converters import convert

    q = quantize_fp8(model_dir("llama", torch.bfloat16), tmp_path / "q")
    summary = convert(q, "torch", tmp_path / "out")
    raw_identical(q, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((q / "config.json").read_text())["quantization_config"]
    assert any(c.startswith("kept 14 F8_E4M3 weights as stored, with their _scale_inv (config.json's "
                            "quantization_config (fp8) kept") for c in summary["changes"]), summary["changes"]
    theirs, ours = _transformers_state(q), _transformers_state(tmp_path / "out")
    assert sorted(theirs) == sorted(ours)
    for k in theirs:
        assert torch.equal(theirs[k], ours[k]), k
    assert float(ours["model.layers.0.mlp.gate_proj.weight"].float().abs().max()) < 1  # values, not codes


def test_fp8_to_torch_with_a_dtype_dequantizes_as_transformers_does(model_dir, tmp_path):
    """issue 60 item 24: ``--dtype bfloat16`` cast the codes to bfloat16 without their scales. It dequantizes
    (codes times their block's scale in float32, rounded once: DeepSeek's fp8_cast_bf16.py), drops the scales
    and the quantization config: bit for bit what transformers' own FP8 dequantize loads from the input."""
    pytest.importorskip("accelerate")
    q = quantize_fp8(model_dir("llama", torch.bfloat16), tmp_path / "q")
    out = tmp_path / "out"
    r = run_cli("convert", q, "--to", "torch", "-o", out, "--dtype", "bfloat16")
    assert "dequantized 14 F8_E4M3 weights to bfloat16 (--dtype): each code times its _scale_inv per 16x16 block" \
        in " ".join(r.output.split()), r.output
    written = tensors(out)
    assert not [n for n in written if n.endswith("_scale_inv")]
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    theirs = _transformers_state(q, torch.bfloat16)  # transformers' FP8 reader, dequantizing on this CPU
    ours = _transformers_state(out)
    assert sorted(theirs) == sorted(ours)
    for k in theirs:
        assert theirs[k].dtype == ours[k].dtype and torch.equal(theirs[k], ours[k]), k
    r = run_cli("verify", q, out, "--backend", "reference", ok=None)
    assert r.exit_code == 0 and "PASS" in r.output, r.output


def test_fp8_decode_runs_in_strips_of_row_blocks_bit_for_bit(monkeypatch):
    """issue 60 item 10: a DeepSeek-V3 dense FFN's 18432 x 7168 FP8 weight was dequantized whole in float64 (3 GB
    held for a 0.5 GB float32 result); it is made a strip of row blocks at a time in float32, the same bits as
    the float64 product rounded once (exact: at most 24 + 24 significant bits)."""
    from ffn_tools.quant import fp8

    gen = torch.Generator().manual_seed(0)
    strips: list[tuple[int, int]] = []
    mul = torch.mul
    monkeypatch.setattr(fp8, "DECODE_BYTES", 4 * 64 * 32)  # 32 rows of 64 float32 columns a strip
    monkeypatch.setattr(torch, "mul", lambda a, b, out: strips.append(tuple(out.shape)) or mul(a, b, out=out))
    for shape, scales in (((96, 64), (6, 4)), ((3, 96, 64), (3, 6, 4)), ((90, 60), (6, 4)), ((96, 64), (96, 1))):
        codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes: their bytes would compare equal as NaN anyway
        w = codes.view(torch.float8_e4m3fn)
        for dtype in (torch.float32, torch.bfloat16):
            s = (torch.rand(scales, generator=gen) * 2.0 ** -140).to(dtype)  # products down among the subnormals
            strips.clear()
            got = fp8.decode(w, s)
            want = fp8.dequantize(w, s).to(torch.float32)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (shape, scales, dtype)
            matrices = shape[0] if len(shape) == 3 else 1
            assert len(strips) >= 3 * matrices and sum(r for r, _ in strips) == shape[-2] * matrices, strips
            assert all(4 * r * c <= fp8.DECODE_BYTES for r, c in strips), strips
