"""prune-experts on more families and forms (issue #56; ``ffn_tools.surgery``): MLX 4-bit switch_mlp stacks,
DeepSeek-V3's sigmoid router and its grouped routing, GPT-OSS's MXFP4 blocks and router bias; and the saliency
scores prune-experts --saliency reads. Helpers and the verify fixture are test_prune's."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli, tensors
from test_prune import TOKENS, _logits, _model, mapped_verify  # noqa: F401  (mapped_verify: a fixture)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe"])
def mlx4(model_dir, tmp_path_factory, request):
    """Qwen3-MoE, Mixtral and Qwen2-MoE (a shared expert beside the routed ones) exported to MLX 4-bit: switch_mlp
    stacks with scales and biases, the router quantized 8-bit."""
    pytest.importorskip("mlx_lm")
    from ffn_tools.api import convert

    out = tmp_path_factory.mktemp("mlx4") / "model"
    convert(model_dir(request.param), "mlx", out, quantize=4)
    return out


def _mlx_logits(path, keep: dict | None = None):
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.utils import load_model  # mlx_lm.load's model, without its tokenizer (the tiny Mixtral has none)

    model, _ = load_model(Path(path))
    for layer, kept in (keep or {}).items():
        block = model.model.layers[int(layer)]
        mlp = getattr(block, "block_sparse_moe", None) or block.mlp  # Mixtral's name in mlx_lm, the others'
        gate = mlp.gate
        mask = mx.array([0.0 if e in kept else float("-inf") for e in range(4)])

        def masked(x, gate=gate, mask=mask):
            out = gate(x)
            return out + mask.astype(out.dtype)

        mlp.gate = masked
    return model(mx.array(TOKENS.tolist()))


def test_prune_mlx_quantized_stacks_bit_for_bit(mlx4, tmp_path, mapped_verify):
    import mlx.core as mx

    keep = {"0": [0, 2, 3], "1": [1, 2, 3]}  # in order: mlx_lm sums the k experts' outputs in the order it picks
    # them, so a reordered model is A's function up to that sum's rounding, a pruned one in order bit for bit
    (tmp_path / "keep.json").write_text(json.dumps(keep))
    run_cli("prune-experts", mlx4, "--keep", tmp_path / "keep.json", "-o", tmp_path / "out")
    a, b = tensors_raw(mlx4), tensors_raw(tmp_path / "out")
    moved = [n for n in a if ".switch_mlp." in n or ".mlp.gate." in n or ".block_sparse_moe.gate." in n]
    assert {n.rsplit(".", 1)[1] for n in moved} == {"weight", "scales", "biases"}
    for n in moved:  # packed codes, scales and biases: the kept experts' slices, as stored
        assert torch.equal(b[n], a[n][keep[n.split(".")[2]]])
    assert all(torch.equal(a[n], b[n]) for n in a if n not in moved)
    assert mx.array_equal(_mlx_logits(tmp_path / "out"), _mlx_logits(mlx4, keep)).item()  # bit for bit in MLX
    assert not mx.allclose(_mlx_logits(tmp_path / "out"), _mlx_logits(mlx4)).item()
    r = mapped_verify(mlx4, tmp_path / "out")
    assert r.exit_code == 0 and "PASS" in r.output, r.output


def tensors_raw(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t for p in sorted(path.glob("*.safetensors")) for n, t in load_file(p).items()}


def test_deepseek_v3_sigmoid_router_bias_in_step(hf, tmp_path):
    """DeepSeek-V3: sigmoid scores plus e_score_correction_bias pick the experts; the bias is sliced with the
    router's rows, the dense first layer and the shared experts are copied. With one expert group, A with the
    dropped experts' selection score masked (their bias -inf) is the pruned model."""
    src = hf("deepseek_v3", n_group=1, topk_group=1)
    run_cli("prune-experts", src, "--drop", "1", "-o", tmp_path / "out")
    a, b = tensors(src), tensors(tmp_path / "out")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(b[bias], a[bias][[0, 2, 3]])
    same = [n for n in a if not n.startswith("model.layers.1.mlp.") or "shared_experts" in n]
    assert any(n.startswith("model.layers.0.mlp.") for n in same) and all(torch.equal(a[n], b[n]) for n in same)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["n_routed_experts"] == 3

    model, info = _model(src)
    assert not _model(tmp_path / "out")[1]["missing_keys"]
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias[1] = float("-inf")
        masked = model(TOKENS).logits
    torch.testing.assert_close(_logits(tmp_path / "out"), masked, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keep,said", [("0-2", "do not divide into 2 groups"), ("0,2", "groups of at least 2")])
def test_deepseek_v3_grouped_routing_refusals(model_dir, tmp_path, keep, said):
    r = run_cli("prune-experts", model_dir("deepseek_v3"), "--keep", keep, "-o", tmp_path / "out", ok=False)
    assert said in r.output


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """GPT-OSS (router with a bias, experts stacked (in, out) with biases) and its MXFP4 twin as OpenAI ships it
    (``*_blocks`` + ``*_scales``): test_mxfp4's."""
    import shutil

    import zoo
    from safetensors.torch import load_file, save_file
    from test_mxfp4 import to_mxfp4

    root = tmp_path_factory.mktemp("gptoss")
    zoo.build("gpt_oss", root / "plain")
    shutil.copytree(root / "plain", root / "mxfp4")
    out = {}
    for k, v in load_file(root / "plain" / "model.safetensors").items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[k + "_blocks"], out[k + "_scales"] = to_mxfp4(v)
        else:
            out[k] = v
    save_file(out, root / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "mxfp4" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (root / "mxfp4" / "config.json").write_text(json.dumps(config))
    return root / "plain", root / "mxfp4"


def test_gpt_oss_mxfp4_blocks_and_router_bias(gpt_oss, tmp_path, mapped_verify):
    plain, packed = gpt_oss
    run_cli("prune-experts", packed, "--drop", "1", "-o", tmp_path / "packed")
    a, b = tensors_raw(packed), tensors_raw(tmp_path / "packed")
    stacked = [n for n in a if ".mlp.experts." in n or ".mlp.router." in n]
    assert any(n.endswith("_blocks") for n in stacked) and any(n.endswith("_scales") for n in stacked)
    assert all(torch.equal(b[n], a[n][[0, 2, 3]]) for n in stacked)  # MXFP4 codes and scales, as stored
    r = mapped_verify(packed, tmp_path / "packed")
    assert r.exit_code == 0 and "PASS" in r.output, r.output

    run_cli("prune-experts", plain, "--drop", "1", "-o", tmp_path / "plain")
    model, _ = _model(plain)
    with torch.no_grad():  # GPT-OSS picks the top-k of its router's logits, then softmaxes them: a -inf bias masks
        for layer in model.model.layers:
            layer.mlp.router.bias[1] = float("-inf")
        masked = model(TOKENS).logits
    torch.testing.assert_close(_logits(tmp_path / "plain"), masked, atol=1e-5, rtol=1e-5)


def test_prune_by_saliency_scores(model_dir, tmp_path):
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"layers": {"0": {"reap": [0.5, 0.1, 0.9, 0.3], "frequency": [1, 9, 9, 9]},
                                             "1": {"reap": [0.2, 0.2, 0.0, 0.7], "frequency": [9, 9, 9, 1]}}}))
    r = json.loads(run_cli("prune-experts", model_dir("mixtral"), "--saliency", scores, "--keep-ratio", "0.75",
                           "-o", tmp_path / "out", "--json").output)
    assert r["layers"] == {"0": [0, 2, 3], "1": [0, 1, 3]}  # the top 3 by REAP score, ties to the lower index
    assert r["kept_share"]["0"] == {"reap": pytest.approx(1.7 / 1.8), "frequency": pytest.approx(19 / 28)}
    assert "layer 0 keeps 67.9% of its routing frequency, the least" in r["changes"][-1]
    r = json.loads(run_cli("prune-experts", model_dir("mixtral"), "--saliency", scores, "--keep-ratio", "0.5",
                           "--score", "frequency", "-o", tmp_path / "f", "--dry-run", "--json").output)
    assert r["layers"] == {"0": [1, 2], "1": [0, 1]} and not (tmp_path / "f").exists()
    r = run_cli("prune-experts", model_dir("mixtral"), "--saliency", scores, "-o", tmp_path / "x", ok=False)
    assert "go together" in r.output


def test_saliency_scores_then_prunes(hf, tmp_path):
    """REAP's score is of the expert's own output: an expert whose down_proj is zero scores 0 though routed to;
    the frequencies of a layer sum to top-k (every token runs k experts)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "model"
    shutil.copytree(hf("mixtral"), src)
    t = load_file(src / "model.safetensors")
    dead = "model.layers.0.block_sparse_moe.experts.{}.w2.weight"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(" ".join(chr(97 + (i * 7 + j) % 26) * 3 for j in range(12)) for i in range(6)))
    first = json.loads(run_cli("saliency", src, "--prompts", prompts, "-o", tmp_path / "s0.json", "--json").stdout)
    routed = max(range(4), key=lambda e: first["layers"]["0"]["frequency"][e])
    t[dead.format(routed)] = torch.zeros_like(t[dead.format(routed)])
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    run_cli("saliency", src, "--prompts", prompts, "-o", tmp_path / "s.json")
    scores = json.loads((tmp_path / "s.json").read_text())
    assert scores["prompts"] == 6 and scores["tokens"] > 0
    for layer in ("0", "1"):
        assert sum(scores["layers"][layer]["frequency"]) == pytest.approx(2.0)
        assert all(v >= 0 for v in scores["layers"][layer]["reap"])
    assert scores["layers"]["0"]["frequency"][routed] > 0 and scores["layers"]["0"]["reap"][routed] == 0.0
    assert first["layers"]["0"]["reap"][routed] > 0
    r = json.loads(run_cli("prune-experts", src, "--saliency", tmp_path / "s.json", "--keep-ratio", "0.5", "-o",
                           tmp_path / "out", "--json").output)
    reap = scores["layers"]["0"]["reap"]
    assert r["layers"]["0"] == sorted(sorted(range(4), key=lambda e: (-reap[e], e))[:2])


def test_fp8_block_scales_move_with_their_experts(model_dir, tmp_path, mapped_verify):
    from test_fp8 import quantize_fp8

    q = quantize_fp8(model_dir("qwen3_moe"), tmp_path / "q")
    run_cli("prune-experts", q, "--drop", "1", "-o", tmp_path / "out")
    a, b = tensors_raw(q), tensors_raw(tmp_path / "out")
    for new, old in enumerate((0, 2, 3)):
        for part in ("gate_proj.weight", "gate_proj.weight_scale_inv", "down_proj.weight"):
            n = f"model.layers.1.mlp.experts.{{}}.{part}"
            assert b[n.format(new)].dtype == a[n.format(old)].dtype
            assert torch.equal(b[n.format(new)].view(torch.uint8), a[n.format(old)].view(torch.uint8))
    r = mapped_verify(q, tmp_path / "out")
    assert r.exit_code == 0 and "PASS" in r.output, r.output
