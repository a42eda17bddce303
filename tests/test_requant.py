"""verify demands a quantized MLX export's bytes: A's tensors re-quantized with B's parameters (``requant``).

Real exports of a tiny transformers Llama, at every bit width and MLX mode, pass with their FFNs identical by
re-quantization; defects the dequantized comparison let through (8 embedding rows shuffled in a 4-bit export:
whole-tensor cosine 0.97; gate and up swapped in a 2-bit export) and one scale nudged by 1% fail, naming
the tensor.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("mlx_lm")
mx = pytest.importorskip("mlx.core")

import ffn_tools  # noqa: E402
from ffn_tools.converters import convert, open_any  # noqa: E402
from ffn_tools.errors import CheckpointError  # noqa: E402
from helpers import run_cli  # noqa: E402

L0 = "model.layers.0.mlp."
EMBED = "model.embed_tokens"


@pytest.fixture(scope="module")
def export(hf, tmp_path_factory):
    """``export(dtype=bf16, bits=None, group_size=None, mode=None, **config) -> Path``: a cached -q export
    (read-only; ``edited`` copies it)."""
    cache: dict = {}

    def get(dtype=torch.bfloat16, bits=None, group_size=None, mode=None, **config) -> Path:
        key = (dtype, bits, group_size, mode, tuple(sorted(config.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp("q") / "mlx"
            convert(hf("llama", dtype, **config), "mlx", out, quantize=True, q_bits=bits, q_group_size=group_size,
                    q_mode=mode)
            cache[key] = out
        return cache[key]

    return get


def edited(src: Path, dst: Path, edit) -> Path:
    """A copy of MLX export ``src`` with ``edit(arrays)`` applied to its weights (metadata kept)."""
    import shutil

    from safetensors import safe_open

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    with safe_open(str(path), "numpy") as f:
        metadata = f.metadata()
    arrays = mx.load(str(path))
    edit(arrays)
    mx.save_safetensors(str(path), arrays, metadata=metadata)
    return dst


def check(a: Path, b: Path):
    return ffn_tools.verify(a, b, backends=["reference"], tokens=4, load_check=False).as_dict()


@pytest.mark.parametrize("bits, group_size, mode", [(2, 32, None), (3, 64, None), (4, 64, None), (8, 32, None),
                                                    (None, None, "mxfp4"), (None, None, "nvfp4"),
                                                    (None, None, "mxfp8")],
                         ids=["q2g32", "q3g64", "q4g64", "q8g32", "mxfp4", "nvfp4", "mxfp8"])
def test_exports_are_a_re_quantized_bit_for_bit(hf, export, bits, group_size, mode):
    out = export(bits=bits, group_size=group_size, mode=mode)
    rep = check(hf("llama", torch.bfloat16), out)
    assert rep["passed"], rep["failures"]
    assert {f["exact"] for f in rep["ffns"]} == {"requantized"}
    assert all(any(n.startswith("re-quantized: A's gate, up") for n in f["notes"]) for f in rep["ffns"])
    o = rep["outside"]
    assert o["requantized"] == 10 and o["within_tolerance"] == 0 and o["passed"]  # embedding, head, attention
    if mode:  # the float modes read back, in the dtype the export quantized in
        with open_any(out) as b:
            w, s, biases, q = b.quantized_parts(L0 + "up_proj.weight")
            assert (q["mode"], q["dtype"], s.dtype, biases) == (mode, "BF16", mx.uint8, None)
            assert b[L0 + "up_proj.weight"].dtype == torch.bfloat16
            assert b.quantized_parts("model.norm.weight") is None


def test_a_legacy_torch_dtype_cast_is_replayed(hf, export):
    # float32 A whose config says torch_dtype bfloat16: export casts to bf16 (MLX's astype), then quantizes;
    # at group 64 down_proj (last dim 96) stays unquantized, a bf16 cast of A's float32 checked bit for bit.
    out = export(torch.float32, 4, 64, torch_dtype="bfloat16")
    rep = check(hf("llama", torch.float32, torch_dtype="bfloat16"), out)
    assert rep["passed"], rep["failures"]
    assert {f["exact"] for f in rep["ffns"]} == {"requantized"}
    assert rep["ffns"][0]["notes"][-1].startswith("re-quantized: A's gate, up quantized with B's parameters "
                                                  "(4-bit affine group 64 in bfloat16)")


@pytest.mark.parametrize("rows", [[7, 6, 5, 4, 3, 2, 1, 0], [1, 0]], ids=["8-reversed", "2-swapped"])
def test_shuffled_embedding_rows_fail_naming_the_row(hf, export, tmp_path, rows):
    # Rows 0..n-1 permuted, codes, scales and biases together. Two swapped rows keep the dequantized embedding
    # within the 4-bit row (whole-tensor cosine above 0.95): only the bytes show them.
    src = hf("llama", torch.bfloat16)
    perm = mx.array([*rows, *range(len(rows), 96)])

    def shuffle(arrays):
        for part in ("weight", "scales", "biases"):
            arrays[f"{EMBED}.{part}"] = arrays[f"{EMBED}.{part}"][perm]

    bad = edited(export(bits=4, group_size=64), tmp_path / "bad", shuffle)
    rep = check(src, bad)
    assert not rep["passed"] and len(rep["outside"]["differ"]) == 1 and all(f["passed"] for f in rep["ffns"])
    line = rep["outside"]["differ"][0]
    assert line.startswith(f"{EMBED}.weight: B is not A re-quantized with B's parameters (4-bit affine group 64 "
                           "in bfloat16): "), line
    assert f"in {len(rows)} of 96 rows; worst row " in line and "< the 4-bit floor 0.9" in line, line


def test_gate_and_up_swapped_in_a_2_bit_export_fail(hf, export, tmp_path):
    src = hf("llama", torch.bfloat16)

    def swap(arrays):
        for part in ("weight", "scales", "biases"):
            g, u = f"{L0}gate_proj.{part}", f"{L0}up_proj.{part}"
            arrays[g], arrays[u] = arrays[u], arrays[g]

    bad = edited(export(bits=2, group_size=32), tmp_path / "bad", swap)
    rep = check(src, bad)
    by_layer = {f["layer"]: f for f in rep["ffns"]}
    assert by_layer[1]["passed"] and by_layer[0]["exact"] == "differs"
    problem = by_layer[0]["problems"][0]
    assert problem.startswith(f"gate ({L0}gate_proj.weight): B is not A re-quantized with B's parameters (2-bit "
                              "affine group 32 in bfloat16): "), problem
    assert "< the 2-bit floor 0.4 (up differs too)" in problem and problem.endswith(
        "; B's gate is A's up re-quantized; B's up is A's gate re-quantized"), problem
    code = run_cli("verify", src, bad, "--backend", "reference", "--no-load-check", "--tokens", "4", ok=None)
    assert code.exit_code == 1 and f"  - layer 0: gate ({L0}gate_proj.weight): B is not A" in code.output


def test_one_scale_nudged_fails_where_dequantized_checks_pass(hf, export, tmp_path):
    src = hf("llama", torch.bfloat16)
    up = "model.layers.1.mlp.up_proj.scales"

    def nudge(arrays):
        s = arrays[up]
        arrays[up] = mx.where(mx.arange(s.size).reshape(s.shape) == 5, s * 1.01, s)

    rep = check(src, edited(export(bits=4, group_size=64), tmp_path / "bad", nudge))
    layer1 = next(f for f in rep["ffns"] if f["layer"] == 1)
    assert all(b["passed"] for b in layer1["backends"])  # within the 4-bit row: only the bytes show it
    problem = layer1["problems"][0]
    assert problem.startswith("up (model.layers.1.mlp.up_proj.weight): B is not A re-quantized") and \
        "0 of 6144 codes, 1 of 96 scales, 0 of 96 biases differ, in 1 of 96 rows; it is above the 4-bit floor" \
        in problem, problem


@pytest.mark.parametrize("block, words", [
    ({"mode": "int3"}, "quantization mode 'int3' is not one MLX dequantizes (affine, mxfp4, nvfp4, mxfp8)"),
    ({"mode": "mxfp4"}, "mode mxfp4 stores 8-bit scales (U8) and no biases, but found .scales BF16 and .biases"),
])
def test_a_mode_that_does_not_fit_the_tensors_is_refused(export, tmp_path, block, words):
    import shutil

    out = tmp_path / "q"
    shutil.copytree(export(bits=4, group_size=64), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization"].update(block)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=re.escape(words)):
        open_any(out)


def test_importing_verification_does_not_import_mlx():
    code = "import sys, ffn_tools.verification.pairs, ffn_tools.verification.outside; print('mlx' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_a_dtype_mlx_lacks_lets_the_row_floor_decide():
    from ffn_tools.converters.mlx.quant import torch_to_mx
    from ffn_tools.converters.mlx.requant import check_requantized

    torch.manual_seed(0)
    a = (torch.randn(32, 64) * 0.5).to(torch.float8_e4m3fn)  # read through float32: bits not guaranteed
    w, s, b = mx.quantize(torch_to_mx(a.float()).astype(mx.bfloat16), 32, 4)
    q = {"group_size": 32, "bits": 4, "mode": "affine", "dtype": "BF16"}
    assert check_requantized("t", a, (w, s, b, q)) == ("identical", None)
    outcome, note = check_requantized("t", a, (w, mx.where(mx.arange(s.size).reshape(s.shape) == 3, s * 1.01, s), b, q))
    assert outcome == "within" and "A is float8_e4m3fn, which MLX has no dtype for" in note, note
    flip = mx.array([1, 0, *range(2, 32)])
    outcome, why = check_requantized("t", a, (w[flip], s[flip], b[flip], q))
    assert outcome == "differs" and "so the bits are not reproducible and the 4-bit row floor 0.9 decides" in why \
        and why.endswith("< 0.9"), why


@pytest.mark.parametrize("bits, group_size, mode", [(2, 64, "affine"), (3, 64, "affine"), (4, 128, "affine"),
                                                    (5, 128, "affine"), (6, 128, "affine"), (8, 128, "affine"),
                                                    (4, 32, "mxfp4"), (4, 16, "nvfp4"), (8, 32, "mxfp8")])
def test_correct_quantizations_clear_the_row_floors(bits, group_size, mode):
    # heavy-tailed rows (Student-t, 3 degrees of freedom; the docstring's table has the worst cases measured)
    from ffn_tools.converters.mlx.quant import torch_to_mx
    from ffn_tools.converters.mlx.requant import _row_cosines, row_floor

    torch.manual_seed(0)
    a = torch_to_mx((torch.distributions.StudentT(3.0).sample((2000, 512)) * 0.02).to(torch.bfloat16))
    parts = mx.quantize(a, group_size, bits, mode=mode)
    cos = _row_cosines(a.astype(mx.float32), mx.dequantize(*parts, group_size=group_size, bits=bits, mode=mode,
                                                          dtype=mx.float32))
    assert mx.min(cos).item() >= row_floor(bits)
