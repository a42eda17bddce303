"""``ffn-tools verify`` on real transformers checkpoints: it catches planted defects, passes every correct
conversion the toolkit makes (in float32, float16 and bfloat16, on every backend available here), and
refuses bad input with exit status 2.

Defects are planted in copies written with ``safetensors.torch.save_file`` (the shared fixture directories
are never modified). Inputs are small (4 tokens, tiny models) so the Triton interpreter stays quick.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from click.testing import CliRunner
from helpers import plant, run_cli
from safetensors.torch import load_file, save_file
from tiny_models import COMMON

from ffn_tools.cli import cli
from ffn_tools.layouts import GateUpLayout, fuse, split
from ffn_tools.tolerances import tolerance_for
from ffn_tools.verification.functional import SAME_AS_A, compare, input_scale, make_inputs, nonfinite_values

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
L1 = "model.layers.1.mlp."
# Skipped by capability only (the framework itself missing, as on a platform without an mlx wheel): our own
# converters/mlx and converters/flax are always there, and must import wherever their framework does.
HAS_MLX = all(importlib.util.find_spec(m) is not None for m in ("mlx", "mlx_lm"))
HAS_FLAX = all(importlib.util.find_spec(m) is not None for m in ("jax", "flax"))
needs_mlx = pytest.mark.skipif(not HAS_MLX, reason="mlx or mlx_lm is not installed (the mlx-cpu / mlx extra)")
needs_flax = pytest.mark.skipif(not HAS_FLAX, reason="jax or flax is not installed (the flax extra)")


def verify(*args, tokens: int = 4):
    """Run ``ffn-tools verify ARGS --tokens N`` in-process; return (exit code, stdout)."""
    r = CliRunner().invoke(cli, ["verify", *map(str, args), "--tokens", str(tokens)])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    return r.exit_code, r.stdout


def verify_json(*args, tokens: int = 4):
    code, out = verify(*args, "--json", tokens=tokens)
    return code, json.loads(out)


def assert_passes(*args, tokens: int = 4, loads: bool = True) -> dict:
    """verify passes on every kernel backend available here (``--backend all``); ``loads=False``: B is a form
    transformers would not load (a split Phi-3, a fused Llama), which fails verify's load check alone, and passes
    with --no-load-check."""
    args = (*args, "--backend", "all")
    if not loads:
        code, rep = verify_json(*args, tokens=tokens)
        assert code == 1 and rep["load_check"]["ok"] is False, rep["failures"]
        assert all(f.startswith("B would load in transformers") for f in rep["failures"]), rep["failures"]
        args = (*args, "--no-load-check")
    code, rep = verify_json(*args, tokens=tokens)
    assert code == 0, "\n".join(rep["failures"])
    assert rep["passed"] and rep["ffns"]
    from ffn_tools import kernels

    assert rep["backends"] == kernels.available_backends()  # every backend that can run here, ran
    return rep


def assert_fails(*args, where: str, exit_code: int = 1) -> str:
    code, out = verify(*args)
    assert code == exit_code, out
    assert "FAIL" in out and where in out, out
    return out


@pytest.fixture(scope="module")
def square_llama(tmp_path_factory):
    """A bf16 Llama with d_model == d_ffn (intermediate_size == hidden_size): a transposed down fits."""
    import transformers

    cfg = transformers.LlamaConfig(**{**COMMON, "intermediate_size": COMMON["hidden_size"]})
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("square") / "llama"
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


# ---------------------------------------------------------------- no false alarms: every correct conversion


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_and_fuse_pass_bit_identical(model_dir, tmp_path, dtype):
    phi3, llama = model_dir("phi3", dtype), model_dir("llama-bias", dtype)
    run_cli("split-gateup", phi3, "-o", tmp_path / "split")
    run_cli("fuse-gateup", tmp_path / "split", "-o", tmp_path / "back")
    run_cli("fuse-gateup", llama, "-o", tmp_path / "fused")
    for a, b, loads in ((phi3, tmp_path / "split", False), (tmp_path / "split", tmp_path / "back", True),
                        (llama, tmp_path / "fused", False)):
        rep = assert_passes(a, b, loads=loads)
        assert {f["exact"] for f in rep["ffns"]} == {"identical"}
        assert rep["outside"]["identical"] > 0 and rep["outside"]["passed"]
    # rep: the fused Llama's (the loop's last), which says the path each backend ran
    paths = {b["backend"]: b["path"] for b in rep["ffns"][0]["backends"]}
    assert paths.pop("reference") == SAME_AS_A  # bit-identical weights: the float64 output is A's
    assert set(paths.values()) <= {"fused concat, gate-up"}  # B's fused gate_up ran through silu_mul_fused


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [("concat", "up-gate", None), ("interleaved", "gate-up", None),
                                    ("interleaved", "up-gate", None), ("tp", "gate-up", 2), ("tp", "up-gate", 4)],
                         ids=lambda v: "-".join(str(x) for x in v if x))
def test_every_layout_passes(model_dir, tmp_path, dtype, layout):
    arrangement, order, tp = layout
    opts = ["--layout", arrangement, "--order", order] + (["--tp", tp] if tp else [])
    src = model_dir("llama-bias", dtype)
    run_cli("fuse-gateup", src, "-o", tmp_path / "fused", *opts)
    run_cli("split-gateup", tmp_path / "fused", "-o", tmp_path / "back", *opts)
    rep = assert_passes(src, tmp_path / "fused", *opts, loads=False)
    path = {b["backend"]: b["path"] for b in rep["ffns"][0]["backends"]}.get("triton")
    if path:
        assert path == ("ffn" if arrangement == "tp" else f"fused {arrangement}, {order}")
    assert_passes(tmp_path / "fused", tmp_path / "back", *opts)
    assert_passes(src, tmp_path / "back")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_stacked_per_expert_and_extract_pass(model_dir, tmp_path, dtype):
    qwen, mixtral = model_dir("qwen2_moe", dtype), model_dir("mixtral", dtype)
    run_cli("fuse-gateup", qwen, "--stack-experts", "-o", tmp_path / "stacked")
    run_cli("fuse-gateup", mixtral, "-o", tmp_path / "fused")
    run_cli("extract", qwen, "-o", tmp_path / "ffn")
    rep = assert_passes(qwen, tmp_path / "stacked")
    assert len(rep["ffns"]) == 10  # 2 layers x (4 experts + shared)
    assert_passes(mixtral, tmp_path / "fused", loads=False)
    assert_passes(tmp_path / "ffn", qwen)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cast_and_geglu_pass(model_dir, tmp_path, dtype):
    """A dtype cast is a correct conversion: no exact check, the coarser dtype's tolerance."""
    src = model_dir("llama", torch.float32)
    run_cli("convert", src, "--to", "torch", "--dtype", str(dtype).removeprefix("torch."), "-o", tmp_path / "cast")
    rep = assert_passes(src, tmp_path / "cast")
    assert rep["tolerance"]["row"] == str(dtype).removeprefix("torch.")
    ref = next(b for b in rep["ffns"][0]["backends"] if b["backend"] == "reference")
    if dtype != torch.float32:  # B's own rounded weights: the reference runs on them
        assert ref["path"] == "ffn (float64)" and ref["max_abs"] > 0
    else:  # a float32 -> float32 "cast" copies the bits: A's output is B's
        assert ref["path"] == SAME_AS_A and ref["max_abs"] == 0
    gemma = model_dir("gemma", dtype)
    rep = assert_passes(gemma, gemma)
    assert "GeGLU (gelu_pytorch_tanh)" in rep["a"]["activation"]


def test_sharded_and_pickled_copies_pass(model_dir):
    src = model_dir("llama-bias", torch.bfloat16)
    assert_passes(src, model_dir("llama-bias", torch.bfloat16, max_shard_size="100KB"))
    rep = assert_passes(model_dir("llama-bias", torch.bfloat16, safe_serialization=False), src)
    assert rep["a"]["format"] == "pickle" and {f["exact"] for f in rep["ffns"]} == {"identical"}


@needs_mlx
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quant", [None, ("4", "32"), ("8", "64")], ids=["plain", "q4g32", "q8g64"])
def test_mlx_conversions_pass(model_dir, tmp_path, dtype, quant):
    src = model_dir("qwen3_moe" if quant == ("8", "64") else "llama", dtype)
    q = ["--quantize", quant[0], "--group-size", quant[1]] if quant else []
    run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "mlx", *q)
    rep = assert_passes(src, tmp_path / "mlx")
    # plain: A's bits; quantized: A re-quantized gives B's bytes (the codes, not the same bits)
    assert {f["exact"] for f in rep["ffns"]} == {"requantized" if quant else "identical"}
    assert rep["load_check"]["client"] == "mlx_lm" and rep["load_check"]["ok"]
    o = rep["outside"]
    assert o["passed"] and not o["only_a"] and not o["only_b"]
    assert (o["requantized"] > 0) == bool(quant) and o["within_tolerance"] == 0  # plain: bits; quantized: requant
    if quant:
        assert rep["tolerance"]["row"].endswith(f"{quant[0]}-bit")


@needs_flax
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flax_layout", ["hf", "linen"])
def test_flax_conversions_pass(model_dir, tmp_path, dtype, flax_layout):
    src = model_dir("llama-bias" if flax_layout == "hf" else "mixtral", dtype)
    run_cli("convert", src, "--to", "flax", "--flax-layout", flax_layout, "-o", tmp_path / "flax")
    rep = assert_passes(src, tmp_path / "flax")
    assert {f["exact"] for f in rep["ffns"]} == {"identical"}


# ---------------------------------------------------------------- planted defects: each must fail


_ATTN = "model.layers.0.self_attn.o_proj.weight"
_NORM = "model.layers.1.input_layernorm.weight"


@pytest.mark.parametrize("defect, where", [
    (lambda sd: sd.__setitem__(_ATTN, torch.zeros_like(sd[_ATTN])), f"outside FFNs: {_ATTN}"),
    (lambda sd: sd.__setitem__(_NORM, torch.zeros_like(sd[_NORM])), f"outside FFNs: {_NORM}"),
    (lambda sd: sd.pop(_NORM), f"only in A: {_NORM}"),
    (lambda sd: sd.__setitem__("model.layers.1.post_norm.weight", sd.pop(_NORM)), "only in B: model.layers.1.post_norm"),
], ids=["zeroed-attention", "zeroed-norm", "dropped", "renamed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_outside_defects_fail_naming_the_tensor(model_dir, tmp_path, defect, where, dtype):
    src = model_dir("llama", dtype)
    bad = plant(src, tmp_path / "bad", defect)
    code, rep = verify_json(src, bad)
    assert code == 1 and any(where in f for f in rep["failures"]), rep["failures"]
    assert all(f["passed"] for f in rep["ffns"])  # the FFNs are intact: the accounting alone catches it
    assert verify_json(src, bad, "--ffn-only", "--no-load-check")[0] == 0  # today's scope would pass it
    if "only in" in where:  # the model would also load with a fresh tensor
        assert rep["load_check"]["ok"] is False and _NORM in rep["load_check"]["missing"]


def test_outside_cast_within_tolerance_and_a_zeroed_cast_fails(model_dir, tmp_path):
    src = model_dir("llama", torch.float32)
    run_cli("convert", src, "--to", "torch", "--dtype", "bfloat16", "-o", tmp_path / "cast")
    rep = assert_passes(src, tmp_path / "cast")
    assert rep["outside"]["within_tolerance"] == rep["outside"]["identical"] + rep["outside"]["within_tolerance"] > 0
    bad = plant(tmp_path / "cast", tmp_path / "bad", lambda sd: sd.__setitem__(_ATTN, torch.zeros_like(sd[_ATTN])))
    code, rep = verify_json(src, bad)
    assert code == 1 and any(f.startswith(f"outside FFNs: {_ATTN}") and "cosine" in f for f in rep["failures"])


_EMBED = "model.embed_tokens.weight"


def _perturb_rows(sd):
    """Two elements of the embedding changed far apart (the second and the last blocks) and one row scaled."""
    e = sd[_EMBED]
    e[7, 3] += 1.0  # in the second block (five rows a block)
    e[-2, 5] = -e[-2, 5] + 0.5
    e[e.shape[0] // 2] *= 3.0


@pytest.mark.parametrize("cast", [False, True], ids=["same-dtype", "cast"])
def test_outside_tensors_compared_in_row_blocks_say_what_whole_ones_say(model_dir, tmp_path, monkeypatch, cast):
    """A large tensor outside the FFNs (an embedding) is compared in row blocks read from the files, not held
    whole (with a cast, not as float64 copies of both): the same verdicts, counts, first indices and values
    as the comparison of the whole tensors, for a lossless pair, a cast pair, and each with planted defects."""
    from ffn_tools.io.readers import open_checkpoint
    from ffn_tools.verification import outside

    src = model_dir("llama", torch.float32)
    b = src
    if cast:
        b = tmp_path / "cast"
        run_cli("convert", src, "--to", "torch", "--dtype", "bfloat16", "-o", b)
    bad = plant(b, tmp_path / "bad", _perturb_rows)
    with open_checkpoint(src) as ca, open_checkpoint(b) as cb:
        ia, ib = ca.info(_EMBED), cb.info(_EMBED)
        monkeypatch.setattr(outside, "BLOCK_BYTES", 4 * ia.shape[1] * 5)  # five rows of A a block
        assert outside.in_blocks(ia, ib) and len(list(outside.row_blocks(ia, ib))) > 4
    reports = {}
    for mode, block in (("blocks", outside.BLOCK_BYTES), ("whole", 1 << 40)):
        monkeypatch.setattr(outside, "BLOCK_BYTES", block)
        ok, good = verify_json(src, b, "--no-load-check")
        code, rep = verify_json(src, bad, "--no-load-check")
        assert ok == 0 and code == 1, (good["failures"], rep["failures"])
        reports[mode] = good["outside"], rep["outside"], [f for f in rep["failures"] if _EMBED in f]
    assert reports["blocks"] == reports["whole"]
    (line,) = reports["blocks"][2]
    counts = reports["blocks"][0]
    assert counts["within_tolerance" if cast else "identical"] > 0
    if cast:
        assert f"{_EMBED}[7, 3]" in line and "elements out of tolerance" in line, line
    else:
        assert f"{_EMBED}[7, 3]" in line and f"of {ia.shape[0] * ia.shape[1]} elements differ" in line, line


def test_split_phi3_with_its_config_fails_the_load_check(model_dir, tmp_path):
    src = model_dir("phi3", torch.float32)
    r = run_cli("split-gateup", src, "-o", tmp_path / "split", "--load-check")
    assert "would load in transformers (Phi3ForCausalLM) with 2 tensors newly initialized" in r.output  # split's
    code, out = verify(src, tmp_path / "split")
    assert code == 1 and "B would load in transformers (Phi3ForCausalLM) with 2 tensors newly initialized: " \
        "model.layers.0.mlp.gate_up_proj.weight" in out, out


def _swap(a: str, b: str):
    def edit(sd):
        sd[a], sd[b] = sd[b], sd[a]
    return edit


def test_gate_and_up_swapped_fails_even_without_the_exact_check(model_dir, tmp_path):
    src = model_dir("llama", torch.bfloat16)
    bad = plant(src, tmp_path / "bad", _swap(L1 + "gate_proj.weight", L1 + "up_proj.weight"))
    out = assert_fails(src, bad, where="layer 1: not bit-identical")
    assert "gate and up are swapped" in out
    code, rep = verify_json(src, bad, "--no-exact")  # the functional check alone catches it
    assert code == 1 and [f["ffn"] for f in rep["ffns"] if not f["passed"]] == ["layer 1"]
    assert all(not b["passed"] and b["cosine"] < 0.9 for b in rep["ffns"][0]["backends"])


def test_concat_read_as_interleaved_and_the_reverse_fail(model_dir, tmp_path):
    phi3 = model_dir("phi3", torch.float16)
    run_cli("split-gateup", phi3, "-o", tmp_path / "split")
    assert_fails(tmp_path / "split", phi3, "--layout", "interleaved", where="layer 0")

    def interleave(sd):
        g, u = split(sd[L1 + "gate_up_proj.weight"])
        sd[L1 + "gate_up_proj.weight"] = fuse(g, u, GateUpLayout("gate-up", "interleaved"))

    bad = plant(phi3, tmp_path / "bad", interleave)
    out = assert_fails(phi3, bad, where="layer 1")
    assert "stored as interleaved, gate-up but was read as concat, gate-up" in out
    assert "layer 0 " not in out.split("\n\n")[-1]  # layer 0 is intact
    assert_passes(tmp_path / "split", bad, "--layers", "0")


def test_per_side_layouts_and_the_hint_naming_the_b_flags(model_dir, tmp_path):
    """A concat-fused (Phi-3) against the same weights fused interleaved: --layout would misread A too;
    --b-layout applies to B only, and the hint says so."""
    phi3 = model_dir("phi3", torch.bfloat16)
    run_cli("split-gateup", phi3, "-o", tmp_path / "split")
    run_cli("fuse-gateup", tmp_path / "split", "-o", tmp_path / "inter", "--layout", "interleaved")
    out = assert_fails(phi3, tmp_path / "inter", where="layer 0")
    assert "stored as interleaved, gate-up but was read as concat, gate-up" in out
    assert "pass --b-layout interleaved --b-order gate-up" in out and "pass --layout" not in out
    rep = assert_passes(phi3, tmp_path / "inter", "--b-layout", "interleaved")
    assert {f["exact"] for f in rep["ffns"]} == {"identical"}
    path = {b["backend"]: b["path"] for b in rep["ffns"][0]["backends"]}.get("triton")
    assert path in (None, "fused interleaved, gate-up")
    assert_fails(phi3, tmp_path / "inter", "--layout", "interleaved", where="layer 0")  # both sides: A misread
    # the plain options apply to A only once a --b-* option is given
    assert_passes(tmp_path / "inter", phi3, "--layout", "interleaved", "--b-layout", "concat")
    assert_passes(tmp_path / "inter", tmp_path / "inter", "--layout", "interleaved")  # both sides, as before
    r = CliRunner().invoke(cli, ["verify", str(phi3), str(tmp_path / "inter"), "--b-tp", "2"])
    assert r.exit_code == 2 and "--b-tp needs --b-layout tp" in r.output


def test_selections_naming_what_neither_side_has_exit_2(model_dir):
    qwen = model_dir("qwen2_moe", torch.bfloat16)  # 2 layers, 4 experts and a shared expert each
    for args, message in ((["--experts", "9"], "--experts 9: expert 9 in neither A nor B (they have experts 0-3)"),
                          (["--experts", "2-6"], "experts 4-6 in neither A nor B"),
                          (["--layers", "0-5"], "--layers 0-5: layers 2-5 in neither A nor B (they have layers 0-1)")):
        r = CliRunner().invoke(cli, ["verify", str(qwen), str(qwen), "--tokens", "2", *args])
        assert r.exit_code == 2 and message in r.output and "PASS" not in r.output, r.output
    assert verify(qwen, qwen, "--experts", "3", "--layers", "1")[0] == 0


def test_down_transposed_fails_square_and_not(model_dir, square_llama, tmp_path):
    def transpose(sd):
        sd[L1 + "down_proj.weight"] = sd[L1 + "down_proj.weight"].T.contiguous()

    bad = plant(square_llama, tmp_path / "square", transpose)  # shapes still fit: only the values tell
    out = assert_fails(square_llama, bad, where="layer 1")
    assert "B's down is A's down transposed" in out
    code, rep = verify_json(square_llama, bad, "--no-exact")
    assert code == 1 and [f["ffn"] for f in rep["ffns"] if not f["passed"]] == ["layer 1"]
    src = model_dir("llama")
    out = assert_fails(src, plant(src, tmp_path / "wide", transpose), where="model.layers.1.mlp.")
    assert "inconsistent" in out


def test_two_experts_swapped_fail_naming_both(model_dir, tmp_path):
    src = model_dir("mixtral", torch.float16)
    e = "model.layers.1.block_sparse_moe.experts."

    def edit(sd):
        for w in ("w1", "w2", "w3"):
            _swap(f"{e}1.{w}.weight", f"{e}2.{w}.weight")(sd)

    code, rep = verify_json(src, plant(src, tmp_path / "bad", edit))
    assert code == 1
    assert sorted(f["ffn"] for f in rep["ffns"] if not f["passed"]) == ["layer 1 expert 1", "layer 1 expert 2"]
    assert any("B's layer 1 expert 1 holds A's layer 1 expert 2 weights" in p for p in rep["failures"])


def test_layers_shifted_by_one_fail(model_dir, tmp_path):
    src = model_dir("qwen3", torch.bfloat16)

    def shift(sd):
        for k in sorted(sd, reverse=True):
            for i in (1, 0):
                if f"layers.{i}." in k:
                    sd[k.replace(f"layers.{i}.", f"layers.{i + 1}.")] = sd.pop(k)
                    break

    code, rep = verify_json(src, plant(src, tmp_path / "bad", shift))
    assert code == 1
    assert rep["only_a"] == ["layer 0"] and rep["only_b"] == ["layer 2"]
    assert [f["ffn"] for f in rep["ffns"] if not f["passed"]] == ["layer 1"]
    assert any("B's layer 1 holds A's layer 0 weights" in p for p in rep["failures"])


def test_a_dropped_bias_fails(model_dir, tmp_path):
    src = model_dir("llama-bias", torch.float32)
    bad = plant(src, tmp_path / "bad", lambda sd: sd.pop(L1 + "down_proj.bias"))
    out = assert_fails(src, bad, where="layer 1: biases differ: B lacks down_bias")
    assert "layer 0:" not in out


def test_one_bf16_ulp_fails_the_exact_check_only(model_dir, tmp_path):
    src = model_dir("llama", torch.bfloat16)

    def nudge(sd):
        sd[L1 + "up_proj.weight"].view(torch.int16)[3, 5] += 1  # the next bfloat16 value

    bad = plant(src, tmp_path / "bad", nudge)
    out = assert_fails(src, bad, where="layer 1: not bit-identical: up[3, 5]")
    assert "1 of 6144 elements differ" in out
    assert verify(src, bad, "--no-exact")[0] == 0  # one ulp is far inside every functional tolerance


def test_bf16_cast_to_fp16_with_overflow_fails(model_dir, tmp_path):
    src = plant(model_dir("llama", torch.bfloat16), tmp_path / "big",
                lambda sd: sd[L1 + "gate_proj.weight"].__setitem__((2, 3), 1e5))  # fine in bf16, inf in fp16
    run_cli("convert", src, "--to", "torch", "--dtype", "float16", "-o", tmp_path / "fp16")
    out = assert_fails(src, tmp_path / "fp16", where="layer 1: B's gate has 1 inf")
    assert "inf/nan" in out and "layer 0:" not in out


def test_nonfinite_values_calls_a_nan_a_nan():
    t = torch.zeros(6, dtype=torch.float16)
    assert nonfinite_values(t) == ""
    t[0] = float("nan")
    assert nonfinite_values(t) == "1 NaN"  # a NaN is never an overflowing cast
    t[1:3] = float("inf")
    assert nonfinite_values(t) == "1 NaN and 2 inf (overflow in a cast to float16?)"
    assert nonfinite_values(torch.tensor([-float("inf")])) == "1 inf (overflow in a cast to float32?)"


def test_a_nan_weight_is_reported_as_nan(model_dir, tmp_path):
    src = model_dir("llama", torch.bfloat16)
    bad = plant(src, tmp_path / "nan", lambda sd: sd[L1 + "up_proj.weight"].__setitem__((2, 3), float("nan")))
    out = assert_fails(src, bad, where="layer 1: B's up has 1 NaN where A's are finite")
    assert "overflow" not in out


@needs_mlx
def test_mlx_quantized_with_the_wrong_group_size_fails(model_dir, tmp_path):
    import mlx.core as mx

    src = model_dir("llama", torch.bfloat16)
    run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "q4", "--quantize", "4", "--group-size", "32")
    path = tmp_path / "q4" / "model.safetensors"
    arrays = mx.load(str(path))
    w = mx.array(load_file(src / "model.safetensors")[L1 + "up_proj.weight"].float().numpy()).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=64, bits=4)  # config.json still says 32
    arrays.update({L1 + "up_proj.weight": q, L1 + "up_proj.scales": s, L1 + "up_proj.biases": b})
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})
    out = assert_fails(src, tmp_path / "q4", where="model.layers.1.mlp.up_proj")
    assert "B cannot be read" in out and "model.layers.0" not in out


@needs_mlx
def test_mixed_quantization_gets_a_row_per_ffn(model_dir, tmp_path):
    # A mixed recipe (as mlx_lm.convert --quant-predicate mixed_3_6 writes): per-module entries in the
    # quantization block override its global 4 bits. Layer 0: gate/up 3-bit, down 6-bit (coarsest: 3); layer 1
    # left unquantized (``false``), so it is checked bit for bit at its dtype's row, not the global 4-bit one.
    import mlx.core as mx

    src = model_dir("llama", torch.bfloat16)
    out = tmp_path / "mixed"
    run_cli("convert", src, "--to", "mlx", "-o", out, "--quantize", "4", "--group-size", "32")
    path, orig = out / "model.safetensors", load_file(src / "model.safetensors")
    arrays, cfg = mx.load(str(path)), json.loads((out / "config.json").read_text())
    for layer, proj, bits in [(0, "gate_proj", 3), (0, "up_proj", 3), (0, "down_proj", 6),
                              (1, "gate_proj", False), (1, "up_proj", False), (1, "down_proj", False)]:
        module = f"model.layers.{layer}.mlp.{proj}"
        w = mx.array(orig[f"{module}.weight"].float().numpy()).astype(mx.bfloat16)
        if bits:
            q, sc, b = mx.quantize(w, group_size=32, bits=bits)
            arrays.update({f"{module}.weight": q, f"{module}.scales": sc, f"{module}.biases": b})
        else:
            arrays[f"{module}.weight"] = w
            del arrays[f"{module}.scales"], arrays[f"{module}.biases"]
        cfg["quantization"][module] = {"group_size": 32, "bits": bits} if bits else False
    cfg["quantization_config"] = cfg["quantization"]
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg))
    index = json.loads((out / "model.safetensors.index.json").read_text())  # keep the index true to the file
    index["weight_map"] = dict.fromkeys(sorted(arrays), "model.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps(index))

    rep = assert_passes(src, out)
    assert rep["tolerance"]["row"] == "bfloat16 3-bit"  # the loosest, for --logits
    by_layer = {f["layer"]: f for f in rep["ffns"]}
    l0, l1 = by_layer[0], by_layer[1]
    assert (l0["bits_a"], l0["bits_b"], l0["tolerance"]["row"]) == (None, 3, "bfloat16 3-bit")
    assert (l1["bits_b"], l1["tolerance"]["row"], l1["exact"]) == (None, "bfloat16", "identical")
    assert by_layer[0]["exact"] == "requantized"  # its 3- and 6-bit modules are A's re-quantized
    assert rep["b"]["quantization"] == "4-bit group 32 (per-module entries: 2 at 3-bit, 1 at 6-bit, 3 unquantized)"
    assert any("(1 of 2 FFNs)" in n for n in rep["notes"])
    code, text = verify(src, out)
    assert code == 0 and "tolerance per FFN" in text and "tolerance row" in text, text
    assert any(line.startswith("layer 0") and line.endswith("bfloat16 3-bit") for line in text.splitlines()), text
    assert any(line.startswith("layer 1") and line.endswith("bfloat16") for line in text.splitlines()), text


def test_activation_mismatch_fails(model_dir, tmp_path):
    src = model_dir("gemma")
    bad = plant(src, tmp_path / "silu", config=lambda c: c.update(hidden_act="silu", hidden_activation="silu"))
    out = assert_fails(src, bad, where="activation differs: A GeGLU (gelu_pytorch_tanh), B SwiGLU (silu)")
    assert "layer 0" in out and "layer 1" in out  # and the outputs differ too


def test_activation_mismatch_fails_on_the_reference_backend_alone(model_dir, tmp_path):
    """Bit-identical weights, other activation: B's float64 output is computed with B's activation, not
    taken over from A's (which would show every FFN as 0.0 ok)."""
    src = model_dir("gemma", torch.float32)
    bad = plant(src, tmp_path / "silu", config=lambda c: c.update(hidden_act="silu", hidden_activation="silu"))
    code, rep = verify_json(src, bad, "--backend", "reference")
    assert code == 1 and rep["ffns"]
    for f in rep["ffns"]:
        assert f["exact"] == "identical" and not f["passed"], f
        (ref,) = f["backends"]
        assert ref["path"] != SAME_AS_A and not ref["passed"] and ref["max_abs"] > 0, ref


# ---------------------------------------------------------------- bad input


def test_different_models_say_which_shapes_differ(model_dir, tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(**{**COMMON, "intermediate_size": 128})
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "wider")
    out = assert_fails(model_dir("llama"), tmp_path / "wider", where="shapes differ: A has d_model 64, d_ffn 96; "
                                                                       "B has d_model 64, d_ffn 128")
    assert "layer 0" in out and "layer 1" in out
    assert_fails(model_dir("llama"), model_dir("qwen2_moe"), where="no FFN in common")


@pytest.mark.parametrize("args, message", [
    (["--backend", "cuda"], "unknown backend 'cuda'"),
    (["--backend", "metal"], "backend 'metal' is not available here: "),
    (["--layers", "7"], "--layers 7: layer 7 in neither A nor B (they have layers 0-1)"),
    (["--experts", "0"], "--experts 0: expert 0 in neither A nor B (they have no routed experts)"),
    (["--layers", "x"], "cannot read selection"),
    (["--logits", "ffn"], "--logits: B"),
    (["no-ffns"], "B: no gated FFN tensors found"),
    (["relu"], "activation 'relu' (B) is not one the kernels have"),
])
def test_bad_input_exits_2_saying_why(model_dir, tmp_path, args, message):
    from ffn_tools import kernels

    if args == ["--backend", "metal"] and kernels.get_backend("metal").available():
        pytest.skip("Metal runs here")
    src = model_dir("llama")
    b = src
    if "ffn" in args:
        run_cli("extract", src, "-o", tmp_path / "ffn")
        args, b = ["--logits"], tmp_path / "ffn"
    if "relu" in args:
        args, b = [], plant(src, tmp_path / "relu", config=lambda c: c.update(hidden_act="relu"))
    if "no-ffns" in args:
        save_file({"embed.weight": torch.zeros(4, 4)}, tmp_path / "x.safetensors")
        args, b = [], tmp_path / "x.safetensors"
    r = CliRunner().invoke(cli, ["verify", str(src), str(b), "--tokens", "2", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_client_names_the_runtime_that_judges_b(model_dir):
    """--client transformers (the PyTorch format's runtime) gives the report verify gives without it; a name the
    format does not list is refused (exit 2) naming the runtimes that load it."""
    src = model_dir("llama")
    code, plain = verify_json(src, src, "--seed", "3")
    code_t, named = verify_json(src, src, "--seed", "3", "--client", "transformers")
    assert code == code_t == 0
    assert named["load_check"] == plain["load_check"] and named["failures"] == plain["failures"] == []
    assert [f["exact"] for f in named["ffns"]] == [f["exact"] for f in plain["ffns"]]
    r = CliRunner().invoke(cli, ["verify", str(src), str(src), "--tokens", "2", "--client", "nope"])
    assert r.exit_code == 2, r.output
    assert "--client nope" in r.output or "nope" in r.output
    assert "transformers" in r.output and "Traceback" not in r.output


def test_custom_templates_apply_where_they_match(model_dir, tmp_path):
    """A checkpoint with its own names (like the seed APEX-1's W_gate/W_up/W_down) against the original."""
    src = model_dir("llama", torch.float16)

    def rename(sd):
        for k in [k for k in sd if ".mlp." in k]:
            sd[k.replace("model.layers.", "blocks.").replace(".mlp.", ".ffn.").replace("gate_proj", "W_gate")
               .replace("up_proj", "W_up").replace("down_proj", "W_down")] = sd.pop(k)

    apex = plant(src, tmp_path / "apex", rename)
    t = ["--gate", "blocks.{layer}.ffn.W_gate.weight", "--up", "blocks.{layer}.ffn.W_up.weight",
         "--down", "blocks.{layer}.ffn.W_down.weight"]
    rep = assert_passes(src, apex, *t, loads=False)
    assert (rep["a"]["scheme"], rep["b"]["scheme"]) == ("hf", "custom")
    assert verify(src, apex)[0] == 2  # without the templates B's FFNs cannot be found


# ---------------------------------------------------------------- the report


def test_table_worst_first_then_verdict_and_selection(model_dir, tmp_path):
    src = model_dir("qwen2_moe", torch.bfloat16)
    e = "model.layers.0.mlp.experts.3."
    bad = plant(src, tmp_path / "bad", _swap(e + "gate_proj.weight", e + "up_proj.weight"))
    code, out = verify(bad, src)
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("FFN "))
    assert lines[header + 1].startswith("layer 0 expert 3") and lines[header + 1].endswith("FAIL")
    assert lines[-1].startswith("FAIL: 1 of 10 FFNs differ") and code == 1
    code, rep = verify_json(bad, src, "--experts", "0-2")
    assert code == 0 and len(rep["ffns"]) == 8  # 2 layers x (3 experts + shared)
    assert verify(bad, src, "--layers", "1")[0] == 0


def test_logits_through_the_real_clients(model_dir, tmp_path):
    src = model_dir("llama-bias")
    run_cli("convert", src, "--to", "torch", "--dtype", "bfloat16", "-o", tmp_path / "bf16")
    code, rep = verify_json(src, tmp_path / "bf16", "--logits", "--backend", "reference")
    assert code == 0 and rep["logits"]["client_a"] == rep["logits"]["client_b"] == "transformers"
    assert rep["logits"]["passed"] and rep["logits"]["cosine"] > 0.999
    bad = plant(src, tmp_path / "bad", _swap(L1 + "gate_proj.weight", L1 + "up_proj.weight"))
    code, rep = verify_json(src, bad, "--logits", "--no-exact", "--backend", "reference")
    assert code == 1 and not rep["logits"]["passed"]
    if HAS_MLX:
        run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "mlx")
        code, rep = verify_json(src, tmp_path / "mlx", "--logits", "--backend", "reference")
        assert code == 0 and rep["logits"]["client_b"] == "mlx_lm" and rep["logits"]["top1_agreement"] == 1.0


# ---------------------------------------------------------------- the pieces


def test_inputs_are_exact_in_both_dtypes_and_scaled_by_the_median_row():
    x = make_inputs(64, 32, 0, 1e-3, [torch.bfloat16, torch.float16])  # small: fp16 subnormals
    assert torch.equal(x.to(torch.bfloat16).float(), x) and torch.equal(x.to(torch.float16).float(), x)
    assert torch.equal(x, make_inputs(64, 32, 0, 1e-3, [torch.bfloat16, torch.float16]))
    gate = torch.full((8, 16), 0.25)
    gate[0, 0] = 1e5  # one outlier does not shrink the inputs
    assert input_scale(gate) == pytest.approx(2.0)


def test_tolerance_rows_and_metrics():
    assert tolerance_for([torch.float32, torch.bfloat16]).row == "bfloat16"
    assert tolerance_for([torch.float16], 4).atol == 2.5
    assert tolerance_for([torch.float32], atol=0.5).atol == 0.5
    ref = torch.tensor([1.0, -2.0, 3.0, 0.0], dtype=torch.float64)
    tol = tolerance_for([torch.float16])
    assert compare("x", "", ref.half(), ref, tol).passed
    m = compare("x", "", torch.tensor([1.0, -2.0, 3.1, 0.0]), ref, tol)
    assert not m.passed and m.max_abs == pytest.approx(0.1, rel=1e-5)
    assert not compare("x", "", torch.tensor([1.0, float("inf"), 3.0, 0.0]), ref, tol).passed


def test_cli_constants_match_the_library_and_help_shows_the_table():
    """verify_cli repeats two constants so that `ffn-tools --help` does not import torch."""
    from ffn_tools import kernels
    from ffn_tools.verification import engine as lib
    from ffn_tools.cli import verify as verify_cli

    assert verify_cli.BACKEND_NAMES == ", ".join(kernels.BACKENDS)
    from ffn_tools.ffn import ACTIVATIONS  # every activation a config can name runs on every backend
    assert {k for _, k in ACTIVATIONS.values()} == set(kernels.ACTIVATIONS)
    assert verify_cli.DEFAULT_TOKENS == lib.DEFAULT_TOKENS
    out = CliRunner().invoke(cli, ["verify", "--help"]).output
    assert "bfloat16" in out and "4-bit" in out and "Exit status" in out


def test_kernel_backends_run_one_ffn_of_each_kind_and_the_report_says_so(model_dir, tmp_path):
    from ffn_tools import kernels

    others = [b for b in kernels.available_backends() if b != "reference"]
    if not others:
        pytest.skip("no kernel backend besides the reference here")
    src = model_dir("llama")
    code, rep = verify_json(src, src, "--backend", "all")
    assert code == 0 and rep["coverage"] == {"reference": 2, **dict.fromkeys(others, 1)}
    code, out = verify(src, src, "--backend", "all")
    assert f"ran: reference on all 2 FFNs; {others[0]} on 1" in out and "--all-ffns-on-every-backend" in out
    code, rep = verify_json(src, src, "--all-ffns-on-every-backend", "--backend", "all")
    assert code == 0 and set(rep["coverage"].values()) == {2}
    bad = plant(src, tmp_path / "bad", _swap(L1 + "gate_proj.weight", L1 + "up_proj.weight"))  # the 2nd FFN
    code, rep = verify_json(src, bad, "--backend", "all")
    assert code == 1 and any(f.startswith("layer 1") for f in rep["failures"])  # the reference catches it


def test_by_default_b_s_runtime_s_kernels_run_and_the_others_say_why_not(model_dir, tmp_path):
    """issue 37 item 6: a backend is imported only when it runs; by default the reference and B's runtime's kernels
    that run natively here (an MLX B: mlx; a PyTorch B: Triton on CUDA), each other one named with why it did not."""
    import torch as t

    pytest.importorskip("mlx_lm")
    src = model_dir("llama")
    code, rep = verify_json(src, src)
    assert code == 0 and rep["backends"] == (["reference", "triton"] if t.cuda.is_available() else ["reference"])
    assert "not a kernel transformers runs (--backend jax or --backend all runs it)" in rep["skipped_backends"]["jax"]
    if not t.cuda.is_available():
        assert rep["skipped_backends"]["triton"].startswith("no CUDA device here: Triton would run through its "
                                                            "interpreter on the CPU")
    run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "mlx")
    code, rep = verify_json(src, tmp_path / "mlx")
    assert code == 0 and rep["backends"][:2] == ["reference", "mlx"] and "jax" in rep["skipped_backends"]
    r = run_cli("verify", src, tmp_path / "mlx", "--backend", "jaxx", ok=False)
    assert "unknown backend 'jaxx'; use one of reference, triton, metal, mlx, jax, or all" in r.output


def test_large_ffns_run_on_the_kernel_backends_in_row_blocks(monkeypatch):
    """An FFN larger than KERNEL_BLOCK_BYTES runs on each whole-FFN kernel backend in blocks of rows (its
    framework's copies and intermediates stay a block's): the path says so, the output agrees with the
    unblocked run's and the float64 reference's (biases counted once), and gate and up swapped still fail."""
    from ffn_tools import kernels
    from ffn_tools.verification import functional

    torch.manual_seed(0)
    hidden, inter = 64, 256
    gate, up, down = (torch.randn(*s).bfloat16() * 0.1 for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
    biases = {"gate": torch.randn(inter).bfloat16(), "down": torch.randn(hidden).bfloat16()}
    ops = functional.Operands(gate, up, down, biases, "silu")
    x = functional.make_inputs(8, hidden, 0, 1.0, [torch.bfloat16])
    ref = functional.run_reference(kernels.get_backend("reference"), x, ops)
    tol = tolerance_for([torch.bfloat16], None)
    backends = [n for n in kernels.available_backends() if n not in ("reference", "metal")]
    assert backends, "no kernel backend runs here: triton (interpreter), mlx and jax are in the dev install"
    for name in backends:
        mod = kernels.get_backend(name)
        whole, path = functional.run_backend(mod, x, ops)
        monkeypatch.setattr(functional, "KERNEL_BLOCK_BYTES", ops.nbytes // 4)
        blocked, bpath = functional.run_backend(mod, x, ops)
        swapped, _ = functional.run_backend(mod, x, functional.Operands(up, gate, down, biases, "silu"))
        monkeypatch.undo()
        assert (path, bpath) == ("ffn", "ffn, 4 blocks of 64 rows"), name
        res = functional.compare(name, bpath, blocked, ref, tol)
        assert res.passed and res.ratio < 0.2, (name, res)
        assert torch.allclose(blocked.float(), whole.float(), atol=0.02 * float(ref.square().mean().sqrt()))
        assert not functional.compare(name, bpath, swapped, ref, tol).passed, name


def test_b_split_in_another_layout_than_as_fused_is_named(model_dir, tmp_path):
    """59.5: a Phi-3 split with --layout interleaved failed verify with "8127 of 8192 elements differ" and no
    cause; the hint now names it, as it does for a fused B stored in another layout."""
    phi3 = model_dir("phi3")
    run_cli("split-gateup", phi3, "-o", tmp_path / "inter", "--layout", "interleaved")
    out = assert_fails(phi3, tmp_path / "inter", "--backend", "reference", where="layer 0")
    assert ("B's gate and up are A's gate_up rows split as interleaved, gate-up, where A's are read as concat, "
            "gate-up: B was split in another layout than A's (split A again without that --layout; pass --layout "
            "interleaved --order gate-up if A's gate_up is stored that way)") in out, out
    run_cli("split-gateup", phi3, "-o", tmp_path / "own")
    out = assert_fails(phi3, plant(tmp_path / "own", tmp_path / "swapped", _swap_layer_1), "--backend", "reference",
                       where="layer 1")
    assert "gate and up are swapped" in out and "split as" not in out, out  # another cause, named as before
    assert_passes(phi3, tmp_path / "inter", "--layout", "interleaved", loads=False)  # read as it was split: the same


def _swap_layer_1(sd):
    sd[L1 + "gate_proj.weight"], sd[L1 + "up_proj.weight"] = sd[L1 + "up_proj.weight"], sd[L1 + "gate_proj.weight"]


def test_the_table_prints_no_figures_for_a_reference_not_computed(model_dir):
    """B bit-identical to A: B's output on the reference is A's by construction, not computed; its row prints
    "—" where a measured row prints its figures, and a line says what "—" means."""
    src = model_dir("llama", torch.bfloat16)
    code, out = verify(src, src)
    row = next(ln for ln in out.splitlines() if ln.startswith("layer 1 "))
    assert code == 0 and row.split()[2:7] == ["reference", "—", "—", "—", "—"] and "0.0e+00" not in row, row
    assert ("—: B's output on the reference not computed: its weights are A's bit for bit, so it is A's output "
            "(error 0, cosine 1 by construction, not measured)") in out
    code, rep = verify_json(src, src)
    assert rep["ffns"][-1]["backends"][0]["max_abs"] == 0.0  # --json keeps the figures, with the path saying how


def test_expected_is_derived_once_from_b_client_and_compared_in_one_loop():
    """verify derives what B should hold from A through B's client once (``expected.Expected``): the names the plain
    outside comparison leaves to a transform are the client's stored-otherwise tensors and those B's metadata
    records as read back shifted; each transform's comparison then runs in one loop, in order, into the outside
    result; nothing is derived without FFN pairs, and nothing compared where the outside check was skipped."""
    from ffn_tools.checks.outside import OutsideResult
    from ffn_tools.checks.rounded import PLUS_ONE
    from ffn_tools.verification.expected import Expected, Recorded, Sides, StoredOtherwise, TiedHead

    class Side(dict):
        def __init__(self, tensors, metadata):
            super().__init__(tensors)
            self.metadata = metadata

    calls = []

    class Client:  # a runtime that stores one norm in another form than it reads it
        name = "fake"

        def pairing(self, ca, cb):
            return None

        def stored_otherwise(self, cb):
            return frozenset({"model.norm.weight"})

        def compare_stored_otherwise(self, outside, ca, cb, atol, rtol):
            calls.append((atol, rtol))
            outside.within += 1
            return ["norm compared by the client"]

    ca = Side({"model.norm.weight": torch.ones(4)}, {})
    cb = Side({"model.norm.weight": torch.ones(4)}, {PLUS_ONE: json.dumps({"model.layers.0.norm.weight": 1.0})})
    expected = Expected.derive(Client(), ca, cb, paired=True)
    assert [type(t) for t in expected.transforms] == [StoredOtherwise, Recorded, TiedHead]
    assert expected.pairing is None
    assert expected.left_out() == {"model.norm.weight", "model.layers.0.norm.weight"}
    sides = Sides(ca, cb, 0.5, 0.25, (None, None))
    assert expected.compare_derived(OutsideResult(skipped="--ffn-only"), sides) == [] and calls == []
    outside = OutsideResult(identical=3)
    assert expected.compare_derived(outside, sides) == ["norm compared by the client"]
    assert calls == [(0.5, 0.25)] and outside.within == 1 and outside.passed
    assert Expected.derive(Client(), ca, cb, paired=False).left_out() == frozenset()
    assert expected.a_as_loaded(["model.norm.weight"])[::2] == (frozenset(), None)  # A as stored: no pairing

    class Sanitize:  # B's client computes one of A's FFN tensors when it loads A
        def computed(self, names):
            return {n for n in names if n.endswith("gate_proj.weight")}

        def read(self, name):
            return torch.full((2,), 7.0)

        def describe(self, names):
            return f"computed: {names}"

    loaded = Expected(expected.transforms, Sanitize())
    computed, view, note = loaded.a_as_loaded(["mlp.gate_proj.weight", "mlp.up_proj.weight"])
    assert computed == {"mlp.gate_proj.weight"} and note == "computed: ['mlp.gate_proj.weight']"
    a = view({"mlp.gate_proj.weight": torch.zeros(2), "mlp.up_proj.weight": torch.ones(2)})
    assert torch.equal(a["mlp.gate_proj.weight"], torch.full((2,), 7.0)) and torch.equal(a["mlp.up_proj.weight"], torch.ones(2))
