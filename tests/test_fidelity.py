"""Every output is what its consumer reads: the config, card and records a conversion writes beside the
weights, checked with the consumer itself (transformers' from_pretrained) where it runs here."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli
from safetensors import safe_open

mx = pytest.importorskip("mlx.core")


def test_mlx_to_torch_describes_the_output_not_its_mlx_input(hf, tmp_path):
    import transformers

    src = hf("llama", torch.bfloat16)
    run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "mlx", "--dtype", "float16")
    r = json.loads(run_cli("convert", tmp_path / "mlx", "--to", "torch", "-o", tmp_path / "pt", "--json").stdout)
    config = json.loads((tmp_path / "pt" / "config.json").read_text())
    assert config["dtype"] == "float16" and "torch_dtype" not in config  # the F16 weights', not the source's bf16
    assert any(c.startswith("config.json: dtype float16, the weights' (the input's config said bfloat16)")
               for c in r["changes"])
    card = (tmp_path / "pt" / "README.md").read_text()
    assert "library_name: transformers" in card and "mlx" not in card, card
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pt", dtype="auto")
    assert model.dtype == torch.float16  # loaded as stored: no cast


def test_a_dequantized_mlx_model_records_where_it_came_from(hf, tmp_path):
    src = hf("llama")
    run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "q4", "-q")
    r = json.loads(run_cli("convert", tmp_path / "q4", "--to", "torch", "-o", tmp_path / "pt", "--json").stdout)
    assert any(c.startswith("dequantized 14 mlx-quantized weights (4-bit affine, group 64)") for c in r["changes"]), \
        r["changes"]
    with safe_open(str(tmp_path / "pt" / "model.safetensors"), "pt") as f:
        record = json.loads(f.metadata()["ffn_tools_dequantized_from"])
    assert record == {"format": "mlx", "bits": 4, "group_size": 64, "mode": "affine", "weights": 14}
    rep = json.loads(run_cli("verify", src, tmp_path / "pt", "--backend", "reference", "--json", ok=None).stdout)
    assert rep["passed"], rep["failures"]  # under the 4-bit row the record names, not float32's exact check
    assert rep["tolerance"]["row"].endswith("4-bit") and rep["b"]["quantization"].startswith("4-bit group 64")


@pytest.mark.parametrize("mode, expect", [("affine", "MLX affine 4-bit (with .biases), one _scales per 1x64 block"),
                                          ("mxfp4", "MLX mxfp4 4-bit, one _scales per 1x32 block")])
def test_inspect_names_the_quantization_of_an_mlx_model(hf, tmp_path, mode, expect):
    run_cli("convert", hf("llama"), "--to", "mlx", "-o", tmp_path / "q", "-q", "--q-mode", mode)
    out = run_cli("inspect", tmp_path / "q").stdout
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("quantized"))
    assert expect in line and len(line) < 200, out
    rep = json.loads(run_cli("verify", hf("llama"), tmp_path / "q", "--backend", "reference", "--json", ok=None).stdout)
    assert rep["passed"], rep["failures"]  # ffn-tools reads its own outputs in every mode


def test_a_quantized_mlx_model_stays_quantized_unless_told(hf, tmp_path):
    from helpers import tensors

    run_cli("convert", hf("llama"), "--to", "mlx", "-o", tmp_path / "q4", "-q")
    r = json.loads(run_cli("convert", tmp_path / "q4", "--to", "mlx", "-o", tmp_path / "again", "--json").stdout)
    assert r["changes"][0].startswith("kept the input's quantization (14 weights MLX affine 4-bit")
    from ffn_tools.io.readers import open_checkpoint

    with open_checkpoint(tmp_path / "q4") as a, open_checkpoint(tmp_path / "again") as b:
        assert sorted(a) == sorted(b) and all(a.read_raw(n) == b.read_raw(n) for n in a)  # the packed bytes
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization"]["bits"] == 4
    import mlx_lm

    mlx_lm.load(str(tmp_path / "again"))  # its client loads it
    run_cli("convert", tmp_path / "q4", "--to", "mlx", "-o", tmp_path / "deq", "-d")
    assert not any(n.endswith(".scales") for n in tensors(tmp_path / "deq"))
    r = run_cli("convert", tmp_path / "q4", "--to", "mlx", "-o", tmp_path / "cast", "--dtype", "float16", ok=False)
    assert "pass -d/--dequantize" in r.output
