"""prune-experts and reorder-experts on a GGUF input (issue #56; ``ffn_tools.surgery.gguf``): tiny real Qwen3-MoE
converted by llama.cpp's convert_hf_to_gguf.py (q8_0, whose ffn_down_exps stays F16, and f32), and a 256-wide one
at q4_k_m (real K-quant super-blocks: llama-quantize's bytes, through ffn-tools' export). Each kept expert's
slab of every ``_exps`` stack and its router row are the source's bytes, the output loads and runs in llama.cpp,
keeping every expert in order writes the input back byte for byte, and the result is the torch path's: the source
checkpoint pruned by prune-experts with the same --keep and converted by ffn-tools' converter at the same outtype
holds the same tensors (names, types, shapes, bytes) and gives the same logits through llama.cpp. (llama.cpp has no
way to mask a GGUF's router logits to -inf, so the masked-router comparison is the torch path's, in
test_prune.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import once, run_cli

from ffn_tools.converters.gguf.header import Reader as GGUFReader  # gguf-py's, its header parsed faster
from ffn_tools.surgery import mapping

KEEP = {"0": [0, 2, 3], "1": [3, 1, 0]}  # different sets per layer, layer 1 reordered too
TOKENS = list(range(3, 27))


def _tensors(path) -> dict[str, tuple[str, list[int], bytes]]:
    r = GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, [int(d) for d in t.shape], bytes(t.data.tobytes())) for t in r.tensors}


def _logits(path) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=False, logits_all=True, n_ctx=64, n_batch=64,
                          verbose=False)
    llm.eval(TOKENS)
    out = np.array(llm.scores[:len(TOKENS)], dtype=np.float32)
    llm.close()
    return out


@pytest.mark.parametrize("outtype", ["q8_0", "f32"])
def test_gguf_prune_is_the_sources_slabs_and_the_torch_paths_gguf(gguf_model, gguf_ref, outtype, tmp_path):
    src = gguf_ref("qwen3_moe", outtype)
    source = _pruned_is_slabs_and_the_torch_paths(src, gguf_model("qwen3_moe"), outtype, tmp_path)
    if outtype == "q8_0":
        assert source["blk.0.ffn_gate_exps.weight"][0] == "Q8_0" and source["blk.0.ffn_down_exps.weight"][0] == "F16"


def test_a_q4_k_m_gguf_is_pruned_as_its_k_quant_slabs(shared_dir, tmp_path):
    """A q4_k_m GGUF (ffn-tools' export: llama-quantize's bytes, test_gguf_kquant.py) of a Qwen3-MoE whose rows are
    256 wide, so that its expert stacks are real K-quant super-blocks (Q4_K, and Q6_K where the mix puts it), not
    the Q5_0/Q8_0 fallbacks of 64-wide rows: each kept expert's slab moves as stored, and the result is the torch
    path's q4_k_m GGUF, tensors and llama.cpp's logits."""
    import gguf_models

    wide = once(shared_dir / "prune-qwen3-moe-256", lambda d: gguf_models.build(
        "qwen3_moe", d / "model", hidden_size=256, moe_intermediate_size=256, head_dim=64)) / "model"
    src = tmp_path / "q4_k_m.gguf"
    run_cli("convert", wide, "--to", "gguf", "--outtype", "q4_k_m", "-o", src)
    source = _pruned_is_slabs_and_the_torch_paths(src, wide, "q4_k_m", tmp_path)
    types = {source[f"blk.{n}.ffn_{r}_exps.weight"][0] for n in (0, 1) for r in ("gate", "up", "down")}
    assert "Q4_K" in types and types <= {"Q4_K", "Q5_K", "Q6_K"}, types


def _pruned_is_slabs_and_the_torch_paths(src, hf_source, outtype: str, tmp_path) -> dict:
    """``src`` (a GGUF of ``hf_source`` at ``outtype``) pruned to KEEP: every kept expert's slab of each ``_exps``
    stack and router row is the source's bytes in the new order, everything else copied, the metadata the source's
    but the expert count and the recorded mapping; and it is the torch path's GGUF (``hf_source`` pruned alike,
    converted at ``outtype``): the same tensors, and the same logits through llama.cpp. The source's tensors."""
    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps(KEEP))
    out = tmp_path / "pruned.gguf"
    run_cli("prune-experts", src, "--keep", keep, "-o", out)

    source, pruned = _tensors(src), _tensors(out)
    assert list(pruned) == list(source), "the tensors, in the source's order"
    sliced = 0
    for name, (qtype, shape, data) in source.items():
        layer = name.split(".")[1] if name.startswith("blk.") else None
        got = pruned[name]
        if layer in KEEP and ("_exps." in name or ".ffn_gate_inp." in name):
            slab = len(data) // 4
            assert shape[-1] == 4 and got[0] == qtype and got[1] == [*shape[:-1], 3], name
            want = b"".join(data[e * slab:(e + 1) * slab] for e in KEEP[layer])
            assert got[2] == want, f"{name}: the kept experts' slabs, in the new order"
            sliced += 1
        else:
            assert got == (qtype, shape, data), f"{name}: copied as stored"
    assert sliced == 8, "gate, up, down stacks and the router of both layers"

    r = GGUFReader(str(out))
    assert int(r.fields["qwen3moe.expert_count"].contents()) == 3
    assert int(r.fields["qwen3moe.expert_used_count"].contents()) == 2
    recorded = json.loads(r.fields[mapping.METADATA_KEY].contents())
    assert recorded == {"command": "prune-experts", "source_experts": 4, "layers": KEEP}
    source_fields = GGUFReader(str(src)).fields
    for k, f in source_fields.items():  # every other key as the source holds it
        if k not in ("qwen3moe.expert_count", "GGUF.kv_count"):
            assert r.fields[k].contents() == f.contents(), k

    # the torch path: the source checkpoint pruned the same way, converted by ffn-tools at the same outtype
    hf = tmp_path / "hf-pruned"
    run_cli("prune-experts", hf_source, "--keep", keep, "-o", hf)
    theirs = tmp_path / "torch-path.gguf"
    run_cli("convert", hf, "--to", "gguf", "--outtype", outtype, "-o", theirs)
    other = _tensors(theirs)
    assert list(other) == list(pruned)
    for name, t in pruned.items():
        assert other[name] == t, f"{name}: the torch path's GGUF holds another tensor"
    assert int(GGUFReader(str(theirs)).fields["qwen3moe.expert_count"].contents()) == 3

    got = _logits(out)  # loads and runs in llama.cpp
    assert np.isfinite(got).all()
    assert np.array_equal(got, _logits(theirs)), "the torch path's GGUF gives other logits"
    assert not np.array_equal(got, _logits(src)), "pruning changed nothing"
    return source


def test_gguf_keep_all_is_the_input_and_reorder_and_refusals(gguf_ref, tmp_path):
    src = gguf_ref("qwen3_moe", "q8_0")
    same = tmp_path / "same.gguf"
    run_cli("prune-experts", src, "--keep", "0-3", "-o", same)
    assert same.read_bytes() == src.read_bytes(), "keeping every expert in order writes the input back"

    order = tmp_path / "order.json"
    order.write_text(json.dumps([2, 0, 3, 1]))
    moved = tmp_path / "reordered.gguf"
    run_cli("reorder-experts", src, "--order", order, "-o", moved)
    r = GGUFReader(str(moved))
    assert int(r.fields["qwen3moe.expert_count"].contents()) == 4
    assert json.loads(r.fields[mapping.METADATA_KEY].contents())["layers"] == {"0": [2, 0, 3, 1],
                                                                               "1": [2, 0, 3, 1]}
    a, b = _tensors(src), _tensors(moved)
    gate = a["blk.1.ffn_gate_inp.weight"][2]
    row = len(gate) // 4
    assert b["blk.1.ffn_gate_inp.weight"][2] == b"".join(gate[e * row:(e + 1) * row] for e in (2, 0, 3, 1))
    assert np.allclose(_logits(moved), _logits(src), rtol=0, atol=1e-4), "a reordered model is the same function"

    # pruning the pruned composes the recorded mapping back to the first source
    twice = tmp_path / "twice.gguf"
    run_cli("prune-experts", moved, "--keep", "0,2", "-o", twice)
    recorded = json.loads(GGUFReader(str(twice)).fields[mapping.METADATA_KEY].contents())
    assert recorded["source_experts"] == 4 and recorded["layers"] == {"0": [2, 3], "1": [2, 3]}

    # verify reads the GGUF's recorded mapping as a safetensors' metadata: each kept expert against its source
    for b in (moved, twice):
        r = run_cli("verify", src, b, ok=None)
        assert r.exit_code == 0 and "PASS" in r.output and "B records an expert mapping" in r.output, r.output
    assert "B dropped are not compared: layer 0 expert 0, layer 0 expert 1, layer 1 expert 0, layer 1 expert 1" \
        in r.output, r.output
    # A masked at its router is not something llama.cpp can run: --logits says so, not a PASS
    r = run_cli("verify", src, twice, "--logits", ok=None)
    assert r.exit_code == 2 and "experts masked: not applicable for llama.cpp" in r.output, r.output

    result = run_cli("prune-experts", src, "--keep", "1", "-o", tmp_path / "one.gguf", ok=False)
    assert "expert_used_count is 2" in result.output
    assert not (tmp_path / "one.gguf").exists()
    result = run_cli("prune-experts", src, "--keep", "0-2", "-o", tmp_path / "dir", ok=False)
    assert "*.gguf" in result.output


def test_gguf_deepseek_router_bias_in_step_and_groups(gguf_ref, tmp_path):
    """DeepSeek-V3 (deepseek2 in llama.cpp: a leading dense layer, a shared expert, exp_probs_b, 2 expert groups):
    a reorder within each group is the same function, exp_probs_b and ffn_gate_inp moved in step, the rest
    copied; a kept count the groups cannot divide is refused."""
    src = gguf_ref("deepseek_v3", "q8_0")
    order = tmp_path / "order.json"
    order.write_text(json.dumps([1, 0, 3, 2]))  # each group of 2 keeps its experts
    moved = tmp_path / "reordered.gguf"
    run_cli("reorder-experts", src, "--order", order, "-o", moved)
    a, b = _tensors(src), _tensors(moved)
    assert list(a) == list(b)
    for name, (qtype, shape, data) in a.items():
        if name.startswith("blk.1.") and ("_exps." in name or "ffn_gate_inp." in name or "exp_probs_b." in name):
            slab = len(data) // 4
            assert b[name] == (qtype, shape, b"".join(data[e * slab:(e + 1) * slab] for e in (1, 0, 3, 2))), name
        else:
            assert b[name] == (qtype, shape, data), f"{name}: copied as stored (dense layer, shared expert, MLA)"
    assert "blk.1.exp_probs_b.bias" in a and "blk.1.ffn_gate_shexp.weight" in a and "blk.0.ffn_gate.weight" in a
    assert np.allclose(_logits(moved), _logits(src), rtol=0, atol=1e-4), "a reordered model is the same function"
    result = run_cli("prune-experts", src, "--keep", "0-2", "-o", tmp_path / "three.gguf", ok=False)
    assert "expert_group_count is 2" in result.output


def test_gguf_prune_by_saliency_says_what_the_torch_path_says(gguf_model, gguf_ref, tmp_path):
    """--saliency on a GGUF input ranks its experts as on the torch source (blk.N is layer N) and says, as the torch
    path does, what the kept experts hold of each layer's routing (``kept_share``, the least kept frequency), also
    in a dry run; without --saliency neither is said."""
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"layers": {"0": {"reap": [0.5, 0.1, 0.9, 0.3], "frequency": [1, 9, 9, 9]},
                                             "1": {"reap": [0.2, 0.2, 0.0, 0.7], "frequency": [9, 9, 9, 1]}}}))
    args = ("--saliency", scores, "--keep-ratio", "0.75", "--json")
    torch_way = json.loads(run_cli("prune-experts", gguf_model("qwen3_moe"), *args, "-o", tmp_path / "t").output)
    for dry in ([], ["--dry-run"]):
        out = tmp_path / f"g{len(dry)}.gguf"
        r = json.loads(run_cli("prune-experts", gguf_ref("qwen3_moe", "q8_0"), *args, *dry, "-o", out).output)
        assert r["layers"] == torch_way["layers"] == {"0": [0, 2, 3], "1": [0, 1, 3]}
        assert r["kept_share"] == torch_way["kept_share"]
        assert r["kept_share"]["0"] == {"reap": pytest.approx(1.7 / 1.8), "frequency": pytest.approx(19 / 28)}
        assert "layer 0 keeps 67.9% of its routing frequency, the least" in r["changes"][-1], r["changes"]
        assert out.exists() != bool(dry)
    r = json.loads(run_cli("prune-experts", gguf_ref("qwen3_moe", "q8_0"), "--keep", "0-2", "--json", "-o",
                           tmp_path / "k.gguf").output)
    assert "kept_share" not in r and not any(c.startswith("routing kept") for c in r["changes"])
