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
