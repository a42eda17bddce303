"""Nothing FFN-like is passed over: shared experts of DeepSeek-V3-shaped checkpoints are found and checked,
and tensors that look like FFN projections but belong to no FFN are reported (inspect, split, verify)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import plant, run_cli

import zoo


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "m"
    zoo.build("deepseek_v3", path)  # dense layer 0, then routed + shared experts
    return path


def test_deepseek_v3_shared_experts_are_found(deepseek):
    s = json.loads(run_cli("inspect", deepseek, "--json").stdout)
    assert s["scheme"] == "deepseek" and s["shared_experts"] == 1 and s["routed_experts"] == 4
    assert s["ffn"]["shared"]["count"] == 1 and s["ffn"]["dense"]["count"] == 1 and s["ffn"]["expert"]["count"] == 4
    assert s["unmatched_ffn_like"] == [] and s["warnings"] == []


def test_zeroed_shared_expert_fails_verify(deepseek, tmp_path):
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    bad = plant(deepseek, tmp_path / "bad", lambda t: t.__setitem__(name, torch.zeros_like(t[name])))
    r = run_cli("verify", deepseek, bad, "--backend", "reference", "--tokens", "4", ok=None)
    assert r.exit_code == 1 and "layer 1 shared expert" in r.output, r.output


def test_unmatched_ffn_like_tensor_is_reported(model_dir, tmp_path):
    src = model_dir("llama")
    extra = "model.layers.0.mlp.fc1.weight"  # FFN-like, but no scheme's FFN
    odd = plant(src, tmp_path / "odd", lambda t: t.__setitem__(extra, torch.randn(8, 64)))
    s = json.loads(run_cli("inspect", odd, "--json").stdout)
    assert s["unmatched_ffn_like"] == [extra] and extra in s["warnings"][0]
    assert extra in run_cli("inspect", odd).output
    r = run_cli("fuse-gateup", odd, "-o", tmp_path / "fused")
    assert "warning: 1 FFN-like tensor matched no FFN" in r.output and extra in r.output
    r = run_cli("verify", src, odd, "--backend", "reference", "--tokens", "4", ok=None)
    assert r.exit_code == 1 and extra in r.output and "--allow-unmatched" in r.output, r.output
    r = run_cli("verify", src, odd, "--backend", "reference", "--tokens", "4", "--allow-unmatched", ok=None)
    assert r.exit_code == 1 and f"only in B: {extra}" in r.output, r.output  # still an extra tensor
    r = run_cli("verify", src, odd, "--backend", "reference", "--tokens", "4", "--allow-unmatched", "--ffn-only",
                "--no-load-check", ok=None)
    assert r.exit_code == 0 and "PASS" in r.output and "outside FFNs: not compared" in r.output, r.output


@pytest.mark.parametrize("name, expected", [
    ("model.layers.0.mlp.gate.weight", False),  # a router
    ("model.layers.0.mlp.shared_expert_gate.weight", False),
    ("model.layers.0.mlp.experts.gate_up_proj", True),
    ("model.layers.0.mlp.experts.gate_up_proj_bias", True),
    ("transformer.h.0.mlp.c_fc.weight", True),
    ("model.layers.0.feed_forward.w2.weight", True),
    ("model.layers.0.self_attn.o_proj.weight", False),
    ("model.layers.0.mlp.Wi.weight", True),
    ("model.embed_tokens.weight", False),
])
def test_looks_like_ffn(name, expected):
    from ffn_tools.detect import looks_like_ffn

    assert looks_like_ffn(name) is expected


def test_inspect_tensors_gives_every_tensor_its_role(model_dir, tmp_path):
    src = model_dir("qwen2_moe")
    run_cli("fuse-gateup", src, "--stack-experts", "-o", tmp_path / "stacked")
    rows = json.loads(run_cli("inspect", tmp_path / "stacked", "--tensors", "--json").stdout)["tensor_table"]
    by = {r["name"]: r for r in rows}
    assert len(rows) == json.loads(run_cli("inspect", tmp_path / "stacked", "--json").stdout)["tensors"]
    assert by["model.layers.0.mlp.experts.gate_up_proj"]["role"] == "layer 0 experts, stacked: gate_up"
    assert by["model.layers.1.mlp.shared_expert.down_proj.weight"]["role"] == "layer 1 shared expert: down"
    assert by["model.embed_tokens.weight"]["role"] == "outside"
    assert by["model.layers.0.mlp.experts.gate_up_proj"]["shape"] == [4, 96, 64]
    text = run_cli("inspect", tmp_path / "stacked", "--tensors").output
    assert "model.layers.0.mlp.experts.down_proj" in text and "stacked: down" in text
