"""The FFN's real function: clamped gated units read from config.json and run by every kernel backend, checked
against the clients' own modules (transformers' GptOssExperts and DeepSeek-V4 MLP/experts, mlx_lm's swiglu_oai).

GPT-OSS's experts do not run SwiGLU: ``gate.clamp(max=7)``, ``up.clamp(-7, 7)``, ``gate * sigmoid(1.702 gate)``,
``(up + 1) * glu``; DeepSeek-V4 clamps the same way around its hidden_act. Inputs are scaled so the clamps cut in
(asserted), and each check also shows that plain SwiGLU would not pass it.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from helpers import run_cli

import zoo
from ffn_tools import kernels
from ffn_tools.detect import find_ffns
from ffn_tools.ffn import activation_from_config, canonical_weights
from ffn_tools.io.readers import open_checkpoint
from ffn_tools.kernels import GLU, reference
from ffn_tools.kernels.tolerances import compare, tolerance

pytest.importorskip("transformers")


def backend_params():
    out = []
    for name in kernels.BACKENDS:
        mod = kernels.get_backend(name)
        out.append(pytest.param(name, id=name, marks=pytest.mark.skipif(not mod.available(), reason=mod.why_unavailable())))
    return out


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(path, model): the tiny GPT-OSS transformers builds, saved with save_pretrained (float32)."""
    path = tmp_path_factory.mktemp("gpt-oss") / "model"
    return path, zoo.build("gpt_oss", path)


def _expert(path, layer: int, expert: int):
    with open_checkpoint(path) as ckpt:
        ffns = find_ffns(ckpt)
        (ffn,) = [f for f in ffns.ffns if (f.ref.layer, f.ref.kind, f.ref.expert) == (layer, "expert", expert)]
        w = {k: v.clone() for k, v in canonical_weights(ckpt, ffn).items()}
    return ffns.activation, w


def test_config_names_the_clamped_variants():
    gpt = activation_from_config({"model_type": "gpt_oss", "hidden_act": "silu", "swiglu_limit": 7.0})
    assert gpt.kernel == GLU("silu", alpha=1.702, limit=7.0, up_offset=1.0)
    assert gpt.describe() == "SwiGLU-clamped (GPT-OSS: alpha 1.702, limit 7, up + 1)"
    mine = activation_from_config({"model_type": "gpt_oss", "swiglu_limit": 5.5, "swiglu_alpha": 2})
    assert mine.kernel == GLU("silu", 2.0, 5.5, 1.0), "the numbers come from config.json"
    v4 = activation_from_config({"model_type": "deepseek_v4", "hidden_act": "silu", "swiglu_limit": 10.0})
    assert v4.kernel == GLU("silu", limit=10.0) and v4.describe() == "SwiGLU-clamped (DeepSeek-V4: silu, limit 10)"
    assert activation_from_config({"model_type": "deepseek_v4", "hidden_act": "gelu_pytorch_tanh"}).kernel == \
        GLU("gelu_tanh", limit=10.0)  # DeepseekV4Config's default limit; the act is the config's
    assert activation_from_config({"model_type": "deepseek_v41", "swiglu_limit": 0}).kernel == GLU("silu")
    bad = activation_from_config({"model_type": "gpt_oss", "hidden_act": "silu", "swiglu_limit": "7"})
    assert bad.unit == "unknown" and bad.describe() == "unknown (silu with swiglu_limit='7')"
    assert activation_from_config({"model_type": "llama", "hidden_act": "silu"}).kernel == GLU("silu")


def test_inspect_names_the_clamped_variant(gpt_oss, tmp_path):
    path, _ = gpt_oss
    assert "activation    SwiGLU-clamped (GPT-OSS: alpha 1.702, limit 7, up + 1)" in run_cli("inspect", path).output
    other = tmp_path / "limit5"
    shutil.copytree(path, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "swiglu_limit": 5.0}))
    s = json.loads(run_cli("inspect", other, "--json").stdout)
    assert s["activation"] == "SwiGLU-clamped (GPT-OSS: alpha 1.702, limit 5, up + 1)" and s["gated_unit"] == "SwiGLU"
    r = run_cli("verify", path, other, "--backend", "reference", "--no-load-check", ok=None)
    assert r.exit_code == 1 and "activation differs" in r.output, r.output


@pytest.mark.parametrize("out", ["ffn", "ffn.safetensors"])
def test_an_extract_keeps_the_clamped_unit_and_verifies_against_its_source(gpt_oss, tmp_path, out):
    path, _ = gpt_oss
    run_cli("extract", path, "-o", tmp_path / out, "--layers", "0")
    s = json.loads(run_cli("inspect", tmp_path / out, "--json").stdout)
    assert s["activation"] == "SwiGLU-clamped (GPT-OSS: alpha 1.702, limit 7, up + 1)"
    r = run_cli("verify", path, tmp_path / out, "--backend", "reference", "--layers", "0", ok=None)
    assert r.exit_code == 0 and "activation differs" not in r.output, r.output


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("backend", backend_params())
def test_gpt_oss_expert_matches_transformers(gpt_oss, backend, implementation):
    """One expert through transformers' own GptOssExperts (routing forced to it, weight 1) against the backend's
    ffn() on ffn-tools' canonical weights with the activation read from config.json."""
    path, model = gpt_oss
    activation, w = _expert(path, 1, 2)
    experts = model.model.layers[1].mlp.experts
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(0)) * 30  # pre-activations ~ N(0, 6.7**2)
    gate, up = x @ w["gate"].T + w["gate_bias"], x @ w["up"].T + w["up_bias"]
    assert (gate > 7).float().mean() > 0.1 and (up.abs() > 7).float().mean() > 0.1, "the clamps must cut in"
    experts.config._experts_implementation = implementation
    with torch.no_grad():
        want = experts(x, torch.full((33, 1), 2), torch.ones(33, 1))
    biases = {"gate": w["gate_bias"], "up": w["up_bias"], "down": w["down_bias"]}
    got = kernels.get_backend(backend).ffn(x, w["gate"], w["up"], w["down"], biases, activation=activation.kernel)
    atol, rtol = tolerance(torch.float32, "ffn")
    atol *= float(want.pow(2).mean().sqrt())  # outputs are O(100) at these inputs: atol relative to their RMS
    c = compare(got, want, atol, rtol)
    assert c.ok, c.summary()
    plain = reference.ffn(x, w["gate"], w["up"], w["down"], biases, activation="silu")
    assert not compare(plain, want, atol, rtol).ok, "plain SwiGLU must not pass for GPT-OSS"


@pytest.mark.parametrize("backend", backend_params())
def test_gpt_oss_apply_gate_matches_every_backend(gpt_oss, backend):
    """transformers' own _apply_gate on an interleaved gate_up (GPT-OSS's layout) against silu_mul_fused, every dtype."""
    _, model = gpt_oss
    experts = model.model.layers[0].mlp.experts
    glu = activation_from_config(model.config.to_dict()).kernel
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        gate_up = (torch.randn(17, 2 * 96, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
        gate_up[0, :3] = torch.tensor([float("nan"), 100.0, float("nan")])  # gate NaN, up 100, gate NaN
        want = experts._apply_gate(gate_up.float())  # float32: the reference the dtype's rounding is measured from
        got = kernels.get_backend(backend).silu_mul_fused(gate_up, interleaved=True, activation=glu)
        assert got[0, 0].isnan() and got[0, 1].isnan() and want[0, 0].isnan(), "NaN stays NaN through the clamps"
        got, want = got[1:], want[1:]
        c = compare(got, want, *tolerance(dtype))
        assert c.ok, f"{dtype}: {c.summary()}"
        assert not compare(reference.silu_mul_fused(gate_up[1:], interleaved=True), want, *tolerance(dtype)).ok


def test_deepseek_v4_mlp_and_experts_match_transformers():
    """DeepSeek-V4's shared-expert MLP (its forward) and routed experts' _apply_gate against the reference and
    every backend, with the activation read from the config transformers builds."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts, DeepseekV4MLP

    config = zoo.tiny_config("deepseek_v4")
    glu = activation_from_config(config.to_dict()).kernel
    assert glu == GLU("silu", limit=config.swiglu_limit)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlp, experts = DeepseekV4MLP(config).eval(), DeepseekV4Experts(config)
    names = ("gate_proj", "up_proj", "down_proj")
    w = [getattr(mlp, n).weight.detach() for n in names]
    biases = {k: getattr(mlp, n).bias.detach() for k, n in zip(("gate", "up", "down"), names)
              if getattr(mlp, n).bias is not None}
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(2))
    x = x * (20 / float((x @ w[0].T).std()))  # gate pre-activations ~ N(0, 20**2): the limit 10 cuts in
    assert (x @ w[0].T > config.swiglu_limit).float().mean() > 0.1, "the clamp must cut in"
    with torch.no_grad():
        want = mlp(x)
    atol, rtol = tolerance(torch.float32, "ffn")
    atol *= float(want.pow(2).mean().sqrt())
    gate_up = torch.randn(9, 2 * config.intermediate_size, generator=torch.Generator().manual_seed(3)) * 15
    want_gate = experts._apply_gate(gate_up)  # chunk(2): [gate | up]
    for name in kernels.available_backends():
        mod = kernels.get_backend(name)
        c = compare(mod.ffn(x, *w, biases or None, activation=glu), want, atol, rtol)
        assert c.ok, f"{name} ffn: {c.summary()}"
        c = compare(mod.silu_mul_fused(gate_up, activation=glu), want_gate, *tolerance(torch.float32))
        assert c.ok, f"{name} silu_mul_fused: {c.summary()}"
    assert not compare(reference.ffn(x, *w, biases or None), want, atol, rtol).ok


def test_mlx_lm_swiglu_oai_is_the_same_function():
    """mlx_lm's own GPT-OSS activation (activations.swiglu_oai) agrees with the GLU read from the config."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm.models.activations import swiglu_oai

    from ffn_tools.kernels._mlx_io import to_mlx, to_torch

    glu = activation_from_config({"model_type": "gpt_oss", "hidden_act": "silu", "swiglu_limit": 7.0}).kernel
    gen = torch.Generator().manual_seed(4)
    gate, up = torch.randn(2, 7, 129, generator=gen).mul(6).unbind()
    want = to_torch(swiglu_oai(to_mlx(gate), to_mlx(up)).astype(mx.float32))
    c = compare(want, reference.silu_mul(gate, up, activation=glu), *tolerance(torch.float32))
    assert c.ok, c.summary()
