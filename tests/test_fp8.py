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
