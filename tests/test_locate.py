"""``verify --locate``: where two models part (``verification.locate``, ``converters/pytorch/activations.py``).

Defects planted at test time in a tiny Qwen2-MoE (2 layers, hidden 64, 4 routed experts and a shared one): each
must be named by its layer and part, the first part in the model's order that leaves its floor; a correct
conversion (a bfloat16 cast) stays within every floor.
"""

from __future__ import annotations

import json
import shutil
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ffn_tools import api
from ffn_tools.formats import registry
from ffn_tools.verification.locate import figure, locate, ordered
from helpers import run_cli

BUDGET_S = 10.0  # added time per pair, on the tests' tiny models


@pytest.fixture(scope="module")
def moe(model_dir, tmp_path_factory) -> Path:
    """The tiny Qwen2-MoE, copied (the defects are planted in copies of it)."""
    a = tmp_path_factory.mktemp("locate") / "a"
    shutil.copytree(model_dir("qwen2_moe"), a)
    return a


def _plant(a: Path, b: Path, edit) -> Path:
    shutil.copytree(a, b)
    for f in b.glob("*.safetensors"):
        sd = load_file(f)
        edit(sd)
        save_file(sd, f, metadata={"format": "pt"})
    return b


def _swap(sd, x: str, y: str) -> None:
    sd[x], sd[y] = sd[y].clone(), sd[x].clone()


def _rows(sd, name: str, i: int, j: int) -> None:
    w = sd[name]
    w[[i, j]] = w[[j, i]].clone()


def _rotary_other_order(sd, layer: int, heads: dict[str, int], head_dim: int = 16) -> None:
    """One layer's q and k rows in the other rotary order (each head's interleaved pairs as halves: the permute
    a converter applies once too often or not at all), their biases with them."""
    for proj, n in heads.items():
        for kind in ("weight", "bias"):
            name = f"model.layers.{layer}.self_attn.{proj}.{kind}"
            if name in sd:
                t = sd[name]
                shape = t.shape
                t = t.reshape(n, head_dim // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
                sd[name] = t.contiguous()


def _add_one(sd, name: str) -> None:
    sd[name] = sd[name] + 1.0


DEFECTS = {
    "shared expert gate and up swapped": (
        lambda sd: _swap(sd, "model.layers.1.mlp.shared_expert.gate_proj.weight",
                         "model.layers.1.mlp.shared_expert.up_proj.weight"), "L1.shared"),
    "a norm +1 twice": (lambda sd: _add_one(sd, "model.layers.1.post_attention_layernorm.weight"), "L1.ffn_norm"),
    "an attention norm +1 twice": (lambda sd: _add_one(sd, "model.layers.0.input_layernorm.weight"), "L0.attn_norm"),
    "q/k rows in the other rotary order": (
        lambda sd: _rotary_other_order(sd, 0, {"q_proj": 4, "k_proj": 2}), "L0.attn"),
    "router rows of two experts swapped": (lambda sd: _rows(sd, "model.layers.1.mlp.gate.weight", 0, 2), "L1.router"),
}


def _locate(a: Path, b: Path):
    return locate(a, b, opener=registry().open_sides, converter=registry().convert)


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_a_planted_defect_is_named_by_its_layer_and_part(moe, tmp_path, defect):
    edit, where = DEFECTS[defect]
    b = _plant(moe, tmp_path / "b", edit)
    start = time.perf_counter()
    r = _locate(moe, b)
    took = time.perf_counter() - start
    assert r.passed is False, r.lines()
    assert r.first is not None and r.first.key == where, r.lines()
    before = [row for row in r.rows if row.key != where][: [x.key for x in r.rows].index(where)]
    assert before and not any(row.left for row in before), r.lines()  # every earlier part within its floor
    assert where in r.verdict() and "layer" in r.verdict()
    assert took < BUDGET_S, f"--locate took {took:.1f}s on a tiny pair"


def test_the_router_defect_moves_the_top_k_choice(moe, tmp_path):
    b = _plant(moe, tmp_path / "b", DEFECTS["router rows of two experts swapped"][0])
    parts = {row.key: row for row in _locate(moe, b).rows}
    assert parts["L1.topk"].left and parts["L1.topk"].b["choice"] > 0.1
    assert not parts["L0.topk"].left and parts["L0.topk"].b["choice"] == 0.0


def test_a_correct_bf16_cast_stays_within_its_floors(moe, tmp_path):
    b = tmp_path / "bf16"
    api.convert(moe, "torch", b, dtype="bfloat16")
    r = _locate(moe, b)
    assert r.passed is True, r.lines()
    assert "bfloat16" in r.floor
    # the floor is real (A in bf16 is not A) and every part of B sits on it
    assert any(row.floor and row.floor.get("rel", 0) > 1e-4 for row in r.rows)
    assert {row.part for row in r.rows} >= {"attn_norm", "attn", "after_attn", "ffn_norm", "router", "topk",
                                            "shared", "routed", "ffn", "hidden"}


def test_cli_locate_json_and_table(moe, tmp_path):
    b = _plant(moe, tmp_path / "b", DEFECTS["router rows of two experts swapped"][0])
    res = run_cli("verify", moe, b, "--locate", "--json", "--ffn-only", "--no-side-files", "--plot",
                  tmp_path / "where.svg", ok=None)
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)  # (progress lines go to stderr)
    assert data["locate"]["first"]["key"] == "L1.router"
    assert {p["key"] for p in data["locate"]["parts"]} >= {"embed", "L0.attn", "L1.routed", "final_norm", "logits"}
    svg = ET.parse(data["locate"]["plot"]).getroot()  # --plot: the table as an image
    assert svg.tag.endswith("svg") and len(svg.findall("{http://www.w3.org/2000/svg}rect")) == 2 * 10
    assert 'stroke="#000"' in Path(data["locate"]["plot"]).read_text()  # the first part that leaves, marked
    text = run_cli("verify", moe, moe, "--locate", "--ffn-only").output
    assert "--locate: every part of every layer within its floor" in text
    assert "layer" in text and "router" in text


def test_figures_and_order():
    import numpy as np

    a = np.ones((4, 8), np.float32)
    same = figure(a, a)
    assert same["rel"] == same["max_rel"] == 0.0 and same["cosine"] == pytest.approx(1.0)
    assert figure(a, 2 * a)["rel"] == pytest.approx(1.0)
    ids = np.array([[0, 1], [1, 2]])
    assert figure(ids, np.array([[0, 1], [1, 3]])) == {"choice": 0.5}
    assert ordered(["logits", "L1.attn", "L0.hidden", "embed", "L0.attn_norm", "final_norm", "L10.attn"]) == [
        "embed", "L0.attn_norm", "L0.hidden", "L1.attn", "L10.attn", "final_norm", "logits"]
    assert torch  # the tiny models are torch's


def test_a_failed_generate_says_where(hf, tmp_path):
    a = hf("qwen2_moe")
    b = _plant(a, tmp_path / "b", DEFECTS["a norm +1 twice"][0])
    report = api.verify(a, b, generate=True, new_tokens=4, ffn_only=True, side_files=False)
    g = report.as_dict()["generation"]
    assert g["passed"] is False, report.lines()
    assert any("B parts from A first at layer 1 FFN's input norm (L1.ffn_norm)" in n for n in g["notes"]), g["notes"]


def test_the_built_in_prompts_probe_other_scripts_and_a_tool_call():
    import unicodedata

    from ffn_tools.checks.prompts import PROMPTS

    scripts = {unicodedata.name(ch).split()[0] for p in PROMPTS for ch in p if ord(ch) > 0x7F}
    assert {"CJK", "HIRAGANA", "HANGUL", "ARABIC"} <= scripts, scripts
    assert any("def " in p for p in PROMPTS) and any("<tool_call>" in p for p in PROMPTS)


def test_an_mlx_b_runs_in_mlx_lm_and_a_defect_in_it_is_named(moe, tmp_path):
    pytest.importorskip("mlx_lm")
    b = tmp_path / "mlx"
    api.convert(moe, "mlx", b, dtype="bfloat16")
    r = _locate(moe, b)
    assert r.clients == ("transformers", "mlx_lm"), r.lines()
    assert not any("exposes no activations" in n for n in r.notes), r.notes  # mlx_lm's own, not A's client
    assert r.passed is True, r.lines()
    assert "mlx" in r.floor and "mlx_lm" in r.floor
    parts = {row.key: row for row in r.rows}
    assert parts["L1.routed"].b is None and "no such part" in parts["L1.routed"].note  # mlx_lm combines them inside
    assert parts["L1.shared"].floor["rel"] > 1e-4  # a real floor: bf16 in another client
    bad = tmp_path / "mlx-bad"
    shutil.copytree(b, bad)
    for f in bad.glob("*.safetensors"):
        sd = load_file(f)
        _swap(sd, "model.layers.1.mlp.shared_expert.gate_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight")
        save_file(sd, f, metadata={"format": "mlx"})
    r = _locate(moe, bad)
    assert r.first is not None and r.first.key == "L1.shared", r.lines()



def test_a_client_exposing_no_activations_runs_b_in_a_client_class_and_says_so(moe, tmp_path, monkeypatch):
    """Where B's client exposes no activations (llama.cpp), B's weights (and the floor's) are converted to A's
    format and run in A's client, and the report says so. (A GGUF B takes this path: ~7 s a pair here, but its
    conversions take ~25 s more on a loaded CPU, so the mechanism is tested with a client that declines.)"""
    from ffn_tools.converters.pytorch.client import Transformers
    from ffn_tools.clients import Client

    b = _plant(moe, tmp_path / "b", DEFECTS["router rows of two experts swapped"][0])
    real = Transformers.activations

    def declines_b(self, path, sequences, dtype=None):
        if Path(path) == b:
            return Client.activations(self, path, sequences, dtype)  # NotApplicable, as llama.cpp's
        return real(self, path, sequences, dtype)

    monkeypatch.setattr(Transformers, "activations", declines_b)
    r = _locate(moe, b)
    assert r.clients[1] == "transformers (as torch: transformers exposes no activations)", r.lines()
    assert any("the weights of B were converted to A's format (torch)" in n for n in r.notes), r.notes
    assert r.first is not None and r.first.key == "L1.router", r.lines()


def _export_shifting(name: str):
    """ffn-tools' convert, with the MLX output's tensor ``name`` shifted by one after it is written (a defect planted
    in our own export path)."""
    real = registry().convert

    def patched(path, to, out, **kw):
        done = real(path, to, out, **kw)
        for f in Path(out).glob("*.safetensors"):
            sd = load_file(f)
            _add_one(sd, name)
            save_file(sd, f, metadata={"format": "mlx"})
        return done

    return patched


def test_a_defect_in_ffn_tools_own_mlx_export_is_caught_by_the_independent_floor(moe, tmp_path):
    """ffn-tools' MLX export patched to shift a norm: B and ffn-tools' own floor share the defect, mlx_lm.convert's
    floor does not."""
    pytest.importorskip("mlx_lm")
    patched = _export_shifting("model.layers.1.post_attention_layernorm.weight")

    b = tmp_path / "mlx"
    patched(moe, "mlx", b, dtype="float32")
    r = locate(moe, b, opener=registry().open_sides, converter=patched)
    assert r.anchor.startswith("A converted to B's form by mlx_lm.convert"), r.lines()
    assert r.first is not None and r.first.key == "L1.ffn_norm", r.lines()
    assert "independent floor" in r.verdict()
    assert r.floors_part is not None and r.floors_part.key == "L1.ffn_norm"  # ffn-tools' floor shares the defect
    assert r.first.b == r.first.floor  # B sits on ffn-tools' floor (one patched conversion made both)
    assert any("floors DIFFER" in line for line in r.lines())


def test_a_b_made_by_the_anchor_is_held_against_ffn_tools_floor(moe, tmp_path):
    """B is mlx_lm.convert's own output: the anchor is no floor independent of B, so ffn-tools' floor judges it; a
    defect of ffn-tools' export (patched) then shows as the floors' disagreement, not as B's."""
    pytest.importorskip("mlx_lm")
    patched = _export_shifting("model.layers.0.input_layernorm.weight")

    b = tmp_path / "by-mlx-lm"
    patched(moe, "mlx", tmp_path / "like", dtype="float32")  # for A's settings, as the anchor is given them
    from ffn_tools.converters.mlx.anchor import anchor

    anchor(moe, {"dtype": "float32"}, b, tmp_path / "like")
    r = locate(moe, b, opener=registry().open_sides, converter=patched)
    assert r.anchor_is_b and any("B came from that tool" in n for n in r.notes), r.lines()
    assert r.passed is True, r.lines()
    assert r.floors_part is not None and r.floors_part.key == "L0.attn_norm", r.lines()


def test_a_remapped_token_row_is_named_at_the_embedding(moe, tmp_path):
    """A byte-fallback token's row moved to another id (a vocabulary remapped in the weights): the first part
    that leaves its floor is the embedding rows, before any layer."""
    from ffn_tools.verification.logits import token_batch

    seen = sorted(set(token_batch(96, 0, 32).flatten().tolist()))
    b = _plant(moe, tmp_path / "b", lambda sd: _rows(sd, "model.embed_tokens.weight", seen[3], seen[4]))
    r = _locate(moe, b)
    assert r.first is not None and r.first.key == "embed" and r.first.layer is None, r.lines()
    assert "embedding rows" in r.verdict()


def test_a_clamp_removed_is_named_at_the_routed_experts(tmp_path):
    """GPT-OSS clamps its experts' gate and up (``swiglu_limit``); a B whose config.json lost the setting (the same
    weights, run at transformers' default limit 7, which nothing of a tiny model reaches) computes an unclamped
    SwiGLU: the first part that leaves its floor is layer 0's routed experts, the router and attention before them
    within theirs."""
    import zoo

    a = tmp_path / "a"
    zoo.build("gpt_oss", a, extra={"swiglu_limit": 0.05})  # a limit the tiny model's gates cross
    b = tmp_path / "b"
    shutil.copytree(a, b)
    config = json.loads((b / "config.json").read_text())
    del config["swiglu_limit"]
    (b / "config.json").write_text(json.dumps(config))
    r = _locate(a, b)
    assert r.passed is False and r.first is not None and r.first.key == "L0.routed", r.lines()
    keys = [row.key for row in r.rows]
    assert {"L0.router", "L0.attn"} <= set(keys[: keys.index("L0.routed")])
    assert not any(row.left for row in r.rows[: keys.index("L0.routed")]), r.lines()


def test_a_defect_in_ffn_tools_own_gguf_export_is_caught_by_llama_cpps_floor(gguf_model, tmp_path):
    """ffn-tools' GGUF export patched to shift a norm in the file it writes: B and ffn-tools' own floor share the
    defect; the floor llama.cpp's convert_hf_to_gguf.py makes from A does not, and names the norm (B, the floor and
    that anchor each read back into A's format and run in transformers: llama.cpp exposes no activations)."""
    import gguf

    real = registry().convert

    def patched(path, to, out, **kw):
        done = real(path, to, out, **kw)
        if to == "gguf":
            reader = gguf.GGUFReader(out, "r+")
            norm = next(t for t in reader.tensors if t.name == "blk.1.ffn_norm.weight")
            norm.data[...] += 1.0
            reader.data.flush()
        return done

    a, b = gguf_model("phi3"), tmp_path / "b.gguf"
    patched(a, "gguf", b, outtype="f32")
    r = locate(a, b, opener=registry().open_sides, converter=patched)
    assert r.anchor.startswith("A converted to B's form by llama.cpp's convert_hf_to_gguf.py --outtype f32"), r.lines()
    assert r.clients[1].startswith("transformers (as torch"), r.lines()
    assert r.first is not None and r.first.key == "L1.ffn_norm", r.lines()
    assert "independent floor" in r.verdict()
    assert r.floors_part is not None and r.floors_part.key == "L1.ffn_norm", r.lines()  # ours shares the defect
