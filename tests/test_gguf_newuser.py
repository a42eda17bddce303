"""What a new user hit with GGUF (issue 37, items 1, 5, 7, 8), each against the real client.

The default ``--outtype`` (auto) is convert_hf_to_gguf.py's own auto, byte for byte; ``--to gguf`` after a pip
install alone fetches llama.cpp's converter from the llama-cpp-python source distribution of the installed
version; GGUF -> torch/MLX gives back the side files the GGUF stores and verify compares tokenizers by behaviour
where the GGUF cannot store a field; the config written from a GGUF's metadata is what each client needs.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import run_cli


@pytest.mark.parametrize("dtype,chosen", [(torch.bfloat16, "bf16"), (torch.float32, "f16")])
def test_default_outtype_is_the_converters_auto(gguf_model, gguf_ref, tmp_path, dtype, chosen):
    """No --outtype, and --outtype auto: the file convert_hf_to_gguf.py --outtype auto writes (bf16 for a bf16
    model, f16 for an f32 one), and the summary says which type auto chose. On main both were
    ``KeyError: 'auto'``, exit 2."""
    src = gguf_model("llama", dtype)
    ref = gguf_ref("llama", "auto", dtype)
    out = tmp_path / "default.gguf"
    r = json.loads(run_cli("-q", "convert", src, "--to", "gguf", "-o", out, "--json").output)
    assert out.read_bytes() == ref.read_bytes()
    assert r["outtype"] == chosen and set(r["types"]) == {chosen.upper(), "F32"}, r
    assert any(c.startswith(f"--outtype auto: {chosen}, as convert_hf_to_gguf.py's auto") for c in r["changes"])
    run_cli("-q", "convert", src, "--to", "gguf", "-o", tmp_path / "auto.gguf", "--outtype", "auto")
    assert (tmp_path / "auto.gguf").read_bytes() == ref.read_bytes()
    assert "auto, the default" in " ".join(run_cli("convert", "--help").output.split())
