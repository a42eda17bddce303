"""compressed-tensors pack-quantized checkpoints (``ffn_tools.ctensors``): read dequantized exactly as
compressed-tensors' own decompression gives, named per module by inspect, verified against the unquantized
twin, with planted defects failing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("compressed_tensors")

import ct_models  # noqa: E402
from helpers import plant, run_cli  # noqa: E402

from ffn_tools import ctensors  # noqa: E402
from ffn_tools.converters import open_any  # noqa: E402
from ffn_tools.errors import CheckpointError  # noqa: E402
from ffn_tools.io.store import open_checkpoint  # noqa: E402

VARIANTS = {  # name -> weights arguments of the one config group
    "int4-g32-sym": dict(bits=4, group_size=32, symmetric=True),
    "int4-g32-asym": dict(bits=4, group_size=32, symmetric=False),
    "int8-channel-sym": dict(bits=8, strategy="channel", symmetric=True),
    "int8-g32-asym": dict(bits=8, group_size=32, symmetric=False),
    "int4-channel-asym": dict(bits=4, strategy="channel", symmetric=False),
}


@pytest.fixture(scope="module")
def ct(tmp_path_factory):
    """``ct(variant, arch="llama", **config) -> (twin, compressed)``, cached."""
    cache: dict = {}

    def get(variant: str, arch: str = "llama", **config):
        key = (variant, arch, tuple(sorted(config.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ct-{variant}-{arch}")
            groups = {"group_0": (["Linear"], ct_models.args(**VARIANTS[variant]))}
            cache[key] = ct_models.build(arch, path, groups, **config)
        return cache[key]

    return get


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_reads_as_compressed_tensors_decompresses(ct, variant):
    _, path = ct(variant)
    with open_any(path) as ckpt:
        assert isinstance(ckpt, ctensors.CompressedView)
        assert "model.layers.0.mlp.gate_proj.weight" in ckpt and "model.layers.0.mlp.gate_proj.weight_packed" not in ckpt
        assert len(ckpt.modules) == 14  # 7 Linear modules per layer; lm_head ignored
        for name in ckpt.modules:
            ours, oracle = ckpt[name], ct_models.decompressed(path, name[: -len(".weight")])
            assert ours.dtype == oracle.dtype == torch.bfloat16 and ours.shape == oracle.shape
            assert torch.equal(ours.view(torch.int16), oracle.view(torch.int16)), name  # bit for bit


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_matches_compressed_tensors(bits):
    from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32

    codes = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, 37), dtype=torch.int8)
    packed = pack_to_int32(codes, bits)
    assert torch.equal(ctensors.pack(codes, bits), packed)
    assert torch.equal(ctensors.unpack(packed, bits, 37), unpack_from_int32(packed, bits, torch.Size([5, 37])))


def test_inspect_names_the_scheme(ct):
    _, path = ct("int4-g32-asym")
    out = run_cli("inspect", path).output
    assert "compressed-tensors read dequantized" in out
    assert "quantized     14 weights int4 group 32 asymmetric (pack-quantized)" in out
    data = json.loads(run_cli("inspect", path, "--json").output)
    assert [(q["scheme"], q["weights"]) for q in data["quantized"]] == [("int4 group 32 asymmetric (pack-quantized)", 14)]


def test_per_module_groups_and_ignore(tmp_path):
    groups = {"attn": (["re:.*self_attn.*"], ct_models.args(8, "channel")),
              "mlp": (["re:.*mlp.*_proj$"], ct_models.args(4, group_size=32, symmetric=False))}
    _, path = ct_models.build("llama", tmp_path, groups, ignore=["lm_head", "model.layers.1.mlp.down_proj"])
    with open_any(path) as ckpt:
        schemes = {n: m.scheme.name for n, m in ckpt.modules.items()}
        assert schemes["model.layers.0.self_attn.q_proj.weight"] == "int8 per channel symmetric (pack-quantized)"
        assert schemes["model.layers.0.mlp.down_proj.weight"] == "int4 group 32 asymmetric (pack-quantized)"
        assert "model.layers.1.mlp.down_proj.weight" not in schemes  # ignored: stored as bf16
        assert ckpt.quant_params("model.layers.1.mlp.down_proj.weight") is None
        assert len(schemes) == 13
    data = json.loads(run_cli("inspect", path, "--json").output)
    assert sorted((q["scheme"], q["weights"]) for q in data["quantized"]) == [
        ("int4 group 32 asymmetric (pack-quantized)", 5), ("int8 per channel symmetric (pack-quantized)", 8)]


def test_qwen2_moe_shared_expert(ct):
    twin, path = ct("int4-g32-asym", "qwen2_moe", shared_expert_intermediate_size=96)
    with open_any(path) as ckpt:
        assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in ckpt.modules
    r = run_cli("verify", twin, path, "--backend", "reference", ok=None)
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("variant", ["int4-g32-sym", "int4-g32-asym", "int8-channel-sym"])
def test_verify_passes_the_twin(ct, variant):
    twin, path = ct(variant)
    r = run_cli("verify", twin, path, "--backend", "reference")
    bits = VARIANTS[variant]["bits"]
    assert f"{bits}-bit" in r.output and "PASS" in r.output
    assert "compressed-tensors read dequantized" in r.output


def _swap(sd, a="gate_proj", b="up_proj"):
    for k in [k for k in sd if ".layers.1." in k and f".{a}." in k]:
        other = k.replace(f".{a}.", f".{b}.")
        sd[k], sd[other] = sd[other], sd[k]


def _shift_scale(sd):
    k = "model.layers.1.mlp.gate_proj.weight_scale"
    sd[k] = torch.roll(sd[k], 1, dims=0)


@pytest.mark.parametrize("defect", ["gate/up swapped", "scale row shifted"])
def test_verify_fails_planted_defects(ct, tmp_path, defect):
    twin, path = ct("int4-g32-asym")
    bad = plant(path, tmp_path / "bad", {"gate/up swapped": _swap, "scale row shifted": _shift_scale}[defect])
    r = run_cli("verify", twin, bad, "--backend", "reference", ok=None)
    assert r.exit_code == 1, r.output
    assert "FAIL" in r.output
    assert "gate (model.layers.1.mlp.gate_proj.weight): B's codes are not A's weight quantized with B's int4 group 32 " \
           "asymmetric (pack-quantized) parameters" in r.output
    if defect == "gate/up swapped":
        assert "B's gate is A's up quantized" in r.output
    assert "layer 0" not in [ln.split("  ")[0] for ln in r.output.splitlines() if "differs" in ln]


def test_verify_names_the_code_check(ct):
    twin, path = ct("int4-g32-asym")
    r = run_cli("verify", twin, path, "--backend", "reference", "--json")
    data = json.loads(r.output)
    assert [f["exact"] for f in data["ffns"]] == ["identical", "identical"]
    assert any("give B's codes, every one" in n for f in data["ffns"] for n in f["notes"])


def test_zero_points_dropped(ct, tmp_path):
    twin, path = ct("int4-g32-asym")

    def drop(sd):
        for k in [k for k in sd if k.endswith("weight_zero_point") and ".layers.1.mlp." in k]:
            del sd[k]

    bad = plant(path, tmp_path / "bad", drop)
    with pytest.raises(CheckpointError, match="weight_zero_point is missing"):
        open_any(bad)
    r = run_cli("verify", twin, bad, "--backend", "reference", ok=None)
    assert r.exit_code != 0 and "weight_zero_point is missing" in r.output

    def symmetric(cfg):  # and the config edited to match: the values read without their offsets
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = True

    def drop_all(sd):
        for k in [k for k in sd if k.endswith("weight_zero_point")]:
            del sd[k]

    bad2 = plant(path, tmp_path / "bad2", drop_all, symmetric)
    r = run_cli("verify", twin, bad2, "--backend", "reference", ok=None)
    assert r.exit_code == 1 and "FAIL" in r.output, r.output


def test_refuses_packed_weights_without_config(ct, tmp_path):
    _, path = ct("int4-g32-sym")
    bad = plant(path, tmp_path / "bad", config=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="no quantization_config with quant_method 'compressed-tensors'"):
        open_any(bad)
    r = run_cli("inspect", bad, ok=False)
    assert "14 compressed-tensors packed weights" in r.output


def test_refuses_shapes_that_do_not_fit(ct, tmp_path):
    _, path = ct("int4-g32-sym")
    bad = plant(path, tmp_path / "bad", config=lambda c: c["quantization_config"]["config_groups"]["group_0"]
                ["weights"].update(group_size=16))
    with pytest.raises(CheckpointError, match=r"weight_scale: shape \[96, 2\], expected \[96, 4\]"):
        open_any(bad)
    raw = open_checkpoint(path)
    raw.close()
    shutil.rmtree(bad)
