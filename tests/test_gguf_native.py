"""``convert --to gguf`` writes tensor data in chunks by recipes (``converters/gguf/native``), the converter the
rest: the file stays convert_hf_to_gguf.py's, byte for byte, whatever wrote each tensor.

The reference is llama.cpp's converter on the same checkpoint. The models here are bfloat16 and float16 (the
other GGUF tests use float32 sources), so every cast the recipes make is covered: bf16 -> BF16 (a byte copy
with NaNs made quiet), bf16 -> F32 (the bits shifted), bf16/f16 -> F16, BF16 and Q8_0 through gguf-py's
quantizer, chunk by chunk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import gguf_models
from helpers import once, run_cli

from ffn_tools.converters.gguf import native, writer


def test_bf16_copy_is_gguf_bf16_rounding_on_every_pattern():
    """The byte copy of a bfloat16 tensor equals gguf-py's float32 -> BF16 rounding of it for all 65536 bit
    patterns (NaNs included: made quiet), so bf16 -> BF16 never goes through float32."""
    from gguf import GGMLQuantizationType, quants

    bits = np.arange(1 << 16, dtype=np.uint16)
    f32 = (bits.astype(np.uint32) << 16).view(np.float32).reshape(256, 256)
    theirs = quants.quantize(f32, GGMLQuantizationType.BF16).tobytes()
    assert native._bf16_as_bf16(bits.tobytes()) == theirs
    assert native._bf16_as_bf16(bits[:100].tobytes()) == bits[:100].tobytes()  # no NaN: the bytes themselves


def _q8_0_theirs(x: np.ndarray) -> bytes:
    from gguf import GGMLQuantizationType, quants

    with np.errstate(all="ignore"):  # NaN, infinity and float16 overflow: the bytes are what is compared
        return quants.quantize(x.reshape(-1, 32), GGMLQuantizationType.Q8_0).tobytes()


def test_q8_0_is_gguf_pys_bytes_on_ties_their_neighbours_and_every_bfloat16():
    """``native.q8_0`` (the int32 maximum, the in-place buffers, roundf as one add) gives gguf-py's Q8_0 bytes.

    Blocks whose maximum is 127 have a scale of exactly 1, so every other value is rounded as it is: those
    values are every half-integer in [-127, 127] and the 64 float32s either side of each, where roundf's ties
    and near-ties lie. Then every finite bfloat16 pattern, shuffled into blocks (scales from subnormal to
    3e38), and random weights at scales from 1e-30 to 1e30."""
    halves = np.arange(0, 255, dtype=np.float32) / 2
    near = np.maximum(halves.view(np.int32)[:, None] + np.arange(-64, 65, dtype=np.int32), 0).view(np.float32)
    near = np.clip(near.reshape(-1), 0, 127)
    near = np.concatenate([near, -near])
    near = np.concatenate([near, np.zeros(-len(near) % 31, np.float32)]).reshape(-1, 31)
    tied = np.concatenate([np.full((len(near), 1), 127, np.float32), near], axis=1)
    rng = np.random.default_rng(0)
    bits = np.arange(1 << 16, dtype=np.uint32)
    bf16 = (bits << 16).view(np.float32)
    bf16 = rng.permutation(bf16[np.isfinite(bf16)])
    bf16 = bf16[: len(bf16) // 32 * 32]
    weights = [(rng.standard_normal(1 << 14) * scale).astype(np.float32) for scale in (1e-30, 1e-5, 0.02, 1, 1e30)]
    fast = 0
    for x in [tied, bf16, *weights]:
        ours = native.q8_0(x)
        if ours is not None:
            fast += 1
            assert bytes(ours) == _q8_0_theirs(x)
        assert bytes(native.encode_values(x.reshape(-1, 32), "Q8_0")) == _q8_0_theirs(x)
    assert fast == 7

def test_q8_0_leaves_nan_infinity_and_overflowing_inverses_to_gguf_py():
    """A block with a NaN or an infinity, or whose scale is so small that its inverse overflows, is not
    quantized by ``q8_0`` (None); ``encode`` then gives gguf-py's own bytes for it."""
    rng = np.random.default_rng(1)
    for bad in (np.nan, np.inf, -np.inf, 1e-40):
        x = (rng.standard_normal(256) * 0.02).astype(np.float32)
        x[32:64] = 0
        x[40] = bad
        assert native.q8_0(x) is None
        with np.errstate(all="ignore"):  # gguf-py's, on the NaN and the infinity
            assert bytes(native.encode_values(x.reshape(-1, 32), "Q8_0")) == _q8_0_theirs(x)


@pytest.fixture(scope="session")
def bf16_llama(gguf_model, shared_dir):
    """The tiny Llama in bfloat16 with a signalling NaN and an infinity planted in layer 0's gate, made once per
    run (``shared_dir``): read-only."""

    def make(d):
        src = gguf_models.copy_model(gguf_model("llama", torch.bfloat16), d / "model")
        (f,) = src.glob("*.safetensors")
        sd = load_file(f)
        gate = sd["model.layers.0.mlp.gate_proj.weight"].view(torch.int16)
        gate[0, 0], gate[1, 3] = 0x7F81, 0x7F80  # a signalling NaN, +inf
        save_file(sd, f, metadata={"format": "pt"})

    return once(shared_dir / "gguf-llama-bf16-nan", make) / "model"


# q8_0: test_chunks_span_rows_heads_and_experts, in one-row chunks
@pytest.mark.parametrize("outtype", ["bf16", "f32", "f16"])
def test_bf16_source_same_file(bf16_llama, tmp_path, outtype):
    ref = gguf_models.convert_reference(bf16_llama, tmp_path / "ref.gguf", outtype)
    out = tmp_path / "ours.gguf"
    r = json.loads(run_cli("-q", "convert", bf16_llama, "--to", "gguf", "-o", out, "--outtype", outtype,
                           "--json").stdout)
    assert out.read_bytes() == ref.read_bytes()
    _all_by_recipes(r)


def _all_by_recipes(r: dict) -> None:
    w = r["written"]
    assert w["in_chunks"] == r["tensors"] and w["by_converter"] == [] and not w["recipes_disproven"]
    assert {"blk.{L}.ffn_gate.weight", "blk.{L}.attn_q.weight", "token_embd.weight"} <= set(w["recipes_proven"])
    assert "by ffn-tools' recipes" in r["summary"]


@pytest.mark.parametrize("arch,dtype,outtype", [("mixtral", torch.bfloat16, "q8_0"),
                                                ("llama", torch.float16, "bf16"),
                                                ("gemma2", torch.bfloat16, "bf16"),  # plus-one norms
                                                ("gemma2", torch.float16, "q8_0")])  # plus one in float16
def test_experts_and_f16_sources_same_file(gguf_model, tmp_path, arch, dtype, outtype):
    src = gguf_model(arch, dtype)
    ref = gguf_models.convert_reference(src, tmp_path / "ref.gguf", outtype)
    out = tmp_path / "ours.gguf"
    r = json.loads(run_cli("-q", "convert", src, "--to", "gguf", "-o", out, "--outtype", outtype, "--json").stdout)
    assert out.read_bytes() == ref.read_bytes()
    assert r["written"]["in_chunks"] == r["tensors"] and not r["written"]["recipes_disproven"]


def test_chunks_span_rows_heads_and_experts(bf16_llama, tmp_path, monkeypatch):
    """With chunks of 896 source bytes (7 rows of gate and up, the last of 5; 4 of down; one head for q/k), a
    tensor is written in many pieces, as a large model's are: the bf16 Llama (a NaN and an infinity in its gate)
    to q8_0, the file still the converter's. The chunked writer runs in this process, where CHUNK is set
    (``writer`` runs it in a second process otherwise)."""
    monkeypatch.setattr(native, "CHUNK", 7 * 64 * 2)
    spawn = writer._run

    def here(request: dict, module: str = "worker") -> dict:
        if module != "native":
            return spawn(request, module)
        return {"written": native.write(request["tensors"], Path(request["out"]))}

    monkeypatch.setattr(writer, "_run", here)
    ref = gguf_models.convert_reference(bf16_llama, tmp_path / "ref.gguf", "q8_0")
    r = json.loads(run_cli("-q", "convert", bf16_llama, "--to", "gguf", "-o", tmp_path / "ours.gguf", "--outtype",
                           "q8_0", "--json").stdout)
    assert (tmp_path / "ours.gguf").read_bytes() == ref.read_bytes()
    _all_by_recipes(r)
    q = {"op": "rotary", "heads": 4, "sources": [{"file": "", "start": 0, "dtype": "BF16", "shape": [64, 64]}]}
    assert [(r0, r1) for _, r0, r1, _ in native.pieces(q)] == [(0, 16), (16, 32), (32, 48), (48, 64)]  # whole heads
    gate = {"op": "copy", "heads": None, "sources": [{"file": "", "start": 0, "dtype": "BF16", "shape": [96, 64]}]}
    assert [(r0, r1) for _, r0, r1, _ in native.pieces(gate)][-2:] == [(84, 91), (91, 96)]  # 14 pieces, a short last


def test_generated_tensor_by_converter_and_unproven_recipes_said(gguf_model, tmp_path, monkeypatch):
    """Llama 3.1 rope scaling: the converter generates ``rope_freqs.weight`` (no source tensor), so the converter
    writes it; with no tensor small enough to prove a recipe on, the summary names every class not proven."""
    src = gguf_models.copy_model(gguf_model("llama", torch.bfloat16), tmp_path / "model")
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (src / "config.json").write_text(json.dumps(cfg))
    ref = gguf_models.convert_reference(src, tmp_path / "ref.gguf", "bf16")
    r = json.loads(run_cli("-q", "convert", src, "--to", "gguf", "-o", tmp_path / "a.gguf", "--outtype", "bf16",
                           "--json").stdout)
    assert (tmp_path / "a.gguf").read_bytes() == ref.read_bytes()
    assert r["written"]["by_converter"] == ["rope_freqs.weight"]
    monkeypatch.setenv("FFN_TOOLS_GGUF_CHECK_LIMIT", "0")
    r = json.loads(run_cli("-q", "convert", src, "--to", "gguf", "-o", tmp_path / "b.gguf", "--outtype", "bf16",
                           "--json").stdout)
    assert (tmp_path / "b.gguf").read_bytes() == ref.read_bytes()
    assert r["written"]["recipes_proven"] == [] and "blk.{L}.ffn_up.weight" in r["written"]["recipes_not_proven"]
    assert "not checked against the converter's bytes" in r["summary"]


def test_mixed_source_dtypes(gguf_model, tmp_path):
    """A float16 tensor in a bfloat16 model is read as it lies; a float64 one is not a type the recipes read, so
    the converter writes it (its own cast); the file is still the converter's."""
    src = gguf_models.copy_model(gguf_model("llama", torch.bfloat16), tmp_path / "model")
    (f,) = src.glob("*.safetensors")
    sd = load_file(f)
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].to(torch.float16)
    sd["model.layers.1.mlp.down_proj.weight"] = sd["model.layers.1.mlp.down_proj.weight"].to(torch.float64)
    save_file(sd, f, metadata={"format": "pt"})
    ref = gguf_models.convert_reference(src, tmp_path / "ref.gguf", "f16")
    r = json.loads(run_cli("-q", "convert", src, "--to", "gguf", "-o", tmp_path / "a.gguf", "--outtype", "f16",
                           "--json").stdout)
    assert (tmp_path / "a.gguf").read_bytes() == ref.read_bytes()
    assert r["written"]["by_converter"] == ["blk.1.ffn_down.weight"]
    assert r["written"]["in_chunks"] == r["tensors"] - 1


def test_native_writer_refuses_a_wrong_size(tmp_path):
    out = tmp_path / "o.bin"
    out.write_bytes(bytes(64))
    src = tmp_path / "s.bin"
    src.write_bytes(np.ones(8, np.float32).tobytes())
    rec = {"op": "copy", "heads": None, "sources": [{"file": str(src), "start": 0, "dtype": "F32", "shape": [8]}]}
    with pytest.raises(ValueError, match="the header says 16"):
        native.write([{"name": "x", "offset": 0, "type": "F32", "bytes": 16, "recipe": rec}], out)
    assert native.write([{"name": "x", "offset": 32, "type": "F16", "bytes": 16, "recipe": rec}], out) == 16
    assert np.frombuffer(out.read_bytes()[32:48], np.float16).tolist() == [1.0] * 8
    assert os.path.getsize(out) == 64
