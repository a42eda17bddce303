"""GPTQ (with desc_act's g_idx) and AWQ GEMM checkpoints (``ffn_tools/gptq.py``): read dequantized exactly as
the packed codes say (test files packed by the formats' published packing loops, ``gptq_models.py``), AWQ
against mlx_lm's own unpacking (``mlx_lm.load`` of the AWQ checkpoint), inspect, verify, split/fuse refused,
and MLX export keeping the codes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import gptq_models
from helpers import plant, run_cli, write_tokenizer

from ffn_tools.converters import open_any

CASES = {"gptq": dict(method="gptq"), "gptq-desc-act": dict(method="gptq", desc_act=True), "awq": dict(method="awq")}
NAMES = {"gptq": "gptq int4 group 32 with zero points",
         "gptq-desc-act": "gptq int4 group 32 desc_act (g_idx out of order) with zero points",
         "awq": "awq int4 group 32 with zero points"}


@pytest.fixture(scope="module")
def q(tmp_path_factory):
    cache: dict = {}

    def get(case: str):
        if case not in cache:
            path = tmp_path_factory.mktemp(case)
            twin, out, expected = gptq_models.build(path=path, **CASES[case])
            write_tokenizer(out)
            cache[case] = twin, out, expected
        return cache[case]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_reads_the_codes_as_packed(q, case):
    _, path, expected = q(case)
    with open_any(path) as ckpt:
        assert {m.args.name for m in ckpt.modules.values()} == {NAMES[case]} and len(ckpt.modules) == 14
        for name, ref in expected.items():
            got = ckpt[name]
            assert got.dtype == torch.float16
            assert torch.equal(got, ref.to(torch.float16)), name  # computed in float32, rounded once
    out = run_cli("inspect", path).output
    assert f"quantized     14 weights {NAMES[case]}" in out


def test_awq_matches_mlx_lm_unpacking(q):
    mx = pytest.importorskip("mlx.core")
    import mlx_lm
    import numpy as np

    from ffn_tools.quant import gptq

    _, path, _ = q("awq")
    model, _ = mlx_lm.load(str(path))  # mlx_lm's own AWQ transform (_transform_awq_weights)
    with open_any(path) as ckpt:
        for name, m in ckpt.modules.items():
            mod = model
            for part in name[: -len(".weight")].split("."):
                mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
            words, scales, biases = gptq.mlx_affine(m, ckpt.parts(name))
            assert np.array_equal(np.array(mod.weight).astype(np.int64), words.numpy()), name  # the same codes
            assert np.array_equal(np.array(mod.scales.astype(mx.float32)), scales.float().numpy()), name
            # mlx_lm's biases are float16, ours float32 (exact): the same values, rounded once by mlx_lm
            assert np.array_equal(np.array(mod.biases.astype(mx.float32)), biases.half().float().numpy()), name
            assert biases.dtype == torch.float32 and not torch.equal(biases.half().float(), biases)


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_passes_and_catches_a_swap(q, tmp_path, case):
    twin, path, _ = q(case)
    r = run_cli("verify", twin, path, "--backend", "reference")
    assert "PASS" in r.output and "4-bit" in r.output
    data = json.loads(run_cli("verify", twin, path, "--backend", "reference", "--json").stdout)
    assert [f["exact"] for f in data["ffns"]] == ["requantized", "requantized"]  # B's codes: A's, re-quantized

    def shift(sd):  # one output row's scales taken from its neighbour's
        k = "model.layers.1.mlp.gate_proj.scales"
        sd[k] = torch.roll(sd[k], 1, dims=1)

    r = run_cli("verify", twin, plant(path, tmp_path / "shifted", shift), "--backend", "reference", ok=None)
    assert r.exit_code == 1
    assert f"gate (model.layers.1.mlp.gate_proj.weight): B's codes are not A's weight quantized with B's {NAMES[case]}" \
        in r.output

    def swap(sd):
        for k in [k for k in sd if ".layers.1.mlp.gate_proj." in k]:
            other = k.replace("gate_proj", "up_proj")
            sd[k], sd[other] = sd[other], sd[k]

    bad = plant(path, tmp_path / "bad", swap)
    r = run_cli("verify", twin, bad, "--backend", "reference", ok=None)
    assert r.exit_code == 1 and "FAIL" in r.output


@pytest.mark.parametrize("method,desc_act", [("gptq", True), ("awq", False)])
def test_split_and_fuse_move_the_columns(tmp_path, method, desc_act):
    from helpers import assert_identical, tensors

    twin, path, expected = gptq_models.build(method, tmp_path, arch="phi3", desc_act=desc_act)
    split, back = tmp_path / "split", tmp_path / "back"
    run_cli("split-gateup", path, "-o", split)
    with open_any(split) as ckpt:
        for k, role in enumerate(("gate_proj", "up_proj")):
            name = f"model.layers.1.mlp.{role}.weight"
            ref = expected["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)[k]
            assert torch.equal(ckpt[name], ref.to(torch.float16)), name  # the half's own codes, scales, zeros
    r = run_cli("verify", twin, split, "--backend", "reference", "--no-load-check")
    assert "PASS" in r.output
    run_cli("fuse-gateup", split, "-o", back)
    assert_identical(tensors(path), tensors(back))  # qweight, qzeros, scales, g_idx: bit for bit


def test_split_refuses_words_straddling(tmp_path):
    _, path, _ = gptq_models.build("awq", tmp_path, arch="phi3", group_size=4, intermediate_size=100)
    r = run_cli("split-gateup", path, "-o", tmp_path / "out", ok=False)
    assert ("awq int4 group 4 with zero points packs 8 output columns per int32 word, and the concat, gate-up gate/up "
            "boundaries of 200 output rows (100 each, 12.5 words) do not fall on word boundaries: no exact split of the "
            "words exists") in r.output
    assert not (tmp_path / "out").exists()


def test_fuse_refuses_different_g_idx(q, tmp_path):
    _, path, _ = q("gptq-desc-act")  # each module its own random act order here
    r = run_cli("fuse-gateup", path, "-o", tmp_path / "out", ok=False)
    assert "model.layers.0.mlp.gate_proj.g_idx and model.layers.0.mlp.up_proj.g_idx differ in" in r.output
    assert "one fused tensor has one g_idx, so no exact fuse exists" in r.output


@pytest.mark.parametrize("case", ["gptq", "awq"])
def test_to_mlx_keeps_the_codes(q, tmp_path, case):
    mx = pytest.importorskip("mlx.core")
    import mlx_lm
    import numpy as np

    _, path, expected = q(case)
    out = tmp_path / "mlx"
    r = run_cli("convert", path, "--to", "mlx", "-o", out)
    assert f"kept the codes of 14 quantized weights ({NAMES[case]})" in r.output
    assert json.loads((out / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    model, _ = mlx_lm.load(str(out))
    for name, ref in expected.items():
        mod = model
        for part in name[: -len(".weight")].split("."):
            mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
        w = torch.from_numpy(np.array(mx.dequantize(mod.weight, mod.scales, mod.biases, group_size=32, bits=4)
                                      .astype(mx.float32)))
        s = torch.from_numpy(np.array(mod.scales.astype(mx.float32))).repeat_interleave(32, 1)
        b = torch.from_numpy(np.array(mod.biases.astype(mx.float32))).repeat_interleave(32, 1)
        codes = torch.round((ref - b) / s)  # each value is s * c + b for an integer code c
        bound = 2.0 ** -11 * (b.abs() + (s * codes).abs() + ref.abs())  # fp16: half an ulp each
        assert bool(((w - ref).abs() <= bound).all()), name
    r = run_cli("verify", path, out, "--backend", "reference")
    assert "PASS" in r.output


def test_desc_act_to_mlx_is_dequantized_by_name(q, tmp_path):
    _, path, _ = q("gptq-desc-act")
    r = run_cli("convert", path, "--to", "mlx", "-o", tmp_path / "mlx")
    assert (f"dequantized 14 quantized weights ({NAMES['gptq-desc-act']}: its groups are not runs of "
            "consecutive columns, as MLX's are; -q quantizes them with mx.quantize instead)") in r.output
    shutil.rmtree(tmp_path / "mlx")


@pytest.mark.parametrize("case", ["gptq-desc-act", "awq"])
def test_to_torch_dequantizes(q, tmp_path, case):
    import transformers

    twin, path, expected = q(case)
    out = tmp_path / "torch"
    r = run_cli("convert", path, "--to", "torch", "-o", out)
    assert "dequantized 14 safetensors-quantized weights (4-bit gptq" in r.output or \
        "dequantized 14 safetensors-quantized weights (4-bit awq" in r.output
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(model.state_dict()[name], expected[name].to(torch.float16))
    r = run_cli("verify", twin, out, "--backend", "reference")
    assert "PASS" in r.output and "4-bit" in r.output
