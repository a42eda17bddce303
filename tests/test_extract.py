"""extract: canonical FFN-only checkpoints, bit-exact with the source, with a manifest."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import raw, run_cli, tensors

from ffn_tools.detect import find_ffns
from ffn_tools.errors import FFNToolsError
from ffn_tools.specs import parse_spec
from ffn_tools.io.readers import open_checkpoint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_extract_llama_bias_bit_exact(model_dir, tmp_path, dtype):
    src = model_dir("llama-bias", dtype)
    run_cli("extract", src, "-o", tmp_path / "ffn")
    out, base = tensors(tmp_path / "ffn"), tensors(src)
    assert len(out) == 2 * 6
    for layer in range(2):
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            for kind in ("weight", "bias"):
                assert raw(out[f"layers.{layer}.{ours}.{kind}"]) == raw(base[f"model.layers.{layer}.mlp.{theirs}.{kind}"])
    m = json.loads((tmp_path / "ffn" / "ffn_manifest.json").read_text())
    assert m["dtype"] == str(dtype).removeprefix("torch.") and m["d_model"] == 64 and m["d_ffn"] == [96]
    assert m["layers"] == [0, 1] and m["activation"] == "silu" and m["scheme"] == "hf"


def test_extract_phi3_splits_fused_bit_exact(model_dir, tmp_path):
    src = model_dir("phi3", torch.bfloat16)
    run_cli("extract", src, "-o", tmp_path / "ffn.safetensors", "--layers", "1")
    out, base = tensors(tmp_path / "ffn.safetensors"), tensors(src)
    w = base["model.layers.1.mlp.gate_up_proj.weight"]
    assert sorted(out) == ["layers.1.down.weight", "layers.1.gate.weight", "layers.1.up.weight"]
    assert raw(out["layers.1.gate.weight"]) == raw(w[:96]) and raw(out["layers.1.up.weight"]) == raw(w[96:])
    assert json.loads((tmp_path / "ffn.json").read_text())["layers"] == [1]


def test_extract_moe_experts_and_shared(model_dir, tmp_path):
    src = model_dir("qwen2_moe")
    r = run_cli("extract", src, "-o", tmp_path / "ffn", "--experts", "1,3", "--json")
    m = json.loads(r.stdout)
    out, base = tensors(tmp_path / "ffn"), tensors(src)
    assert m["experts"] == [1, 3] and m["shared_expert"] and m["ffns"] == 2 * 3
    assert torch.equal(out["layers.0.experts.3.up.weight"], base["model.layers.0.mlp.experts.3.up_proj.weight"])
    assert torch.equal(out["layers.1.shared_expert.down.weight"], base["model.layers.1.mlp.shared_expert.down_proj.weight"])
    assert not any(".experts.0." in n for n in out)
    with open_checkpoint(tmp_path / "ffn") as c:  # the output is itself readable: the ffn-tools scheme
        assert find_ffns(c).scheme.name == "ffn-tools" and len(find_ffns(c).ffns) == 6


def test_extract_from_v5_stacked_experts(model_dir, tmp_path):
    src = model_dir("mixtral", torch.bfloat16, safe_serialization=False)  # v5 state dict: stacked experts
    run_cli("extract", src, "-o", tmp_path / "ffn", "--layers", "0")
    out = tensors(tmp_path / "ffn")
    with open_checkpoint(src) as c:
        gu = c["model.layers.0.mlp.experts.gate_up_proj"]
        dn = c["model.layers.0.mlp.experts.down_proj"]
    for e in range(4):
        assert raw(out[f"layers.0.experts.{e}.gate.weight"]) == raw(gu[e, :96])
        assert raw(out[f"layers.0.experts.{e}.up.weight"]) == raw(gu[e, 96:])
        assert raw(out[f"layers.0.experts.{e}.down.weight"]) == raw(dn[e])


def test_specs():
    assert parse_spec("0-3,7") == {0, 1, 2, 3, 7}
    assert parse_spec("5") == {5}
    for bad in ("3-1", "a", "1,,2", "-1"):
        with pytest.raises(FFNToolsError):
            parse_spec(bad)


def test_extract_selection_naming_what_is_not_there(model_dir, tmp_path):
    r = run_cli("extract", model_dir("llama"), "-o", tmp_path / "ffn", "--layers", "9", ok=False)
    assert "has no layers [9] (it has 0-1)" in r.output and not (tmp_path / "ffn").exists()
    r = run_cli("extract", model_dir("mixtral"), "-o", tmp_path / "ffn", "--layers", "0-3", "--experts", "0,9", ok=False)
    assert "no layers [2, 3]" in r.output and "no experts [9] (it has 0-3)" in r.output
    r = run_cli("extract", model_dir("llama"), "-o", tmp_path / "ffn", "--experts", "0", ok=False)
    assert "no routed experts" in r.output and not list(tmp_path.iterdir())


def test_single_file_manifest_never_clobbers(model_dir, tmp_path):
    import shutil

    src = tmp_path / "llama"
    shutil.copytree(model_dir("llama"), src)
    config = (src / "config.json").read_text()
    r = run_cli("extract", src, "-o", src / "config.safetensors", ok=False)  # OUT.json would be the input's config
    assert "config.json" in r.output and (src / "config.json").read_text() == config
    (tmp_path / "data.json").write_text("{}")
    r = run_cli("extract", src, "-o", tmp_path / "data.safetensors", "--force", ok=False)
    assert "does not look like an earlier" in r.output and (tmp_path / "data.json").read_text() == "{}"
    run_cli("extract", src, "-o", tmp_path / "f.safetensors")
    run_cli("extract", src, "-o", tmp_path / "f.safetensors", "--layers", "1", "--force")  # an earlier manifest
    assert json.loads((tmp_path / "f.json").read_text())["layers"] == [1]


@pytest.mark.parametrize("out", ["ffn", "ffn.safetensors"])
def test_verify_of_a_partial_extract_applies_its_manifest(model_dir, tmp_path, out):
    src = model_dir("mixtral")
    run_cli("extract", src, "-o", tmp_path / out, "--layers", "1", "--experts", "0,2")
    r = run_cli("verify", src, tmp_path / out, "--backend", "reference", "--tokens", "4", ok=None)
    assert r.exit_code == 0, r.output
    assert "B is an extract of layers 1; experts 0,2 (its manifest): only those FFNs are compared" in r.output
    r = run_cli("verify", tmp_path / out, src, "--backend", "reference", "--tokens", "4", ok=None)
    assert r.exit_code == 0 and "A is an extract of layers 1" in r.output, r.output
