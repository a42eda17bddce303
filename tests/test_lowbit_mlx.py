"""A GGUF's Q8_0 and Q4_0 blocks into MLX from their codes (``converters/mlx/from_ct.py``): MLX affine 8- and 4-bit
group 32 with float32 scales ``d`` and biases ``-128 d`` / ``-8 d``, so that ``mx.dequantize`` of what is written
is gguf-py's dequantization of the source, every value; mlx_lm loads it and verify passes it."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from ffn_tools.converters import open_any  # noqa: E402
from helpers import run_cli  # noqa: E402
from test_lowbit_gguf import quantized  # noqa: E402,F401  (the fixture: llama-quantize's files of a tiny Llama)


@pytest.mark.parametrize("ftype,bits", [("Q8_0", 8), ("Q4_0", 4)])
def test_gguf_codes_kept_as_mlx_affine(quantized, tmp_path, ftype, bits):  # noqa: F811
    import mlx.core as mx

    src, out = quantized(ftype), tmp_path / "mlx"
    r = json.loads(run_cli("-q", "convert", src, "--to", "mlx", "-o", out, "--json").stdout)
    assert r["quantization"]["group_size"] == 32 and r["quantization"]["bits"] == bits
    assert any(c.startswith("kept the codes of ") and f"(GGUF {ftype})" in c for c in r["changes"])
    w: dict = {}
    for f in out.glob("*.safetensors"):
        w.update(mx.load(str(f)))
    kept = 0
    with open_any(src) as g:
        for name in g:
            base = name.removesuffix(".weight")
            if base + ".scales" not in w:
                assert g.types[name] not in ("Q8_0", "Q4_0"), name  # every such block kept
                continue
            assert w[base + ".scales"].dtype == mx.float32 and w[base + ".biases"].dtype == mx.float32
            deq = mx.dequantize(w[name], w[base + ".scales"], w[base + ".biases"], group_size=32, bits=bits)
            assert np.array_equal(np.array(deq.astype(mx.float32)), g[name].float().numpy()), name
            kept += 1
    assert kept >= 14  # every projection (and the embedding)
    if ftype == "Q4_0":  # mlx_lm loads it; its values within the 4-bit row of the GGUF's (they are equal)
        v = json.loads(run_cli("verify", src, out, "--backend", "reference", "--json").stdout)
        assert v["passed"] and v["load_check"]["ok"] and v["load_check"]["client"] == "mlx_lm"


@pytest.mark.parametrize("ftype,bits", [("Q4_1", 4), ("Q8_0", 8)])
def test_each_int_type_as_mlx_parts(quantized, ftype, bits):  # noqa: F811
    """The MLX parts ``from_ct.KeptCodes`` makes of a GGUF tensor's Q4_1 (bias ``m``) or Q8_0 (bias ``-128 d``)
    blocks: ``mx.dequantize`` of them is gguf-py's dequantization, every value (in process: no conversion)."""
    import mlx.core as mx

    from ffn_tools.converters.mlx.from_ct import KeptCodes, modules

    with open_any(quantized(ftype)) as g:
        found = modules(g)
        name = "model.layers.1.self_attn.k_proj.weight"  # q/k rows: re-permuted by the reader, codes with them
        assert name in found and g.types[name] == ftype
        m = found[name]
        w, s, b = (KeptCodes(g, m, i).apply([])[0] for i in range(3))
        packed = mx.array(np.frombuffer(bytes(w), "<u4").reshape(w.shape))
        deq = mx.dequantize(packed, mx.array(s.numpy()), mx.array(b.numpy()), group_size=32, bits=bits)
        assert np.array_equal(np.array(deq), g[name].float().numpy())


def fp8_blocks(src, dst, power_of_two: bool):
    """``src`` (bf16) with every projection as F8_E4M3 and ``weight_scale_inv`` per 32 x 32 block, as DeepSeek
    writes them: amax / 448, or (``power_of_two``, ``scale_fmt: ue8m0``) that rounded up to a power of two."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    out = {}
    for n, w in load_file(dst / "model.safetensors").items():
        if not n.endswith("proj.weight"):
            out[n] = w
            continue
        r, c = w.shape
        blocks = w.float().reshape(r // 32, 32, c // 32, 32)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
        scale = torch.exp2(torch.ceil(torch.log2(scale))) if power_of_two else scale
        out[n] = (blocks / scale[:, None, :, None]).reshape(r, c).to(torch.float8_e4m3fn)
        out[n + "_scale_inv"] = scale.float()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [32, 32], **({"scale_fmt": "ue8m0"} if power_of_two else {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_fp8_power_of_two_scales_kept_as_mxfp8(model_dir, tmp_path):
    """FP8 with UE8M0 (power-of-two) block scales into MLX: mxfp8, its E4M3 bytes and exponents, so that
    ``mx.dequantize`` is the source's ``e4m3 * scale`` exactly; mlx_lm loads it, verify passes it. amax / 448
    scales (not powers of two) stay dequantized, as before."""
    import mlx.core as mx
    import torch

    from ffn_tools import quant
    from ffn_tools.converters.mlx.from_ct import modules

    src = fp8_blocks(model_dir("llama", torch.bfloat16), tmp_path / "fp8", True)
    out = tmp_path / "mlx"
    r = json.loads(run_cli("-q", "convert", src, "--to", "mlx", "-o", out, "--json").stdout)
    assert r["quantization"] == {"group_size": 32, "bits": 8, "mode": "mxfp8"}
    assert any(c.startswith("kept the codes of 14 FP8 weights") for c in r["changes"])
    w: dict = {}
    for f in out.glob("*.safetensors"):
        w.update(mx.load(str(f)))
    with open_any(src) as c:
        d = quant.decoded(c, every=True)
        names = [n for n in d if n.endswith("proj.weight")]
        assert len(names) == 14
        for n in names:
            base = n.removesuffix(".weight")
            deq = mx.dequantize(w[n], w[base + ".scales"], group_size=32, bits=8, mode="mxfp8", dtype=mx.float32)
            assert np.array_equal(np.array(deq), d[n].float().numpy()), n
    v = json.loads(run_cli("verify", src, out, "--backend", "reference", "--json").stdout)
    assert v["passed"] and v["load_check"]["ok"] and v["load_check"]["client"] == "mlx_lm"
    other = fp8_blocks(model_dir("llama", torch.bfloat16), tmp_path / "amax", False)
    with open_any(other) as c:
        assert not modules(quant.decoded(c, every=True))  # not powers of two: no mxfp8 holds them
