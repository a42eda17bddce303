"""verify's bytes-as-bytes path (``verification/stored.py``, ``io/mapped.py``) never claims what it did not compare:
a difference anywhere in B's stored bytes is found, and named as before, for plain weights (bf16, fused against
separate) and for quantized ones whose view does not name their parts (MLX: compared its own way, re-quantized)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import run_cli
from safetensors.torch import load_file, save_file

from ffn_tools.gateup import fuse_gateup


def _verify(a, b) -> dict:
    r = run_cli("verify", a, b, "--backend", "reference", "--no-load-check", "--json", ok=None)
    return json.loads(r.stdout)


def _edit(path, name, fn):
    w = load_file(path / "model.safetensors")
    w[name] = fn(w[name])
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})


def test_bf16_fused_copy_is_compared_as_bytes_and_a_planted_swap_is_still_named(model_dir, tmp_path):
    a = model_dir("llama", torch.bfloat16)
    b = tmp_path / "fused"
    fuse_gateup(a, b)
    j = _verify(a, b)
    assert j["passed"] and all(f["exact"] == "identical" for f in j["ffns"])
    assert any("stored bytes identical" in n for f in j["ffns"] for n in f["notes"])
    name = "model.layers.1.mlp.gate_up_proj.weight"
    _edit(b, name, lambda t: torch.cat(t.chunk(2)[::-1]))  # gate and up swapped in B's fused tensor
    j = _verify(a, b)
    bad = {f["ffn"]: f for f in j["ffns"]}["layer 1"]
    assert not j["passed"] and bad["exact"] == "differs"
    assert any("gate and up swapped" in p or "swapped" in p for p in bad["problems"]), bad["problems"]


def test_one_bf16_bit_flipped_in_a_later_layer_fails(model_dir, tmp_path):
    a = model_dir("llama", torch.bfloat16)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    name = "model.layers.1.mlp.down_proj.weight"
    _edit(b, name, lambda t: (t.view(torch.int16) ^ torch.nn.functional.pad(
        torch.ones(1, dtype=torch.int16), (0, t.numel() - 1)).reshape(t.shape)).view(torch.bfloat16))
    j = _verify(a, b)
    bad = {f["ffn"]: f for f in j["ffns"]}["layer 1"]
    assert not j["passed"] and bad["exact"] == "differs" and "down" in bad["problems"][0]


def test_mlx_quantized_pairs_are_not_claimed_identical_from_no_bytes(model_dir, tmp_path):
    pytest.importorskip("mlx_lm")
    a = tmp_path / "q4"
    run_cli("convert", model_dir("llama"), "--to", "mlx", "-q", "--q-bits", "4", "-o", a)
    b = tmp_path / "q4b"
    shutil.copytree(a, b)
    name = "model.layers.1.mlp.gate_proj.scales"
    _edit(b, name, lambda t: t * 2)
    j = _verify(a, b)
    bad = {f["ffn"]: f for f in j["ffns"]}["layer 1"]
    assert not j["passed"] and bad["exact"] != "identical", bad
