"""GPT-OSS with MXFP4 experts as OpenAI ships it (``*_blocks`` + ``*_scales``), quantized here with torch alone
from a transformers-built bf16 twin: read dequantized (checked against transformers' own
``convert_moe_packed_tensors``), verified, converted, and refused by split/fuse with the way out."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import run_cli, tensors
from safetensors.torch import load_file, save_file

import zoo

LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_mxfp4(w_hf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Hugging Face GPT-OSS expert tensor (E, in, out) as MXFP4 blocks (E, out, in/32, 16) and scales."""
    w = w_hf.transpose(1, 2).float()  # (E, rows, cols)
    e, rows, cols = w.shape
    g = w.reshape(e, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp)[..., None]
    idx = (scaled[..., None] - LUT).abs().argmin(-1).to(torch.uint8)  # nearest FP4 value
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptoss")
    bf16 = root / "bf16"
    zoo.build("gpt_oss", bf16)
    packed = root / "mxfp4"
    shutil.copytree(bf16, packed)
    out = {}
    for k, v in load_file(bf16 / "model.safetensors").items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[k + "_blocks"], out[k + "_scales"] = to_mxfp4(v)
        else:
            out[k] = v
    save_file(out, packed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (packed / "config.json").write_text(json.dumps(config))
    return bf16, packed


def test_mxfp4_reads_as_transformers_dequantizes_it(gpt_oss, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    bf16, packed = gpt_oss
    s = json.loads(run_cli("inspect", packed, "--json").stdout)
    assert s["quantized"] == [{"dtype": "MXFP4", "scales": "scales", "block": [1, 32], "weights": 4,
                               "how": "read dequantized, exactly (bf16)"}]
    assert s["ffn"] == json.loads(run_cli("inspect", bf16, "--json").stdout)["ffn"] and not s["unmatched_ffn_like"]
    run_cli("convert", packed, "--to", "torch", "-o", tmp_path / "deq")
    raw, deq = load_file(packed / "model.safetensors"), tensors(tmp_path / "deq")
    for base in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        want = convert_moe_packed_tensors(raw[base + "_blocks"], raw[base + "_scales"], dtype=torch.bfloat16)
        assert deq[base].dtype == torch.bfloat16 and torch.equal(deq[base], want), base
    assert "quantization_config" not in json.loads((tmp_path / "deq" / "config.json").read_text())


def test_verify_mxfp4_against_its_twins(gpt_oss, tmp_path):
    bf16, packed = gpt_oss
    r = run_cli("verify", bf16, packed, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 0 and "PASS" in r.output and "4-bit" in r.output, r.output
    run_cli("convert", packed, "--to", "torch", "-o", tmp_path / "deq")
    r = run_cli("verify", packed, tmp_path / "deq", "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    w = load_file(bad / "model.safetensors")
    for part in ("_blocks", "_scales"):  # expert 0 of layer 1: gate rows (even) and up rows (odd) swapped
        t = w[f"model.layers.1.mlp.experts.gate_up_proj{part}"]
        t[0] = t[0].reshape(-1, 2, *t.shape[2:]).flip(1).reshape(t[0].shape)
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    r = run_cli("verify", packed, bad, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1 and "FAIL" in r.output, r.output


def test_split_and_fuse_refuse_mxfp4_with_the_way_out(gpt_oss, tmp_path):
    _, packed = gpt_oss
    for command in ("split-gateup", "fuse-gateup"):
        r = run_cli(command, packed, "-o", tmp_path / command, ok=False)
        assert "MXFP4" in r.output and "--to torch" in r.output and not (tmp_path / command).exists()


def test_mxfp4_to_mlx_stays_mxfp4_as_mlx_lm_convert_keeps_it(gpt_oss, tmp_path):
    """mlx_lm's GPT-OSS reads OpenAI's MXFP4 experts into MLX's own mxfp4: the export keeps the packed bytes."""
    mlx_lm = pytest.importorskip("mlx_lm")
    import contextlib
    import io

    from helpers import assert_identical, write_tokenizer

    from ffn_tools.converters import convert

    _, packed = gpt_oss
    src = tmp_path / "src"
    shutil.copytree(packed, src)
    write_tokenizer(src, 160)
    summary = convert(src, "mlx", tmp_path / "mine")
    assert summary["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert any(c.startswith("kept 4 MXFP4 tensors") for c in summary["changes"])
    ref = tmp_path / "ref-src"
    shutil.copytree(src, ref)
    config = json.loads((tmp_path / "mine" / "config.json").read_text())  # the keys export added
    config.pop("quantization")
    config["quantization_config"] = json.loads((src / "config.json").read_text())["quantization_config"]
    (ref / "config.json").write_text(json.dumps(config))
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm.convert(str(ref), str(tmp_path / "theirs"))
    assert_identical(tensors(tmp_path / "mine"), tensors(tmp_path / "theirs"))
    theirs = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert json.loads((tmp_path / "mine" / "config.json").read_text())["quantization"] == theirs["quantization"]
    mlx_lm.load(str(tmp_path / "mine"))
