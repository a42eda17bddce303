"""``verify A B --logits`` of a pruned or reordered B (issue #56 item 4): A runs through its client with the experts
B dropped masked out of its routing (``converters.pytorch.masking``, driven by B's recorded mapping:
``verification.expert_map.masking``), and the routing mass each layer lost is reported; a reordered B's logits
are A's. The prune/reorder/saliency functions through ``ffn_tools.api``."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli
from test_prune import KEEP, TOKENS, _logits, _model

from ffn_tools.verification import expert_map


def _verify(a, b):
    r = run_cli("verify", a, b, "--backend", "reference", "--no-load-check", "--no-side-files", "--tokens", "8",
                "--logits", "--json", ok=None)
    return r, json.loads(r.stdout[r.stdout.index("{"):])


@pytest.fixture(scope="module")
def mixtral(model_dir, tmp_path_factory):
    """Tiny Mixtral, and it pruned by KEEP (different sets per layer, layer 1 reordered too)."""
    root = tmp_path_factory.mktemp("prune-logits")
    (root / "keep.json").write_text(json.dumps(KEEP))
    run_cli("prune-experts", model_dir("mixtral"), "--keep", root / "keep.json", "-o", root / "pruned")
    return model_dir("mixtral"), root / "pruned"


def test_masking_is_driven_by_the_recorded_mapping(mixtral, model_dir, tmp_path):
    src, pruned = mixtral
    m = expert_map.masking(src, pruned)
    assert m is not None and m.dropped == {0: (1,), 1: (2,)} and not m.ungrouped and m.row == "float32"
    assert expert_map.masking(src, src) is None  # B records no mapping: A runs as it is
    run_cli("prune-experts", pruned, "--keep", "0,2", "-o", tmp_path / "twice")  # of B's, i.e. source 0,3 / 3,0
    assert expert_map.masking(src, tmp_path / "twice").dropped == {0: (1, 2), 1: (1, 2)}
    assert expert_map.masking(pruned, tmp_path / "twice").dropped == {0: (1,), 1: (1,)}  # A's own indices


def test_client_masking_is_the_pruned_model(mixtral):
    """The client's masking gives what the routers' own code gives run masked by hand (test_prune), and the
    pruned model's logits; the routing mass lost is the share of layer 0's top-k weight on its dropped expert."""
    from ffn_tools.converters.pytorch.masking import masked_logits

    src, pruned = mixtral
    dropped = {0: (1,), 1: (2,)}
    masked, problems, lost, mass = masked_logits(src, TOKENS, None, dropped, False)
    assert not problems and set(lost) == {0, 1} and set(mass) == {0, 1}
    torch.testing.assert_close(masked.float(), _logits(src, KEEP), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(masked.float(), _logits(pruned), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(masked.float(), _logits(src), atol=1e-3)

    model, _ = _model(src)
    seen = []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        own = model(TOKENS, output_router_logits=True).router_logits
    _, weights, idx = seen[0]
    share = ((weights * (idx == 1)).sum(-1) / weights.sum(-1)).double().mean()
    assert 0 < lost[0] < 1 and lost[0] == pytest.approx(float(share), rel=1e-6)
    # the routing mass B dropped: A's own (unmasked) router probability on the dropped experts, every token
    for layer, experts in dropped.items():
        p = own[layer].double().softmax(-1)[:, list(experts)].sum(-1)
        assert p.numel() == TOKENS.numel()
        assert mass[layer] == pytest.approx({"mean": float(p.mean()), "max": float(p.max())}, rel=1e-9), layer
        assert 0 < mass[layer]["mean"] < mass[layer]["max"] < 1, layer


def test_verify_logits_of_a_pruned_model_passes_against_masked_a(mixtral):
    src, pruned = mixtral
    r, report = _verify(src, pruned)
    assert r.exit_code == 0, r.output
    lg = report["logits"]
    assert lg["passed"] and lg["max_abs"] < 1e-5 and lg["tolerance"]["row"] == "float32 (logits)"
    assert lg["masked"]["dropped"] == {"0": [1], "1": [2]}
    assert set(lg["masked"]["routing_mass_lost"]) == {"0", "1"}
    assert all(0 < v < 1 for v in lg["masked"]["routing_mass_lost"].values())
    assert "experts B dropped masked" in lg["client_a"] and "routing mass lost" in lg["client_a"]
    em = report["expert_map"]  # the routing mass B dropped, under the expert-map check: information only
    assert em["informational"] and em["tokens"] == lg["shape"][0] * lg["shape"][1]
    assert em["routing_mass_dropped"] == lg["masked"]["routing_mass_dropped"] and set(em["routing_mass_dropped"]) \
        == {"0", "1"} and all(0 < v["mean"] <= v["max"] < 1 for v in em["routing_mass_dropped"].values())
    notes = report["notes"]
    at = next(i for i, n in enumerate(notes) if n.startswith("B records an expert mapping"))
    assert "routing mass B dropped" in notes[at + 1] and "not a pass/fail criterion" in notes[at + 1]
    assert f"layer 0 mean {em['routing_mass_dropped']['0']['mean']:.1%}" in notes[at + 1]


def _none_dropped(src, tmp_path, command: str, flag: str, experts: dict) -> dict:
    """``command`` run on ``src`` with every expert kept in the order ``experts`` (given by ``flag``): the mapping
    drops none, and verify --logits passes it against A; the JSON report."""
    (tmp_path / "experts.json").write_text(json.dumps(experts))
    run_cli(command, src, flag, tmp_path / "experts.json", "-o", tmp_path / "out")
    assert expert_map.masking(src, tmp_path / "out").dropped == {}
    r, report = _verify(src, tmp_path / "out")
    assert r.exit_code == 0 and report["logits"]["passed"], r.output
    return report


def test_verify_routing_mass_dropped_of_a_keep_all_prune_is_zero(mixtral, tmp_path):
    """A prune keeping every expert (in another order: in order, B is A and records no mapping) drops no routing
    mass: 0 in every layer, said under the expert-map check."""
    src, _ = mixtral
    report = _none_dropped(src, tmp_path, "prune-experts", "--keep", {"0": [3, 0, 1, 2], "1": [1, 0, 2, 3]})
    assert report["expert_map"]["routing_mass_dropped"] == {k: {"mean": 0.0, "max": 0.0} for k in ("0", "1")}
    assert any("layer 0 mean 0.0%, max 0.0%; layer 1 mean 0.0%, max 0.0%" in n for n in report["notes"])


def test_verify_logits_fails_a_router_out_of_step(mixtral, tmp_path):
    """B's router rows swapped: its weights fail, and its logits are not masked A's."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    src, pruned = mixtral
    out = tmp_path / "forged"
    shutil.copytree(pruned, out)
    with safe_open(str(pruned / "model.safetensors"), "pt") as f:
        meta, t = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    g = "model.layers.0.block_sparse_moe.gate.weight"
    t[g] = t[g][[0, 2, 1]].contiguous()
    save_file(t, str(out / "model.safetensors"), metadata=meta)
    r, report = _verify(src, out)
    assert r.exit_code == 1 and not report["logits"]["passed"]


def test_verify_logits_of_a_reordered_model_are_a_s(mixtral, tmp_path):
    src, _ = mixtral
    report = _none_dropped(src, tmp_path, "reorder-experts", "--order", {"0": [3, 2, 1, 0], "1": [1, 3, 0, 2]})
    assert report["logits"]["masked"]["routing_mass_lost"] == {} and "reorders" in report["logits"]["client_a"]


def test_verify_logits_deepseek_v3_sigmoid_router(hf, tmp_path):
    """DeepSeek-V3, one expert group: the dropped experts' selection score masked (correction bias -inf)."""
    src = hf("deepseek_v3", n_group=1, topk_group=1)
    run_cli("prune-experts", src, "--drop", "1", "-o", tmp_path / "out")
    r, report = _verify(src, tmp_path / "out")
    assert r.exit_code == 0 and report["logits"]["passed"], r.output
    assert report["logits"]["masked"]["dropped"] == {"1": [1]} and not report["logits"]["masked"]["ungrouped"]
    assert 0 < report["logits"]["masked"]["routing_mass_lost"]["1"] < 1


def test_verify_logits_deepseek_v3_grouped_reorder_runs_ungrouped(model_dir, tmp_path):
    """Grouped routing (n_group 2): a reorder that moves experts across groups is not A's function; both sides
    are compared routed in one group, and said."""
    src = model_dir("deepseek_v3")
    (tmp_path / "order.json").write_text(json.dumps([2, 0, 3, 1]))
    run_cli("reorder-experts", src, "--order", tmp_path / "order.json", "-o", tmp_path / "out")
    r, report = _verify(src, tmp_path / "out")
    assert r.exit_code == 0 and report["logits"]["passed"], r.output
    assert report["logits"]["masked"]["ungrouped"] and "one expert group" in report["logits"]["client_a"]


def test_api_prune_reorder_saliency_locate(hf, mixtral, tmp_path):
    """The surgery commands as library functions, returning what their --json prints."""
    import ffn_tools.api as api

    src, pruned = mixtral
    r = api.prune_experts(src, tmp_path / "p", keep=str(pruned.parent / "keep.json"))
    assert r["command"] == "prune-experts" and r["layers"] == KEEP and r["output"] == str(tmp_path / "p")
    assert (tmp_path / "p" / "model.safetensors").read_bytes() == (pruned / "model.safetensors").read_bytes()
    (tmp_path / "order.json").write_text(json.dumps([1, 0, 3, 2]))
    r = api.reorder_experts(src, tmp_path / "r", order=str(tmp_path / "order.json"), dry_run=True)
    assert r["layers"] == {"0": [1, 0, 3, 2], "1": [1, 0, 3, 2]} and r["output"] is None
    assert not (tmp_path / "r").exists()

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc def ghi\njkl mno pqr stu\n")
    r = api.saliency(hf("mixtral"), tmp_path / "s.json", prompts=str(prompts))
    assert r["command"] == "saliency" and json.loads((tmp_path / "s.json").read_text())["layers"] == r["layers"]
    assert sum(r["layers"]["0"]["frequency"]) == pytest.approx(2.0)
    with pytest.raises(Exception, match="exists"):
        api.saliency(hf("mixtral"), tmp_path / "s.json", prompts=str(prompts))

    located = api.locate(src, src)
    assert located.passed is True and located.as_dict()["clients"] == ["transformers", "transformers"]


@pytest.mark.parametrize("shape,as_runs", [((300, 64, 32), True), ((300, 4, 4), False)])
def test_a_stack_of_hundreds_of_experts_reorders_as_byte_runs(shape, as_runs):
    """Reversing a 300-expert stack is 300 runs, past the 256-run cap, each 8 KiB: still copied as byte runs of
    the input (no whole-tensor load); 300 runs of 64 bytes are not worth it (the small-run protection)."""
    from ffn_tools.plan import Entry
    from ffn_tools.surgery.planning import taken_ops

    order = tuple(range(shape[0] - 1, -1, -1))
    e = Entry("experts.down_proj", "F32", shape, ("experts.down_proj",), taken_ops(shape, shape[0], order, False),
              sources=(("F32", shape),))
    if not as_runs:
        assert e.pieces is None
        return
    assert e.pieces is not None and len(e.pieces) == shape[0]
    x = torch.randn(shape)
    raw = x.view(torch.uint8).reshape(-1)
    joined = torch.cat([raw[off:off + n] for _, off, n in e.pieces])
    assert torch.equal(joined, e.apply([x]).contiguous().view(torch.uint8).reshape(-1))
    assert torch.equal(e.apply([x]), x.flip(0))


def test_verify_logits_mlx_pruned_bit_for_bit_against_masked_a(model_dir, tmp_path):
    """MLX 4-bit Qwen3-MoE pruned in order: mlx_lm runs A with the dropped experts' router logits -inf (its
    ``mlp.gate`` wrapped), and B's logits are those bit for bit (held to the widened row all the same)."""
    pytest.importorskip("mlx_lm")
    from ffn_tools.api import convert

    convert(model_dir("qwen3_moe"), "mlx", tmp_path / "a", quantize=4)
    run_cli("prune-experts", tmp_path / "a", "--drop", "1", "-o", tmp_path / "b")
    r, report = _verify(tmp_path / "a", tmp_path / "b")
    lg = report["logits"]
    assert r.exit_code == 0 and lg["passed"] and lg["client_a"].startswith("mlx_lm"), r.output
    assert lg["max_abs"] == 0 and lg["masked"]["dropped"] == {"0": [1], "1": [1]}
    assert all(0 < v < 1 for v in lg["masked"]["routing_mass_lost"].values())
    mass = report["expert_map"]["routing_mass_dropped"]  # mlx_lm's A, unmasked: its routers' softmax
    assert set(mass) == {"0", "1"} and all(0 < v["mean"] <= v["max"] < 1 for v in mass.values()), mass


def test_saliency_of_an_mlx_checkpoint_runs_in_mlx_lm(hf, tmp_path):
    """An MLX export scored through mlx_lm: the same routing frequencies as its transformers source (the float32
    export computes the same routing on these tokens), REAP scores close to them, top-k frequencies summing to k."""
    pytest.importorskip("mlx_lm")
    import shutil

    import ffn_tools.api as api

    src = hf("qwen3_moe")
    api.convert(src, "mlx", tmp_path / "mlx")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, tmp_path / "mlx" / f.name)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc def ghi jkl\nmno pqr stu vwx yz\n")
    a = api.saliency(src, prompts=str(prompts))
    b = api.saliency(tmp_path / "mlx", prompts=str(prompts))
    assert a["client"] == "transformers" and b["client"] == "mlx_lm" and a["tokens"] == b["tokens"] > 0
    for layer in ("0", "1"):
        assert sum(b["layers"][layer]["frequency"]) == pytest.approx(2.0)  # top-2
        assert b["layers"][layer]["frequency"] == pytest.approx(a["layers"][layer]["frequency"])
        assert b["layers"][layer]["reap"] == pytest.approx(a["layers"][layer]["reap"], rel=1e-3, abs=1e-5)


def test_verify_logits_gpt_oss_top_k_then_softmax_router(tmp_path):
    """GPT-OSS's router (a bias; top-k of its logits, then softmax over them): its logits -inf at the dropped
    expert is the pruned model."""
    import zoo

    zoo.build("gpt_oss", tmp_path / "a")
    run_cli("prune-experts", tmp_path / "a", "--drop", "2", "-o", tmp_path / "b")
    r, report = _verify(tmp_path / "a", tmp_path / "b")
    lg = report["logits"]
    assert r.exit_code == 0 and lg["passed"], r.output
    assert lg["masked"]["dropped"] and all(v == [2] for v in lg["masked"]["dropped"].values())
    assert lg["masked"]["routing_mass_lost"] and all(0 <= v < 1 for v in lg["masked"]["routing_mass_lost"].values())


def test_verify_logits_deepseek_v3_mlx_4bit_bit_for_bit(hf, tmp_path):
    """DeepSeek-V3 (one group) exported to MLX 4-bit and pruned: the quantized expert stacks and router slice as
    stored, and mlx_lm's MoEGate masked through its correction bias gives B's logits bit for bit."""
    pytest.importorskip("mlx_lm")
    from safetensors import safe_open

    from ffn_tools.api import convert

    convert(hf("deepseek_v3", n_group=1, topk_group=1), "mlx", tmp_path / "a", quantize=4)
    names = {k for f in (tmp_path / "a").glob("*.safetensors") for k in safe_open(str(f), "np").keys()}
    assert "model.layers.1.mlp.switch_mlp.gate_proj.scales" in names  # the expert stacks are 4-bit codes
    run_cli("prune-experts", tmp_path / "a", "--drop", "1", "-o", tmp_path / "b")
    r, report = _verify(tmp_path / "a", tmp_path / "b")
    assert r.exit_code == 0 and report["logits"]["max_abs"] == 0, r.output
    assert "the 1 expert B dropped" in report["logits"]["client_a"]


def test_verify_logits_gpt_oss_mlx_4bit_bit_for_bit(tmp_path):
    """GPT-OSS exported to MLX 4-bit (mlx_lm's layout: ``mlp.experts.{gate,up,down}_proj`` stacks, each with its
    scales, biases and bias) and pruned: every stack under the experts module slices with the router. Before, only
    the router was cut (the stacks sit one module below the experts the reader names): mlx_lm refused the output
    ("Expected shape (3, 96, 8)"), written without a word. B's logits are mlx_lm's A masked, bit for bit."""
    pytest.importorskip("mlx_lm")
    import zoo
    from safetensors import safe_open

    from ffn_tools.api import convert

    zoo.build("gpt_oss", tmp_path / "hf")
    convert(tmp_path / "hf", "mlx", tmp_path / "a", quantize=4)
    run_cli("prune-experts", tmp_path / "a", "--drop", "2", "-o", tmp_path / "b")
    shapes = {k: h.get_slice(k).get_shape() for f in (tmp_path / "b").glob("*.safetensors")
              for h in [safe_open(str(f), "np")] for k in h.keys()}
    stacks = [k for k in shapes if ".mlp.experts." in k]
    assert any(k.endswith(".scales") for k in stacks) and all(shapes[k][0] == 3 for k in stacks), shapes
    r, report = _verify(tmp_path / "a", tmp_path / "b")
    lg = report["logits"]
    assert r.exit_code == 0 and lg["passed"] and lg["max_abs"] == 0 and lg["client_b"].startswith("mlx_lm"), r.output


def test_verify_logits_deepseek_v3_mlx_bit_for_bit_and_across_clients(hf, tmp_path):
    """DeepSeek-V3 (one group) exported to MLX and pruned: mlx_lm's MoEGate masked through its correction bias
    gives B's logits bit for bit; A in transformers, masked there, against the MLX B within float32."""
    pytest.importorskip("mlx_lm")
    from ffn_tools.api import convert

    src = hf("deepseek_v3", n_group=1, topk_group=1)
    convert(src, "mlx", tmp_path / "a")
    run_cli("prune-experts", tmp_path / "a", "--drop", "1", "-o", tmp_path / "b")
    r, report = _verify(tmp_path / "a", tmp_path / "b")
    assert r.exit_code == 0 and report["logits"]["max_abs"] == 0, r.output
    assert "the 1 expert B dropped" in report["logits"]["client_a"]
    assert any("routing mass B dropped" in n and "not measured (mlx_lm" in n for n in report["notes"])  # MoEGate
    r, report = _verify(src, tmp_path / "b")
    lg = report["logits"]
    assert r.exit_code == 0 and lg["passed"] and (lg["client_b"], lg["max_abs"] < 1e-5) == ("mlx_lm", True), r.output
    assert lg["client_a"].startswith("transformers") and lg["masked"]["dropped"] == {"1": [1]}
    mass = report["expert_map"]["routing_mass_dropped"]  # transformers' A: its sigmoid scores on expert 1
    assert set(mass) == {"1"} and 0 < mass["1"]["mean"] <= mass["1"]["max"] < 1, mass
