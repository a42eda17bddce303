"""inspect and the registry: every tiny model's FFNs found with the right shapes, kinds and layout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import run_cli
from safetensors.torch import save_file

from ffn_tools.detect import find_ffns
from ffn_tools.errors import SchemeError
from ffn_tools.library import custom_scheme
from ffn_tools.io.readers import open_checkpoint

# arch -> (scheme, {kind: (count, d_ffn)}, layout of dense/expert, routed, shared, gated unit)
EXPECTED = {
    "llama": ("hf", {"dense": (2, [96])}, "separate", 0, 0, "SwiGLU"),
    "mistral": ("hf", {"dense": (2, [96])}, "separate", 0, 0, "SwiGLU"),
    "qwen2": ("hf", {"dense": (2, [96])}, "separate", 0, 0, "SwiGLU"),
    "qwen3": ("hf", {"dense": (2, [96])}, "separate", 0, 0, "SwiGLU"),
    "phi3": ("hf", {"dense": (2, [96])}, "fused (concat, gate-up)", 0, 0, "SwiGLU"),
    "mixtral": ("mixtral", {"expert": (8, [96])}, "separate", 4, 0, "SwiGLU"),
    "qwen2_moe": ("qwen-moe", {"expert": (8, [48]), "shared": (2, [80])}, "separate", 4, 1, "SwiGLU"),
    "qwen3_moe": ("qwen-moe", {"expert": (8, [48])}, "separate", 4, 0, "SwiGLU"),
    "llama-bias": ("hf", {"dense": (2, [96])}, "separate", 0, 0, "SwiGLU"),
    "gemma": ("hf", {"dense": (2, [96])}, "separate", 0, 0, "GeGLU"),
}


@pytest.mark.parametrize("arch", sorted(EXPECTED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inspect_finds_every_ffn(model_dir, arch, dtype):
    scheme, kinds, layout, routed, shared, unit = EXPECTED[arch]
    d = model_dir(arch, dtype)
    s = json.loads(run_cli("inspect", d, "--json").stdout)
    assert s["scheme"] == scheme and s["layers"] == 2 and s["d_model"] == [64]
    assert s["routed_experts"] == routed and s["shared_experts"] == shared
    assert {k: (v["count"], v["d_ffn"]) for k, v in s["ffn"].items()} == kinds
    assert s["ffn"][next(iter(kinds))]["layout"] == layout
    assert s["ffn"][next(iter(kinds))]["bias"] == (arch == "llama-bias")
    assert s["gated_unit"] == unit
    assert s["dtypes"] == {str(dtype).removeprefix("torch."): s["tensors"]}
    assert s["config_dtype"] == str(dtype).removeprefix("torch.")
    with open_checkpoint(d) as c:
        ffns = find_ffns(c)
        outside = [n for n in c if n not in ffns.tensors]
        assert s["outside_ffn"] == {"count": len(outside), "bytes": sum(c.info(n).nbytes for n in outside)}
        assert all("mlp" not in n or "gate.weight" in n or "shared_expert_gate" in n for n in outside)
        for f in ffns.ffns:
            g = c[f.names.get("gate", f.names.get("gate_up"))]
            assert g.shape[-1] == 64
    text = run_cli("inspect", d).output
    assert f"scheme        {scheme}" in text and unit in text


def test_sharded_and_pickle_inputs_inspect_alike(model_dir):
    a = json.loads(run_cli("inspect", model_dir("mixtral"), "--json").stdout)
    b = json.loads(run_cli("inspect", model_dir("mixtral", max_shard_size="100KB"), "--json").stdout)
    c = json.loads(run_cli("inspect", model_dir("mixtral", safe_serialization=False), "--json").stdout)
    assert len(b["shards"]) > 1 and c["format"] == "pickle"
    for k in ("scheme", "ffn", "routed_experts", "total_bytes", "outside_ffn"):
        assert a[k] == b[k], k
    # the pickle holds transformers v5's in-memory state dict: experts stacked (E, 2I, H)
    assert c["ffn"]["expert"]["forms"] == {"stacked": 8} and c["ffn"]["expert"]["count"] == 8
    assert c["total_bytes"] == a["total_bytes"] and c["routed_experts"] == 4


def _apex(tmp_path):
    """A checkpoint written with safetensors directly, naming projections W_gate / W_up / W_down."""
    t = {}
    for layer in range(3):
        t[f"blocks.{layer}.ffn.W_gate.weight"] = torch.randn(40, 16)
        t[f"blocks.{layer}.ffn.W_up.weight"] = torch.randn(40, 16)
        t[f"blocks.{layer}.ffn.W_down.weight"] = torch.randn(16, 40)
        t[f"blocks.{layer}.attn.weight"] = torch.randn(16, 16)
    save_file(t, tmp_path / "apex.safetensors")
    return tmp_path / "apex.safetensors"


def test_custom_templates(tmp_path):
    p = _apex(tmp_path)
    r = run_cli("inspect", p, "--json", ok=False)
    assert "no gated FFN tensors found" in r.output and "--gate/--up/--down" in r.output
    args = ["--gate", "blocks.{layer}.ffn.W_gate.weight", "--up", "blocks.{layer}.ffn.W_up.weight",
            "--down", "blocks.{layer}.ffn.W_down.weight"]
    s = json.loads(run_cli("inspect", p, "--json", *args).stdout)
    assert s["scheme"] == "custom" and s["layers"] == 3 and s["ffn"]["dense"]["d_ffn"] == [40]
    assert s["outside_ffn"]["count"] == 3
    assert "assumed" in s["activation"]
    (tmp_path / "scheme.json").write_text(json.dumps({"gate": args[1], "up": args[3], "down": args[5]}))
    s2 = json.loads(run_cli("inspect", p, "--json", "--scheme-file", tmp_path / "scheme.json").stdout)
    assert s2["ffn"] == s["ffn"]
    run_cli("fuse-gateup", p, *args, "--gate-up", "blocks.{layer}.ffn.W_gate_up.weight", "-o", tmp_path / "x.safetensors")
    with open_checkpoint(tmp_path / "x.safetensors") as c:
        assert c.info("blocks.2.ffn.W_gate_up.weight").shape == (80, 16) and "blocks.2.ffn.W_up.weight" not in c
    r = run_cli("extract", p, *args, "-o", tmp_path / "ffn")
    assert "3 FFNs" in r.output


def test_templates_that_match_nothing(tmp_path):
    p = _apex(tmp_path)
    r = run_cli("inspect", p, "--gate", "x.{layer}.g", "--up", "x.{layer}.u", "--down", "x.{layer}.d", ok=False)
    assert "no tensor matches scheme 'custom'" in r.output
    r = run_cli("inspect", p, "--gate", "x.g", "--up", "x.u", "--down", "x.d", ok=False)
    assert "needs {layer}" in r.output


def test_ambiguous_naming_lists_candidates(tmp_path):
    t = {"model.layers.0.mlp.gate_proj.weight": torch.zeros(8, 4), "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4),
         "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 8),
         "layers.1.feed_forward.w1.weight": torch.zeros(8, 4), "layers.1.feed_forward.w3.weight": torch.zeros(8, 4),
         "layers.1.feed_forward.w2.weight": torch.zeros(4, 8)}
    save_file(t, tmp_path / "m.safetensors")
    r = run_cli("inspect", tmp_path / "m.safetensors", ok=False)
    assert "ambiguous" in r.output and "hf" in r.output and "meta" in r.output
    assert json.loads(run_cli("inspect", tmp_path / "m.safetensors", "--scheme", "meta", "--json").stdout)["layers"] == 1


def test_meta_names(tmp_path):
    t = {f"layers.{i}.feed_forward.{w}.weight": torch.randn(*s) for i in range(2)
         for w, s in (("w1", (12, 8)), ("w3", (12, 8)), ("w2", (8, 12)))}
    t["tok_embeddings.weight"] = torch.randn(10, 8)
    save_file(t, tmp_path / "consolidated.safetensors")
    with open_checkpoint(tmp_path / "consolidated.safetensors") as c:
        ffns = find_ffns(c)
        assert ffns.scheme.name == "meta"
        f = ffns.ffns[1]
        assert f.names["gate"].endswith("w1.weight") and f.names["up"].endswith("w3.weight")
        assert f.names["down"].endswith("w2.weight") and (f.d_model, f.d_ffn) == (8, 12)


def test_shape_mismatch_under_custom_templates_lists_all_problems(tmp_path):
    t = {f"b.{i}.{w}": torch.zeros(*s) for i in range(2) for w, s in (("g", (12, 8)), ("u", (12, 8)), ("d", (12, 8)))}
    save_file(t, tmp_path / "m.safetensors")
    with open_checkpoint(tmp_path / "m.safetensors") as c, pytest.raises(SchemeError) as e:
        find_ffns(c, custom_scheme("b.{layer}.g", "b.{layer}.u", "b.{layer}.d"))
    assert "b.0.g: shape [12, 8], expected [8, 12]" in str(e.value) and "b.1.g" in str(e.value)


def test_help_is_fast_and_imports_no_heavy_framework():
    code = ("import sys; from ffn_tools.cli import cli; from click.testing import CliRunner; "
            "r = CliRunner().invoke(cli, ['--help']); assert r.exit_code == 0; "
            "[CliRunner().invoke(cli, [c, '--help']) for c in cli.commands]; "
            "heavy = [m for m in ('mlx', 'jax', 'flax', 'triton', 'transformers') if m in sys.modules]; "
            "print(heavy); assert not heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_tensor_table_is_there_only_when_asked_for(model_dir):
    s = json.loads(run_cli("inspect", model_dir("llama"), "--json").stdout)
    assert "tensor_table" not in s
    s = json.loads(run_cli("inspect", model_dir("llama"), "--json", "--tensors").stdout)
    assert len(s["tensor_table"]) == s["tensors"]
