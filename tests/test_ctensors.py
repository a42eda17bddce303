"""compressed-tensors pack-quantized checkpoints (``ffn_tools.quant.ctensors``): read dequantized exactly as
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

from ffn_tools import quant  # noqa: E402
from ffn_tools.quant import ctdecode  # noqa: E402
from ffn_tools.converters import open_any  # noqa: E402
from ffn_tools.errors import CheckpointError  # noqa: E402
from ffn_tools.io.readers import open_checkpoint  # noqa: E402

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
        assert isinstance(ckpt, quant.DecodedView)
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
    assert torch.equal(ctdecode.pack(codes, bits), packed)
    assert torch.equal(ctdecode.unpack(packed, bits, 37), unpack_from_int32(packed, bits, torch.Size([5, 37])))


def test_inspect_names_the_scheme(ct):
    _, path = ct("int4-g32-asym")
    out = run_cli("inspect", path).output
    assert "compressed-tensors read dequantized" in out
    assert "quantized     14 weights int4 group 32 asymmetric (pack-quantized)" in out
    data = json.loads(run_cli("inspect", path, "--json").stdout)
    assert [(q["scheme"], q["weights"]) for q in data["quantized"]] == [("int4 group 32 asymmetric (pack-quantized)", 14)]


def test_per_module_groups_and_ignore(tmp_path):
    groups = {"attn": (["re:.*self_attn.*"], ct_models.args(8, "channel")),
              "mlp": (["re:.*mlp.*_proj$"], ct_models.args(4, group_size=32, symmetric=False))}
    _, path = ct_models.build("llama", tmp_path, groups, ignore=["lm_head", "model.layers.1.mlp.down_proj"])
    with open_any(path) as ckpt:
        schemes = {n: m.args.name for n, m in ckpt.modules.items()}
        assert schemes["model.layers.0.self_attn.q_proj.weight"] == "int8 per channel symmetric (pack-quantized)"
        assert schemes["model.layers.0.mlp.down_proj.weight"] == "int4 group 32 asymmetric (pack-quantized)"
        assert "model.layers.1.mlp.down_proj.weight" not in schemes  # ignored: stored as bf16
        assert ckpt.quantized("model.layers.1.mlp.down_proj.weight") is None
        assert len(schemes) == 13
    data = json.loads(run_cli("inspect", path, "--json").stdout)
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
        assert "B's gate is A's up re-quantized" in r.output
    assert "layer 0" not in [ln.split("  ")[0] for ln in r.output.splitlines() if "differs" in ln]


def test_verify_names_the_code_check(ct):
    twin, path = ct("int4-g32-asym")
    r = run_cli("verify", twin, path, "--backend", "reference", "--json")
    data = json.loads(r.stdout)
    assert [f["exact"] for f in data["ffns"]] == ["requantized", "requantized"]
    assert any("quantized with B's stored scales and zero points give B's codes, every one" in n
               for f in data["ffns"] for n in f["notes"])


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


# --- split and fuse: the stored parts move with the rows (ffn_tools/ctrows.py) ---

def test_split_and_fuse_are_exact(ct, tmp_path):
    from helpers import assert_identical, tensors

    twin, path = ct("int4-g32-asym", "phi3")
    split = tmp_path / "split"
    r = run_cli("split-gateup", path, "-o", split)
    assert "2 of 2 FFNs" in r.output
    names = set(tensors(split))
    assert {f"model.layers.0.mlp.{p}.weight_{s}" for p in ("gate_proj", "up_proj")
            for s in ("packed", "scale", "zero_point", "shape")} <= names
    assert not any("gate_up_proj" in n for n in names)
    with open_any(path) as fused, open_any(split) as halves:
        gu = fused["model.layers.0.mlp.gate_up_proj.weight"]
        for k, role in enumerate(("gate_proj", "up_proj")):  # compressed-tensors' own decompression of each half
            oracle = ct_models.decompressed(split, f"model.layers.0.mlp.{role}")
            assert torch.equal(oracle.view(torch.int16), gu.chunk(2)[k].view(torch.int16))
            assert torch.equal(halves[f"model.layers.0.mlp.{role}.weight"].view(torch.int16), oracle.view(torch.int16))
    r = run_cli("verify", twin, split, "--backend", "reference", "--no-load-check", "--json")
    assert [f["exact"] for f in json.loads(r.stdout)["ffns"]] == ["requantized", "requantized"]
    back = tmp_path / "back"
    run_cli("fuse-gateup", split, "-o", back)
    assert_identical(tensors(path), tensors(back))  # every part, bit for bit


def test_fuse_llama(ct, tmp_path):
    twin, path = ct("int8-g32-asym")
    out = tmp_path / "fused"
    run_cli("fuse-gateup", path, "-o", out)
    with open_any(out) as ckpt:
        m = ckpt.modules["model.layers.1.mlp.gate_up_proj.weight"]
        assert m.shape == (192, 64) and m.args.bits == 8
        oracle = ct_models.decompressed(out, "model.layers.1.mlp.gate_up_proj")
        assert torch.equal(ckpt[m.weight].view(torch.int16), oracle.view(torch.int16))
    with open_any(path) as src:
        assert torch.equal(oracle, torch.cat([src["model.layers.1.mlp.gate_proj.weight"],
                                              src["model.layers.1.mlp.up_proj.weight"]]))


def test_split_refuses_zero_point_words_straddling(tmp_path):
    groups = {"g": (["Linear"], ct_models.args(4, "channel", symmetric=False))}
    _, path = ct_models.build("phi3", tmp_path, groups, intermediate_size=92)
    r = run_cli("split-gateup", path, "-o", tmp_path / "out", ok=False)
    assert ("model.layers.0.mlp.gate_up_proj.weight_zero_point: int4 per channel asymmetric (pack-quantized) packs 8 "
            "rows of zero points per int32 word, and the concat, gate-up gate/up boundaries of 184 rows (92 each, 11.5 "
            "words) do not fall on word boundaries: no exact split of the packed zero points exists") in r.output
    assert not (tmp_path / "out").exists()


def test_split_symmetric_needs_no_word_boundary(tmp_path):
    groups = {"g": (["Linear"], ct_models.args(4, "channel", symmetric=True))}
    twin, path = ct_models.build("phi3", tmp_path, groups, intermediate_size=92)
    run_cli("split-gateup", path, "-o", tmp_path / "out")
    r = run_cli("verify", twin, tmp_path / "out", "--backend", "reference", "--no-load-check")
    assert "PASS" in r.output


def test_fuse_refuses_different_tensor_scales(tmp_path):
    groups = {"g": (["Linear"], ct_models.args(8, "tensor", symmetric=True))}
    _, path = ct_models.build("llama", tmp_path, groups)
    with open_checkpoint(path) as c:
        scales = [(c[f"model.layers.{k}.mlp.gate_proj.weight_scale"].item(), c[f"model.layers.{k}.mlp.up_proj.weight_scale"].item())
                  for k in range(2)]
    k = next(k for k, (g, u) in enumerate(scales) if g != u)  # gate and up of a layer with different ranges
    r = run_cli("fuse-gateup", path, "-o", tmp_path / "out", ok=False)
    assert (f"model.layers.{k}.mlp.gate_proj.weight_scale = {scales[k][0]} and model.layers.{k}.mlp.up_proj.weight_scale = "
            f"{scales[k][1]}: per-tensor scales that differ (ratio {scales[k][1] / scales[k][0]:.6g}); the fused tensor "
            "would need one per-tensor scale for two") in r.output


def test_fuse_refuses_names_the_config_does_not_quantize(ct, tmp_path):
    _, path = ct("int4-g32-sym")
    bad = plant(path, tmp_path / "bad", config=lambda c: c["quantization_config"]["config_groups"]["group_0"]
                .update(targets=[r"re:.*\.(q|k|v|o|gate|up|down)_proj$"]))
    r = run_cli("fuse-gateup", bad, "-o", tmp_path / "out", ok=False)
    assert ("model.layers.0.mlp.gate_up_proj: the output module's parts would be stored int4 group 32 symmetric "
            "(pack-quantized), but the quantization_config carried over reads it as unquantized") in r.output


# --- export: --to torch dequantized, --to mlx affine with the codes kept (converters/mlx/from_ct.py) ---

def test_to_torch_dequantizes(ct, tmp_path):
    from safetensors import safe_open

    twin, path = ct("int4-g32-asym")
    out = tmp_path / "torch"
    r = run_cli("convert", path, "--to", "torch", "-o", out)
    assert "dequantized 14 safetensors-quantized weights (4-bit compressed-tensors asymmetric, group 32)" in r.output
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not any(k.endswith(("weight_packed", "weight_scale", "weight_zero_point")) for k in f.keys())
        for k in ("model.layers.0.mlp.gate_proj", "model.layers.1.self_attn.o_proj"):
            assert torch.equal(f.get_tensor(k + ".weight").view(torch.int16),
                               ct_models.decompressed(path, k).view(torch.int16))
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(out)  # plain bf16 weights: transformers loads them
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight.data.view(torch.int16),
                       ct_models.decompressed(path, "model.layers.0.mlp.up_proj").view(torch.int16))
    r = run_cli("verify", twin, out, "--backend", "reference")
    assert "PASS" in r.output and "4-bit" in r.output  # the dequantized record keeps the 4-bit row


def _mlx_module(model, name: str):
    mod = model
    for part in name.split("."):
        mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
    return mod


@pytest.mark.parametrize("variant", ["int4-g32-asym", "int4-g32-sym", "int8-g32-asym"])
def test_to_mlx_keeps_the_codes(ct, tmp_path, variant):
    mx = pytest.importorskip("mlx.core")
    import mlx_lm
    import numpy as np

    from helpers import write_tokenizer

    _, path = ct(variant)
    src = tmp_path / "src"
    shutil.copytree(path, src)
    write_tokenizer(src)
    out = tmp_path / "mlx"
    r = run_cli("convert", src, "--to", "mlx", "-o", out)
    assert "kept the codes of 14 quantized weights" in r.output and "not re-quantized" in r.output
    bits = VARIANTS[variant]["bits"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    model, _ = mlx_lm.load(str(out))
    with open_any(src) as ckpt:
        for name, m in ckpt.modules.items():
            q = _mlx_module(model, name[: -len(".weight")])
            assert type(q).__name__ == "QuantizedLinear" and (q.group_size, q.bits) == (32, bits)
            parts = ckpt.parts(name)
            # the codes, as stored: compressed-tensors' packed words are MLX's uint32 words
            assert np.array_equal(np.array(q.weight).view(np.int32), parts["weight_packed"].numpy())
            assert q.scales.dtype == q.biases.dtype == mx.float32
            w = torch.from_numpy(np.array(mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=bits)))
            ref = ct_models.decompressed(src, name[: -len(".weight")])
            # MLX's values are s * (q - z) exactly (float32 scales and biases): compressed-tensors' definition
            # rounds that once to bfloat16, and so do they, bit for bit
            assert torch.equal(w.to(ref.dtype).view(torch.int16), ref.view(torch.int16)), name
            s = parts["weight_scale"].float().repeat_interleave(32, 1)
            c = ctdecode.unpack(parts["weight_packed"], m.args.bits, m.shape[1]).float()
            z = (ctdecode.zero_points(m, parts["weight_zero_point"]).float().repeat_interleave(32, 1)
                 if "weight_zero_point" in parts else 0)
            assert torch.equal(w, s * (c - z)), name  # no rounding at all in MLX's dequantization
    r = run_cli("verify", src, out, "--backend", "reference")
    assert "PASS" in r.output and "loads in mlx_lm" in r.output


@pytest.mark.parametrize("variant", ["int8-g32-asym"])
def test_to_mlx_logits_move_no_further_than_the_quantization(ct, tmp_path, variant):
    """mlx_lm's logits of the kept-codes export are no further from the unquantized twin's than the source's own
    (its dequantized weights run by transformers): float32 scales and biases add no rounding of their own. With
    bfloat16 ones (the export before) measured on a 256-wide int8 Llama: 0.069 against the source's 0.023."""
    mx = pytest.importorskip("mlx.core")
    import mlx_lm
    import numpy as np
    from transformers import AutoModelForCausalLM

    from helpers import write_tokenizer

    twin, path = ct(variant)
    src = tmp_path / "src"
    shutil.copytree(path, src)
    write_tokenizer(src)
    run_cli("-q", "convert", src, "--to", "mlx", "-o", tmp_path / "mlx")
    run_cli("-q", "convert", src, "--to", "torch", "-o", tmp_path / "deq")
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(0))

    def logits(p):
        with torch.no_grad():
            return AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)(ids).logits.numpy()

    ref, source = logits(twin), logits(tmp_path / "deq")
    model, _ = mlx_lm.load(str(tmp_path / "mlx"))
    ours = np.array(model(mx.array(ids.numpy())).astype(mx.float32))
    moved, own = float(np.abs(ours - ref).max()), float(np.abs(source - ref).max())
    assert own > 0 and moved <= 1.1 * own, (moved, own)


def test_to_mlx_per_channel_dequantizes_and_says_so(ct, tmp_path):
    pytest.importorskip("mlx.core")
    import mlx_lm

    from helpers import write_tokenizer

    _, path = ct("int8-channel-sym")
    src = tmp_path / "src"
    shutil.copytree(path, src)
    write_tokenizer(src)
    out = tmp_path / "mlx"
    r = run_cli("convert", src, "--to", "mlx", "-o", out)
    assert ("dequantized 14 quantized weights (int8 per channel symmetric (pack-quantized): MLX affine groups "
            "are 32, 64, 128 columns; -q quantizes them with mx.quantize instead)") in r.output
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization" not in cfg and "quantization_config" not in cfg
    model, _ = mlx_lm.load(str(out))
    assert type(model.model.layers[0].mlp.gate_proj).__name__ == "Linear"
    r = run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "q", "-q")
    assert "read 14 quantized weights dequantized, then quantized as asked" in r.output


# --- NVFP4: compressed-tensors nvfp4-pack-quantized and ModelOpt (ffn_tools/nvfp4.py) ---

NVFP4_CT = "nvfp4 group 16 with a weight_global_scale (nvfp4-pack-quantized)"


@pytest.fixture(scope="module")
def nv(tmp_path_factory):
    """``nv(arch) -> (twin, compressed-tensors NVFP4, ModelOpt NVFP4)``, cached."""
    cache: dict = {}

    def get(arch: str = "llama"):
        if arch not in cache:
            path = tmp_path_factory.mktemp(f"nvfp4-{arch}")
            twin, ct = ct_models.build(arch, path, {"g": (["Linear"], ct_models.nvfp4_args())}, fmt="nvfp4-pack-quantized")
            cache[arch] = twin, ct, ct_models.to_modelopt(ct, path / "modelopt")
        return cache[arch]

    return get


def test_nvfp4_reads_as_compressed_tensors_decompresses(nv):
    _, ct, mo = nv()
    with open_any(ct) as a, open_any(mo) as b:
        assert sorted(a.modules) == sorted(b.modules) and len(a.modules) == 14
        assert {m.args.name for m in b.modules.values()} == {"nvfp4 group 16 with a weight_scale_2 (modelopt NVFP4)"}
        for name in a.modules:
            base = name[: -len(".weight")]
            oracle = ct_models.decompressed(ct, base)
            assert torch.equal(a[name].view(torch.int16), oracle.view(torch.int16)), name
            # ModelOpt's own definition (times scale_2) against compressed-tensors' reading of it (its converter:
            # divided by 1 / scale_2): float32 roundings apart at most, then one bf16 rounding
            mo_oracle = ct_models.modelopt_decompressed(mo, base)
            assert torch.allclose(b[name].float(), mo_oracle.float(), rtol=2 ** -7, atol=0), name
            assert torch.allclose(b[name].float(), oracle.float(), rtol=2 ** -7, atol=0), name


def test_nvfp4_inspect_and_verify(nv, tmp_path):
    twin, ct, mo = nv()
    out = run_cli("inspect", ct).output
    assert f"quantized     14 weights {NVFP4_CT}" in out
    for path in (ct, mo):
        r = run_cli("verify", twin, path, "--backend", "reference")
        assert "PASS" in r.output and "4-bit" in r.output

    def invert(sd):  # the global scale as the other convention stores it
        k = "model.layers.1.mlp.up_proj.weight_global_scale"
        sd[k] = 1 / sd[k]

    bad = plant(ct, tmp_path / "inverted", invert)
    r = run_cli("verify", twin, bad, "--backend", "reference", ok=None)
    assert r.exit_code == 1 and "FAIL" in r.output
    mixed = ct_models.to_modelopt(ct, tmp_path / "mixed-up", inverted=True)  # ModelOpt files, ct's convention
    r = run_cli("verify", twin, mixed, "--backend", "reference", ok=None)
    assert r.exit_code == 1 and "FAIL" in r.output


def test_nvfp4_split_fuse_and_global_scale_refusal(nv, tmp_path):
    from helpers import assert_identical, tensors

    twin, ct, mo = nv("phi3")
    for src, tag in ((ct, "ct"), (mo, "mo")):
        split, back = tmp_path / f"{tag}-split", tmp_path / f"{tag}-back"
        run_cli("split-gateup", src, "-o", split)
        r = run_cli("verify", twin, split, "--backend", "reference", "--no-load-check")
        assert "PASS" in r.output
        run_cli("fuse-gateup", split, "-o", back)
        assert_identical(tensors(src), tensors(back))
    def wider_up(model):  # up's range 1.5 times gate's: their global scales differ (vllm#47515's case)
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.mul_(1.5)

    _, ct = ct_models.build("llama", tmp_path / "wide", {"g": (["Linear"], ct_models.nvfp4_args())},
                            fmt="nvfp4-pack-quantized", prepare=wider_up)
    mo = ct_models.to_modelopt(ct, tmp_path / "wide-mo")
    with open_checkpoint(ct) as c:
        g, u = (c[f"model.layers.0.mlp.{p}.weight_global_scale"].item() for p in ("gate_proj", "up_proj"))
    assert g != u
    r = run_cli("fuse-gateup", ct, "-o", tmp_path / "fused", ok=False)
    assert (f"model.layers.0.mlp.gate_proj.weight_global_scale = {g} and model.layers.0.mlp.up_proj.weight_global_scale "
            f"= {u}: global scales that differ (ratio {u / g:.6g}); the fused tensor would need one global scale for "
            "two") in r.output
    r = run_cli("fuse-gateup", mo, "-o", tmp_path / "fused-mo", ok=False)
    assert "weight_scale_2" in r.output and "global scales that differ" in r.output


def test_nvfp4_to_mlx_dequantizes_and_says_why(nv, tmp_path):
    pytest.importorskip("mlx.core")
    import mlx_lm

    from helpers import write_tokenizer

    _, ct, _ = nv()
    src = tmp_path / "src"
    shutil.copytree(ct, src)
    write_tokenizer(src)
    r = run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "mlx")
    assert f"dequantized 14 quantized weights ({NVFP4_CT}: MLX's nvfp4 QuantizedLinear has no per-tensor" \
           in r.output
    model, _ = mlx_lm.load(str(tmp_path / "mlx"))
    assert type(model.model.layers[0].mlp.gate_proj).__name__ == "Linear"


# --- FP8: compressed-tensors float-quantized, read by ffn_tools/scales.py ---

@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_float_quantized(tmp_path, strategy):
    from compressed_tensors.quantization import QuantizationArgs

    a = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True)
    twin, path = ct_models.build("llama", tmp_path, {"g": (["Linear"], a)}, fmt="float-quantized")
    out = run_cli("inspect", path).output
    assert f"quantized     14 weights fp8 per {strategy} (float-quantized), one _weight_scale per" in out
    from ffn_tools import quant

    with quant.decoded(open_checkpoint(path), every=True) as ckpt:
        for base in ("model.layers.0.mlp.gate_proj", "model.layers.1.self_attn.v_proj"):
            oracle = ct_models.decompressed(path, base)  # compressed-tensors' float-quantized decompression
            ours = ckpt[base + ".weight"].to(oracle.dtype)
            assert torch.equal(ours.view(torch.int16), oracle.view(torch.int16)), base
    r = run_cli("verify", twin, path, "--backend", "reference")
    assert "PASS" in r.output


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_group_128(tmp_path, symmetric):
    """The common llm-compressor recipe (W4A16, group 128), with and without zero points, on a model wide
    enough for it: read as compressed-tensors decompresses, verified, and kept as MLX affine group 128."""
    pytest.importorskip("mlx.core")
    import mlx_lm

    from helpers import write_tokenizer

    groups = {"g": (["Linear"], ct_models.args(4, group_size=128, symmetric=symmetric))}
    twin, path = ct_models.build("llama", tmp_path, groups, hidden_size=128, intermediate_size=256)
    write_tokenizer(path)
    with open_any(path) as ckpt:
        assert {m.args.name for m in ckpt.modules.values()} == \
            {f"int4 group 128 {'symmetric' if symmetric else 'asymmetric'} (pack-quantized)"}
        for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight"):
            assert torch.equal(ckpt[name].view(torch.int16),
                               ct_models.decompressed(path, name[: -len(".weight")]).view(torch.int16))
    r = run_cli("verify", twin, path, "--backend", "reference", "--json")
    assert [f["exact"] for f in json.loads(r.stdout)["ffns"]] == ["requantized", "requantized"]
    run_cli("convert", path, "--to", "mlx", "-o", tmp_path / "mlx")
    model, _ = mlx_lm.load(str(tmp_path / "mlx"))
    assert model.model.layers[0].mlp.down_proj.group_size == 128


def test_extract_says_it_dequantized(ct, tmp_path):
    twin, path = ct("int4-g32-asym")
    out = tmp_path / "ffns.safetensors"
    r = run_cli("extract", path, "-o", out)
    assert "6 quantized weights written dequantized, as read (4-bit compressed-tensors asymmetric, group 32)" in r.output
    with open_checkpoint(out) as ex, open_any(path) as src:
        assert torch.equal(ex["layers.0.gate.weight"].view(torch.int16),
                           src["model.layers.0.mlp.gate_proj.weight"].view(torch.int16))
    r = run_cli("verify", twin, out, "--backend", "reference")
    assert "4-bit" in r.output and "PASS" in r.output


@pytest.mark.parametrize("to", [("flax",), ("dcp", "--dcp-naming", "hf"), ("orbax",)], ids=lambda t: t[0])
def test_to_formats_without_quantized_forms_says_it_dequantized(ct, tmp_path, to):
    pytest.importorskip("flax")
    _, path = ct("int4-g32-sym")
    r = run_cli("convert", path, "--to", *to, "-o", tmp_path / "out")
    assert "dequantized 14 quantized weights, as read (safetensors, compressed-tensors read dequantized)" in r.output


def test_verify_the_other_way_round(ct, tmp_path):
    """A quantized, B its unquantized twin: the same code check, the sides named as they are."""
    twin, path = ct("int4-g32-asym")
    r = run_cli("verify", path, twin, "--backend", "reference", "--json")
    assert [f["exact"] for f in json.loads(r.stdout)["ffns"]] == ["requantized", "requantized"]
    bad = plant(path, tmp_path / "bad", _shift_scale)
    r = run_cli("verify", bad, twin, "--backend", "reference", ok=None)
    assert r.exit_code == 1
    assert "gate (model.layers.1.mlp.gate_proj.weight): A's codes are not B's weight quantized with A's" in r.output


def test_nvfp4_codes_checked(nv, tmp_path):
    """NVFP4's round-to-nearest (cast_to_fp4 of x / (scale / global_scale)) is replayed: the twin's codes come
    back every one, and a scale row shifted by one fails by its codes."""
    twin, ct, mo = nv()
    data = json.loads(run_cli("verify", twin, ct, "--backend", "reference", "--json").stdout)
    assert [f["exact"] for f in data["ffns"]] == ["requantized", "requantized"]
    r = run_cli("verify", twin, mo, "--backend", "reference")  # ModelOpt's scale_2 = 1 / global scale: rounded
    assert "PASS" in r.output

    def shift(sd):
        k = "model.layers.1.mlp.gate_proj.weight_scale"
        sd[k] = torch.roll(sd[k], 1, dims=0)

    r = run_cli("verify", twin, plant(ct, tmp_path / "shifted", shift), "--backend", "reference", ok=None)
    assert r.exit_code == 1
    assert f"gate (model.layers.1.mlp.gate_proj.weight): B's codes are not A's weight quantized with B's {NVFP4_CT}" \
        in r.output
