"""prune-experts and reorder-experts (issue #56; ``ffn_tools.surgery``) on tiny real Mixtral, Qwen3-MoE (per
expert and transformers-v5 stacked) and Qwen2-MoE (shared expert): kept experts' bytes exact, the router's rows in
step, the output loads in transformers with no missing or unexpected key, and its logits are A's with the
dropped experts' router logits masked to -inf (renormalized: the routers' own code, run masked)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli, tensors
from safetensors import safe_open

from ffn_tools.io.readers import open_checkpoint
from ffn_tools.surgery import mapping

TOKENS = torch.arange(3, 27).reshape(2, 12)
KEEP = {"0": [0, 2, 3], "1": [3, 1, 0]}  # different sets per layer, layer 1 reordered too


def _model(path):
    import transformers

    config = json.loads((path / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    model, info = cls.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def _masked_router(gate, kept: list[int]):
    """``gate``'s forward with the experts not in ``kept`` masked to -inf before its softmax (Mixtral's and
    Qwen-MoE's TopKRouter, transformers 5: softmax in float32, top-k, renormalized where it renormalizes)."""
    dropped = [e for e in range(gate.weight.shape[0]) if e not in kept]
    norm = getattr(gate, "norm_topk_prob", True)

    def forward(hidden):
        hidden = hidden.reshape(-1, gate.hidden_dim)
        logits = torch.nn.functional.linear(hidden, gate.weight)
        logits[:, dropped] = float("-inf")
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, gate.top_k, dim=-1)
        if norm:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    return forward


def _logits(path, keep: dict | None = None) -> torch.Tensor:
    model, info = _model(path)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for layer, kept in (keep or {}).items():
        gate = model.model.layers[int(layer)].mlp.gate
        gate.forward = _masked_router(gate, kept)
    with torch.no_grad():
        return model(TOKENS).logits


def _raw(path, name: str) -> bytes:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return f.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def keep_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prune") / "keep.json"
    path.write_text(json.dumps(KEEP))
    return path


@pytest.mark.parametrize("arch,block", [("mixtral", "block_sparse_moe"), ("qwen3_moe", "mlp")])
def test_prune_per_expert(model_dir, tmp_path, keep_file, arch, block):
    src = model_dir(arch)
    r = json.loads(run_cli("prune-experts", src, "--keep", keep_file, "-o", tmp_path / "out", "--json").output)
    out = tmp_path / "out"
    assert r["kept"] == 3 and r["layers"] == {k: v for k, v in KEEP.items()}
    a, b = tensors(src), tensors(out)
    for layer, kept in KEEP.items():
        pre = f"model.layers.{layer}.{block}"
        for new, old in enumerate(kept):  # each kept expert's tensors: the source's bytes, renumbered
            names = [n for n in a if n.startswith(f"{pre}.experts.{old}.")]
            assert names
            for n in names:
                assert _raw(src, n) == _raw(out, n.replace(f".experts.{old}.", f".experts.{new}."))
        assert not any(n.startswith(f"{pre}.experts.3.") for n in b)
        assert torch.equal(b[f"{pre}.gate.weight"], a[f"{pre}.gate.weight"][kept])  # the router's rows in step
    outside = [n for n in a if ".experts." not in n and ".gate." not in n]
    assert all(_raw(src, n) == _raw(out, n) for n in outside)
    config = json.loads((out / "config.json").read_text())
    assert [config[k] for k in ("num_local_experts", "num_experts") if k in config] == [3]
    recorded = json.loads((out / mapping.FILE).read_text())
    assert recorded["layers"] == KEEP and recorded["source_experts"] == 4
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert json.loads(f.metadata()[mapping.METADATA_KEY])["layers"] == KEEP
    receipt = json.loads((out / "ffn-tools-receipt.json").read_text())
    assert "prune-experts" in json.dumps(receipt)
    torch.testing.assert_close(_logits(out), _logits(src, KEEP), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_logits(out), _logits(src), atol=1e-3)  # the pruning changed the function


@pytest.fixture(scope="module")
def stacked(model_dir, tmp_path_factory):
    """Qwen3-MoE as transformers v5 keeps it: mlp.experts.gate_up_proj (E, 2I, H) and down_proj (E, H, I)."""
    out = tmp_path_factory.mktemp("stacked") / "model"
    run_cli("fuse-gateup", model_dir("qwen3_moe"), "--stack-experts", "-o", out)
    return out


def test_prune_stacked_moves_slices_as_bytes(stacked, tmp_path, keep_file):
    from ffn_tools.detect import find_ffns
    from ffn_tools.surgery.layers import moe_layers
    from ffn_tools.surgery.planning import plan_surgery

    with open_checkpoint(stacked) as ckpt:
        entries = plan_surgery(ckpt, moe_layers(ckpt, find_ffns(ckpt)), {0: (0, 2, 3), 1: (3, 1, 0)})
    cut = [e for e in entries if e.name.endswith(("experts.gate_up_proj", "experts.down_proj", "gate.weight"))]
    assert len(cut) == 6 and all(e.pieces is not None for e in cut)  # byte runs of the input: a zero-copy copy
    run_cli("prune-experts", stacked, "--keep", keep_file, "-o", tmp_path / "out")
    a, b = tensors(stacked), tensors(tmp_path / "out")
    for layer, kept in KEEP.items():
        for role in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"):
            n = f"model.layers.{layer}.{role}"
            assert b[n].shape[0] == 3 and torch.equal(b[n], a[n][kept])
    torch.testing.assert_close(_logits(tmp_path / "out"), _logits(stacked, KEEP), atol=1e-5, rtol=1e-5)


def test_a_sharded_input_is_pruned_into_shards_like_its_own(stacked, model_dir, tmp_path):
    """A sharded input's output is cut like the input (its largest file, said) unless --max-shard-size is given:
    before, a 16 GB checkpoint of 2 GB shards was pruned into one 12 GB file, whose digest could be made only once
    it was whole (benchmarks/bench_prune.py). The tensors are the single-file prune's."""
    size = sum(f.stat().st_size for f in stacked.glob("*.safetensors"))
    src = tmp_path / "in"  # ``stacked`` in shards
    run_cli("fuse-gateup", model_dir("qwen3_moe"), "--stack-experts", "-o", src, "--max-shard-size", str(size // 3))
    largest = max(f.stat().st_size for f in src.glob("*.safetensors"))
    assert len(list(src.glob("*.safetensors"))) > 1
    r = json.loads(run_cli("prune-experts", src, "--keep", "0,2,3", "-o", tmp_path / "out", "--json").stdout)
    files = list((tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 1 and all(f.stat().st_size <= largest for f in files), [f.stat().st_size for f in files]
    assert any("like the input's largest" in c for c in r["changes"]), r["changes"]
    r = json.loads(run_cli("prune-experts", src, "--keep", "0,2,3", "-o", tmp_path / "one", "--json",
                           "--max-shard-size", str(10 * size)).stdout)
    assert [f.name for f in (tmp_path / "one").glob("*.safetensors")] == ["model.safetensors"]
    assert not any("like the input's largest" in c for c in r["changes"])
    a, b = tensors(tmp_path / "out"), tensors(tmp_path / "one")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_reorder_gives_the_same_function(stacked, model_dir, tmp_path):
    order = tmp_path / "order.json"
    order.write_text(json.dumps({"0": [3, 2, 1, 0], "1": [1, 3, 0, 2]}))
    for src in (model_dir("mixtral"), stacked):
        out = tmp_path / src.parent.name
        run_cli("reorder-experts", src, "--order", order, "-o", out)
        assert json.loads((out / mapping.FILE).read_text())["layers"] == {"0": [3, 2, 1, 0], "1": [1, 3, 0, 2]}
        torch.testing.assert_close(_logits(out), _logits(src), atol=1e-6, rtol=1e-6)


def test_shared_expert_untouched_and_twice_pruned_maps_to_the_source(model_dir, tmp_path):
    src = model_dir("qwen2_moe")
    run_cli("prune-experts", src, "--drop", "1", "-o", tmp_path / "once")
    run_cli("prune-experts", tmp_path / "once", "--keep", "1,2", "-o", tmp_path / "twice")
    a, b = tensors(src), tensors(tmp_path / "twice")
    shared = [n for n in a if "shared_expert" in n]
    assert len(shared) == 8 and all(torch.equal(a[n], b[n]) for n in shared)
    with open_checkpoint(tmp_path / "twice") as ckpt:
        recorded = mapping.recorded(ckpt)
    assert recorded["layers"] == {0: (2, 3), 1: (2, 3)} and recorded["source_experts"] == 4
    assert torch.equal(b["model.layers.1.mlp.experts.0.up_proj.weight"],
                       a["model.layers.1.mlp.experts.2.up_proj.weight"])
    keep = {"0": [2, 3], "1": [2, 3]}
    torch.testing.assert_close(_logits(tmp_path / "twice"), _logits(src, keep), atol=1e-5, rtol=1e-5)


def test_keep_all_is_a_copy(model_dir, tmp_path):
    src = model_dir("mixtral")
    run_cli("prune-experts", src, "--keep", "0-3", "-o", tmp_path / "out")
    a, b = tensors(src), tensors(tmp_path / "out")
    assert a.keys() == b.keys() and all(_raw(src, n) == _raw(tmp_path / "out", n) for n in a)
    assert (src / "model.safetensors").read_bytes() == (tmp_path / "out" / "model.safetensors").read_bytes()
    assert not (tmp_path / "out" / mapping.FILE).exists()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_local_experts"] == 4


@pytest.mark.parametrize("args,said", [
    (("--keep", "0"), "num_experts_per_tok is 2"),  # top-2 routing needs 2 experts
    (("--keep", "0-4"), "out of range"),
    (("--drop", "0-3"), "would keep no expert"),
    (("--keep", "0,1", "--drop", "2"), "exactly one of"),
    (("--keep", "{json}"), "same number of experts"),
])
def test_refusals(model_dir, tmp_path, args, said):
    uneven = tmp_path / "uneven.json"
    uneven.write_text(json.dumps({"0": [0, 1], "1": [0, 1, 2]}))
    args = tuple(str(uneven) if a == "{json}" else a for a in args)
    r = run_cli("prune-experts", model_dir("mixtral"), *args, "-o", tmp_path / "out", ok=False)
    assert said in r.output
    assert not (tmp_path / "out").exists()


def test_reorder_refuses_a_partial_order(model_dir, tmp_path):
    order = tmp_path / "order.json"
    order.write_text(json.dumps([0, 2, 1]))
    r = run_cli("reorder-experts", model_dir("mixtral"), "--order", order, "-o", tmp_path / "out", ok=False)
    assert "names each of its 4 experts once" in r.output


# verify through the recorded mapping (``verification.expert_map``): engine._pair pairs B's experts through it, and
# the config check accepts the expert count the mapping explains (no --allow-config needed).
@pytest.fixture
def mapped_verify():
    def verify(a, b, *args):
        return run_cli("verify", a, b, "--backend", "reference", "--no-load-check", "--no-side-files", "--tokens",
                       "8", *args, ok=None)

    return verify


@pytest.fixture(scope="module")
def pruned(model_dir, tmp_path_factory, keep_file):
    out = tmp_path_factory.mktemp("pruned") / "model"
    run_cli("prune-experts", model_dir("mixtral"), "--keep", keep_file, "-o", out)
    return out


def _forged(pruned, tmp_path, change) -> object:
    """A copy of ``pruned`` whose weights ``change`` edits (the recorded mapping kept in the metadata)."""
    import shutil

    from safetensors.torch import save_file

    out = tmp_path / "forged"
    shutil.copytree(pruned, out)
    with safe_open(str(pruned / "model.safetensors"), "pt") as f:
        meta, t = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    change(t)
    save_file(t, str(out / "model.safetensors"), metadata=meta)
    return out


def test_verify_pairs_experts_through_the_mapping(mapped_verify, model_dir, pruned):
    r = mapped_verify(model_dir("mixtral"), pruned)
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    assert "B records an expert mapping" in r.output and "layer 0 expert 1" in r.output  # dropped: named
    assert "differs as B's mapping says" in r.output and "allowed" in r.output


def test_verify_fails_a_router_out_of_step(mapped_verify, model_dir, pruned, tmp_path):
    def swap(t):
        g = t["model.layers.0.block_sparse_moe.gate.weight"]
        t["model.layers.0.block_sparse_moe.gate.weight"] = g[[0, 2, 1]].contiguous()  # rows off by one expert

    r = mapped_verify(model_dir("mixtral"), _forged(pruned, tmp_path, swap))
    assert r.exit_code == 1 and "FAIL" in r.output
    assert "B's row 1 (expert 1) is A's row 3, not A's row 2" in r.output


def test_verify_fails_a_kept_expert_from_another_index(mapped_verify, model_dir, pruned, tmp_path):
    a = tensors(model_dir("mixtral"))

    def other(t):  # B's expert 1 of layer 0 should be A's expert 2; it holds A's expert 1 (dropped)
        for w in ("w1", "w2", "w3"):
            t[f"model.layers.0.block_sparse_moe.experts.1.{w}.weight"] = \
                a[f"model.layers.0.block_sparse_moe.experts.1.{w}.weight"]

    r = mapped_verify(model_dir("mixtral"), _forged(pruned, tmp_path, other))
    assert r.exit_code == 1 and "FAIL" in r.output
    assert "layer 0 expert 1: not bit-identical" in r.output


def test_config_expert_count_nested_and_dotted_keys():
    from ffn_tools.errors import FFNToolsError
    from ffn_tools.surgery.routers import updated_config

    vlm = {"model_type": "x", "text_config": {"num_experts": 8, "num_experts_per_tok": 2}}
    out, changes = updated_config(vlm, 8, 6)
    assert out["text_config"]["num_experts"] == 6 and vlm["text_config"]["num_experts"] == 8  # a copy
    assert changes == ["config.json: num_experts 8 -> 6"]
    dbrx = {"ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}}
    out, _ = updated_config(dbrx, 16, 12)
    assert out["ffn_config"] == {"moe_num_experts": 12, "moe_top_k": 4} and dbrx["ffn_config"]["moe_num_experts"] == 16
    for bad, said in (({"num_experts": 4}, "layers hold 8"), ({"hidden_size": 8}, "names no routed expert count"),
                      ({"ffn_config": {"moe_num_experts": 8, "moe_top_k": 7}}, "more than the 6 kept")):
        with pytest.raises(FFNToolsError, match=said):
            updated_config(bad, 8, 6)
