"""MTP (NextN) heads (``ffn_tools.mtp``, issue #55): found and named as each family lays them out, listed apart by
``inspect``, kept / dropped / taken alone on purpose by ``convert --to torch --mtp``, and a head B lacks named by
``verify``.

The checkpoints are tiny transformers models built with one decoder layer more than their config declares: that
last block, renamed nothing, is the NextN block, and the head's own tensors are written beside it as the published
checkpoints lay them out (DeepSeek-V3's ``model.layers.61.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,
embed_tokens}``, GLM-4.5's alike), ``num_nextn_predict_layers`` 1 in config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ffn_tools import mtp
from ffn_tools.io.readers import open_checkpoint
from helpers import run_cli, tensors

import tiny_models

GLM = ("Glm4MoeConfig", "Glm4MoeForCausalLM",
       {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 48,
        "first_k_dense_replace": 1, "head_dim": 16, "n_group": 1, "topk_group": 1, "partial_rotary_factor": 0.5})


def with_head(arch: str, path: Path, spec=None) -> Path:
    """A tiny ``arch`` checkpoint (transformers) of 2 main layers and one NextN block ``model.layers.2`` laid out
    as the published checkpoints are; config.json declares ``num_hidden_layers`` 2, ``num_nextn_predict_layers``
    1."""
    import transformers

    cfg_name, model_name, extra = spec or tiny_models.ARCHS[arch]
    config = getattr(transformers, cfg_name)(**{**tiny_models.COMMON, **extra, "num_hidden_layers": 3})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    saved = path.parent / "saved"  # transformers' save: experts one by one, as the published checkpoints hold them
    model.save_pretrained(saved)
    state = load_file(str(saved / "model.safetensors"))
    h, v = config.hidden_size, config.vocab_size
    g = torch.Generator().manual_seed(1)
    for name, shape in (("enorm", (h,)), ("hnorm", (h,)), ("eh_proj", (h, 2 * h)), ("shared_head.norm", (h,)),
                        ("shared_head.head", (v, h)), ("embed_tokens", (v, h))):
        state[f"model.layers.2.{name}.weight"] = torch.randn(shape, generator=g) * 0.05 + (1.0 if "norm" in name
                                                                                             else 0.0)
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**config.to_dict(), "num_hidden_layers": 2, "num_nextn_predict_layers": 1,
           "architectures": [model_name]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    return with_head("deepseek_v3", tmp_path_factory.mktemp("mtp-ds") / "model")


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> Path:
    return with_head("glm4_moe", tmp_path_factory.mktemp("mtp-glm") / "model", GLM)


def test_found_and_named(deepseek, glm):
    for path in (deepseek, glm):
        with open_checkpoint(path) as c:
            heads = mtp.find_heads(c, c.config)
            assert [h.name for h in heads] == ["model.layers.2"] and heads[0].layout.name == "nextn"
            assert heads[0].own() == ["enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head",
                                      "embed_tokens"]
            assert set(heads[0].tensors) == {n for n in c if n.startswith("model.layers.2.")}
            assert mtp.check_count(heads, c.config) is None
            assert mtp.find_heads([n for n in c if not n.startswith("model.layers.2.")], c.config) == ()
            # config says 1 block, the tensors hold none: said
            line = mtp.check_count((), c.config)
            assert line and "num_nextn_predict_layers is 1" in line and "0 MTP blocks" in line


def test_a_nested_config_declares_the_head(glm, tmp_path):
    """GLM-4.5V (glm4v_moe): its config.json (transformers' Glm4vMoeConfig) keeps num_hidden_layers and
    num_nextn_predict_layers in text_config, and its language model's tensors, the NextN block among them, sit
    under model.language_model.: the head is found and counted from there (it was not: inspect listed none, and
    --mtp drop|only did not see it)."""
    import transformers

    v = tmp_path / "glm4v"
    v.mkdir()
    state = {("model.language_model." + n.removeprefix("model.") if n.startswith("model.") else n): t
             for n, t in tensors(glm).items()}
    save_file(state, str(v / "model.safetensors"), metadata={"format": "pt"})
    # (attention_bias: the glm fixture's weights have none, where Glm4vMoeTextConfig's default has them)
    text = {**tiny_models.COMMON, **GLM[2], "num_nextn_predict_layers": 1, "attention_bias": False}
    cfg = transformers.Glm4vMoeConfig(text_config=text, vision_config={"depth": 1, "hidden_size": 32,
                                                                       "out_hidden_size": 64}).to_dict()
    assert "num_hidden_layers" not in cfg and "num_nextn_predict_layers" not in cfg  # text_config's alone
    (v / "config.json").write_text(json.dumps({**cfg, "architectures": ["Glm4vMoeForConditionalGeneration"]}))
    block = "model.language_model.layers.2"
    with open_checkpoint(v) as c:
        (head,) = mtp.find_heads(c, c.config)
        assert head.name == block and head.blocks == (2,) and len(head.own()) == 6
        assert mtp.check_count((head,), c.config) is None
        assert "num_nextn_predict_layers is 1 but the tensors hold 0" in mtp.check_count((), c.config)
    s = json.loads(run_cli("inspect", v, "--json").output)
    assert [h["name"] for h in s["mtp"]] == [block] and s["mtp"][0]["ffn"] == {"expert": 4, "shared": 1}
    assert s["mtp_count"] is None
    mine = {n for n in state if n.startswith(block + ".")}
    for mode, want in (("drop", set(state) - mine), ("only", mine)):
        run_cli("convert", v, "--to", "torch", "-o", tmp_path / mode, "--mtp", mode)
        assert set(tensors(tmp_path / mode)) == want, mode
        with open_checkpoint(tmp_path / mode) as c:
            assert mtp.recorded(c.metadata)["heads"] == [block], mode
    # its head runs as a draft as GLM-4.5's text model runs it (the language model's tensors and text_config): the
    # drafts of the same weights stored as glm4_moe, share for share (verify said "not judged" for glm4v_moe)
    from ffn_tools.formats import registry
    from ffn_tools.verification.heads import _drafts

    with registry().open_any(v) as a, registry().open_any(glm) as g:  # verify's call (vocab_size: text_config's)
        x, y = _drafts(a, a)[block], _drafts(g, g)["model.layers.2"]
    assert not isinstance(x, str) and not isinstance(y, str), (x, y)
    assert x.head == block and x.unjudged is None and x.agree == 1.0
    assert (x.a, x.b, x.floor_agree) == (y.a, y.b, y.floor_agree), (x, y)


def test_found_without_config():
    """No config: a block holding a head's own tensors is one (counted from the tensors)."""
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(3)] + ["model.layers.2.eh_proj.weight"]
    assert [h.name for h in mtp.find_heads(names, None)] == ["model.layers.2"]
    assert mtp.find_heads(names[:3], None) == ()  # a plain third layer is no head
    q = ["mtp.fc.weight", "mtp.layers.0.mlp.gate_proj.weight", "mtp.norm.weight", "model.norm.weight"]
    (head,) = mtp.find_heads(q, {"model_type": "qwen3_next", "mtp_num_hidden_layers": 1})
    assert head.name == "mtp" and head.blocks == (0,) and head.own() == ["fc", "norm"] and len(head.tensors) == 3
    mimo = ["model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.mlp.up_proj.weight"]
    assert [h.blocks for h in mtp.find_heads(mimo, {"num_nextn_predict_layers": 1})] == [(0,)]


def test_inspect_lists_the_head_apart(deepseek, tmp_path):
    r = run_cli("inspect", deepseek, "--json")
    s = json.loads(r.output)
    assert s["layers"] == 2 and s["config_layers"] == 2
    (head,) = s["mtp"]
    assert head["name"] == "model.layers.2" and head["ffn"] == {"expert": 4, "shared": 1}
    assert s["ffn"]["expert"]["layers"] == 1  # the main model's one MoE layer, not the head's
    text = run_cli("inspect", deepseek).output
    assert "config: 2" not in text and "mtp head" in text and "model.layers.2" in text
    lost = unrecorded(deepseek, tmp_path / "lost")  # the head gone, unrecorded (as transformers' save leaves it)
    s = json.loads(run_cli("inspect", lost, "--json").output)
    assert s["mtp"] == [] and "num_nextn_predict_layers is 1 but the tensors hold 0" in s["mtp_count"]
    assert "mtp heads" in run_cli("inspect", lost).output


@pytest.mark.parametrize("mode", ["keep", "drop", "only"])
def test_torch_mtp(deepseek, tmp_path, mode):
    out = tmp_path / "out"
    args = ("convert", deepseek, "--to", "torch", "-o", out, "--json") + (("--mtp", mode) if mode != "keep" else ())
    r = json.loads(run_cli(*args).output)
    src, got = tensors(deepseek), tensors(out)
    head = {n for n in src if n.startswith("model.layers.2.")}
    want = {"keep": set(src), "drop": set(src) - head, "only": head}[mode]
    assert set(got) == want
    assert all(torch.equal(got[n], src[n]) for n in got)
    said = [c for c in r["changes"] if "MTP head model.layers.2" in c]
    assert len(said) == 1 and {"keep": "kept", "drop": "dropped", "only": "alone"}[mode] in said[0]
    with open_checkpoint(out) as c:
        rec = mtp.recorded(c.metadata)
    assert (rec or {}).get("mtp") == (None if mode == "keep" else mode)
    if mode == "drop":
        assert rec["heads"] == ["model.layers.2"]
        s = json.loads(run_cli("inspect", out, "--json").output)
        assert s["mtp"] == [] and s["mtp_count"] is None  # dropped on purpose, recorded: no count disagreement
    else:
        assert json.loads(run_cli("inspect", out, "--json").output)["mtp_count"] is None


def test_mtp_refused_where_it_does_not_apply(deepseek, tmp_path):
    r = run_cli("convert", deepseek, "--to", "flax", "-o", tmp_path / "f", "--mtp", "drop", ok=False)
    assert "--mtp does not apply to --to flax" in r.output


@pytest.fixture(scope="module")
def dropped(deepseek, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mtp-drop") / "out"
    run_cli("convert", deepseek, "--to", "torch", "-o", out, "--mtp", "drop")
    return out


def unrecorded(src: Path, dst: Path) -> Path:
    """``src`` without its head and without the record of ``--mtp drop``: a head silently lost."""
    dst.mkdir(parents=True)
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    state = {n: t for n, t in tensors(src).items() if not n.startswith("model.layers.2.")}
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_verify_names_a_lost_head(deepseek, dropped, tmp_path):
    lost = unrecorded(deepseek, tmp_path / "lost")
    r = json.loads(run_cli("verify", deepseek, lost, "--json", "--no-load-check", ok=None).output)
    assert not r["passed"]
    (line,) = [p for p in r["problems"] if "MTP head model.layers.2" in p]
    assert "B lacks" in line and "--mtp drop" in line
    assert not any("layer 2" in x for x in r["only_a"])  # the head's FFNs named once, as the head
    # the same head left out by --mtp drop, recorded in B: a note, and the rest verified
    r = json.loads(run_cli("verify", deepseek, dropped, "--json", "--no-load-check").output)
    assert r["passed"] and any("MTP head model.layers.2" in n and "on purpose" in n for n in r["notes"])


def test_verify_names_a_part_of_a_head(deepseek, tmp_path):
    part = tmp_path / "part"
    part.mkdir()
    (part / "config.json").write_bytes((deepseek / "config.json").read_bytes())
    state = {n: t for n, t in tensors(deepseek).items() if n != "model.layers.2.eh_proj.weight"}
    save_file(state, str(part / "model.safetensors"), metadata={"format": "pt"})
    r = json.loads(run_cli("verify", deepseek, part, "--json", "--no-load-check", ok=None).output)
    assert not r["passed"] and any("only part of A's MTP head model.layers.2" in p and "eh_proj" in p
                                   for p in r["problems"])
    fused = tmp_path / "fused"  # its FFNs fused: paired as FFNs, the head whole
    run_cli("fuse-gateup", deepseek, "-o", fused)
    r = json.loads(run_cli("verify", deepseek, fused, "--json", "--no-load-check").output)
    assert r["passed"] and not any("MTP" in p for p in r["problems"])
    (note,) = [n for n in r["notes"] if "MTP head" in n]  # its drafts run on B's fused FFNs, read as A names them
    assert "B's drafts are A's on 100.0% of 124 positions" in note, note
    s = json.loads(run_cli("inspect", fused, "--json").output)
    assert s["mtp"][0]["ffn"] == {"expert": 4, "shared": 1} and s["layers"] == 2


def test_mlx_places_the_head_beside_the_model(deepseek, tmp_path):
    """mlx_lm's model has no place for a NextN block (its sanitize drops it, or the load fails): the MLX model is
    written without it and the head beside it as mtp.safetensors, said; --to torch from that directory brings it
    back bit for bit, and verify against the source compares the head too."""
    pytest.importorskip("mlx_lm")
    out, back = tmp_path / "mlx", tmp_path / "back"
    r = json.loads(run_cli("convert", deepseek, "--to", "mlx", "-o", out, "--json").output)
    assert any("MTP head model.layers.2" in c and mtp.HEAD_FILE in c for c in r["changes"])
    with open_checkpoint(out / mtp.HEAD_FILE) as c:
        assert set(c) == {n for n in tensors(deepseek) if n.startswith("model.layers.2.")}
    with open_checkpoint(out) as c:  # the model's own weights hold no head tensor: mlx_lm loads them strictly
        assert not any(n.startswith("model.layers.2.") for n in c)
    run_cli("convert", out, "--to", "torch", "-o", back)
    src, got = tensors(deepseek), tensors(back)
    assert set(got) == set(src) and all(torch.equal(got[n], src[n]) for n in src)
    v = json.loads(run_cli("verify", deepseek, out, "--json", "--no-load-check").output)
    assert v["passed"] and not v["only_a"] and v["outside"]["only_a"] == []
    (note,) = [n for n in v["notes"] if "MTP head" in n]  # its drafts run, said always, with their floor
    assert note.startswith("A's MTP head model.layers.2 (nextn, 32 tensors): in B and agreeing with A's (B's drafts "
                           "are A's on 100.0% of 124 positions") and "floor, A's head in float32: 100.0% as A's" in note


def test_mlx_drop_is_recorded_and_only_refused(glm, tmp_path):
    pytest.importorskip("mlx_lm")
    out = tmp_path / "mlx"
    r = json.loads(run_cli("convert", glm, "--to", "mlx", "-o", out, "--mtp", "drop", "--json").output)
    assert any(c.startswith("dropped the MTP head model.layers.2") for c in r["changes"])
    assert not (out / mtp.HEAD_FILE).exists()
    with open_checkpoint(out) as c:
        assert mtp.recorded(c.metadata)["mtp"] == "drop"
    run_cli("convert", out, "--to", "torch", "-o", tmp_path / "back")  # the record travels on: still on purpose
    v = json.loads(run_cli("verify", glm, tmp_path / "back", "--json", "--no-load-check").output)
    assert v["passed"] and any("left out on purpose" in n for n in v["notes"])
    r = run_cli("convert", glm, "--to", "mlx", "-o", tmp_path / "only", "--mtp", "only", ok=False)
    assert "--mtp only" in r.output and "--to torch --mtp only" in r.output


def test_other_formats_say_what_became_of_the_head(deepseek, tmp_path):
    """A format with no --mtp of its own: the output, opened again, says whether it holds the head (Flax's
    Hugging Face tree keeps every name)."""
    r = json.loads(run_cli("convert", deepseek, "--to", "flax", "-o", tmp_path / "f", "--json").output)
    assert any(c.startswith("kept the MTP head model.layers.2") and "--mtp" not in c for c in r["changes"])


def test_gguf_deepseek_v3_head_is_dropped_recorded_and_only_refused(gguf_model, tmp_path):
    """llama.cpp's DeepSeek-V3 converter class (DeepseekV2Model) writes no NextN block and has no --mtp: --to gguf
    writes its file (tensor for tensor, key for key convert_hf_to_gguf.py's), says the head was dropped and records
    it in the metadata (read back as verify reads it: left out on purpose); --mtp drop writes the same file; --mtp only
    is refused naming why, nothing written. On main the head's absence was a warning, and nothing recorded it."""
    import shutil

    import gguf_models
    from ffn_tools.converters.gguf.header import Reader
    from ffn_tools.converters.gguf.reader import field_values

    src = gguf_model("deepseek_v3")  # GPT-2's vocabulary, which the converter's DeepSeek class reads
    ids = {k: v for k, v in json.loads((src / "config.json").read_text()).items()
           if k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    cfg_name, model_name, extra = tiny_models.ARCHS["deepseek_v3"]
    a = with_head("deepseek_v3", tmp_path / "a", (cfg_name, model_name, {**extra, **ids}))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, a / f.name)
    out = tmp_path / "a.gguf"
    r = json.loads(run_cli("-q", "convert", a, "--to", "gguf", "-o", out, "--outtype", "f32", "--json").stdout)
    assert any(c.startswith("dropped the MTP head model.layers.2 (32 tensors): llama.cpp's converter class for this "
                            "model (DeepseekV2Model) writes none") for c in r["changes"]), r["changes"]
    assert not r.get("warnings"), r["warnings"]
    (tmp_path / "ref").mkdir()
    ref = gguf_models.convert_reference(a, tmp_path / "ref" / "a.gguf", "f32")
    ours, theirs = Reader(out), Reader(ref)
    assert [(t.name, t.tensor_type, bytes(t.data)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, bytes(t.data)) for t in theirs.tensors]
    fo, ft = field_values(ours), field_values(theirs)
    assert json.loads(fo.pop(mtp.RECORD)) == {"mtp": "drop", "heads": ["model.layers.2"], "tensors": 32}
    assert fo == ft
    del ours, theirs
    run_cli("-q", "convert", a, "--to", "gguf", "-o", tmp_path / "drop.gguf", "--outtype", "f32", "--mtp", "drop")
    assert (tmp_path / "drop.gguf").read_bytes() == out.read_bytes()
    refused = run_cli("convert", a, "--to", "gguf", "-o", tmp_path / "only.gguf", "--mtp", "only", ok=False)
    assert "--mtp only: llama.cpp's converter class for this model (DeepseekV2Model) writes no MTP head" in \
        " ".join(refused.output.split()) and not (tmp_path / "only.gguf").exists()
    from ffn_tools.converters import open_any

    with open_any(out) as b:  # read back as verify and inspect read it: dropped on purpose, no count disagreement
        assert mtp.recorded(b.metadata)["mtp"] == "drop" and mtp.find_heads(b, b.config) == ()
        assert mtp.check_count((), b.config, b.metadata) is None


def test_a_silent_drop_is_a_warning():
    """An output lacking a head it does not record dropping (say a writer with no place for it): a warning naming
    the head; recorded: said as dropped; an export that said it already: nothing added."""
    (head,) = mtp.find_heads(["model.layers.2.eh_proj.weight", "model.layers.2.mlp.up_proj.weight"],
                             {"num_hidden_layers": 2, "num_nextn_predict_layers": 1})
    base = {"changes": ["wrote x"]}
    lost = mtp.said_of_output((head,), "gguf", base, lambda: (frozenset({"model.embed_tokens.weight"}), {}))
    assert lost["changes"] == ["wrote x"] and "gguf output lacks the MTP head model.layers.2" in lost["warnings"][0]
    dropped = mtp.said_of_output((head,), "gguf", base, lambda: (frozenset(), mtp.record("drop", (head,))))
    assert dropped["changes"][-1].startswith("dropped the MTP head model.layers.2") and "warnings" not in dropped
    told = {"changes": ["dropped the MTP head model.layers.2 (...)"]}
    assert mtp.said_of_output((head,), "gguf", told, lambda: None) is told


def _planted(src: Path, dst: Path, edit) -> Path:
    dst.mkdir(parents=True)
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    state = tensors(src)
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _swap_halves(s):
    w = s["model.layers.2.eh_proj.weight"]
    s["model.layers.2.eh_proj.weight"] = torch.cat(w.chunk(2, dim=1)[::-1], dim=1).contiguous()


def _swap_norms(s):
    s["model.layers.2.enorm.weight"], s["model.layers.2.hnorm.weight"] = (s["model.layers.2.hnorm.weight"],
                                                                          s["model.layers.2.enorm.weight"])


def _other_head(s):
    s["model.layers.2.shared_head.head.weight"] = torch.randn_like(s["model.layers.2.shared_head.head.weight"])


@pytest.mark.parametrize("edit, names", [(_swap_halves, ["eh_proj"]), (_swap_norms, ["enorm", "hnorm"]),
                                         (_other_head, ["shared_head.head"])])
def test_planted_head_defects_fail_naming_the_head(deepseek, tmp_path, edit, names):
    bad = _planted(deepseek, tmp_path / "bad", edit)
    r = json.loads(run_cli("verify", deepseek, bad, "--json", "--no-load-check", ok=None).output)
    assert not r["passed"]
    differ = " ".join(r["outside"]["differ"])
    assert all(f"model.layers.2.{n}.weight" in differ for n in names)
    (line,) = [p for p in r["problems"] if p.startswith("A's MTP head model.layers.2")]
    assert "differs in B" in line and all(n in line for n in names)


def test_draft_acceptance(deepseek, tmp_path):
    """The NextN block run as a draft (DeepSeek form) on A's hidden states: A's head agrees with itself, a head with
    eh_proj's halves swapped does not, and a draft at position i reads no token past i+1 (causal)."""
    from ffn_tools.formats import registry
    from ffn_tools.verification.draft import acceptance, drafts

    bad = _planted(deepseek, tmp_path / "bad", _swap_halves)
    tokens = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with registry().open_any(deepseek) as a, registry().open_any(bad) as b:
        (same,) = acceptance(a, a, tokens)
        (swapped,) = acceptance(a, b, tokens)
        assert same.agree == 1.0 and same.a == same.b and same.positions == 22
        assert swapped.agree < 0.5 and "model.layers.2" in swapped.line()
        (head,) = mtp.find_heads(a, a.config)
        t = {n: a[n] for n in head.tensors}
        hidden = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(1))
        embed = a["model.embed_tokens.weight"]
        later = tokens[:1].clone()
        later[0, -1] = (later[0, -1] + 1) % 96
        d1, d2 = (drafts(a.config, t, head, hidden, x, embed) for x in (tokens[:1], later))
        assert torch.equal(d1[0, :-1], d2[0, :-1])


QWEN3_NEXT = ("Qwen3NextConfig", "Qwen3NextForCausalLM",
              {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
               "shared_expert_intermediate_size": 48, "head_dim": 16, "linear_num_value_heads": 4,
               "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
               "layer_types": ["linear_attention", "full_attention"], "decoder_sparse_step": 1})


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> Path:
    """A tiny Qwen3-Next (transformers) with its MTP module written as the published checkpoints lay it out:
    ``mtp.fc``, ``mtp.pre_fc_norm_embedding``/``hidden``, ``mtp.norm`` and one block ``mtp.layers.0`` (a
    full-attention MoE layer, experts one by one), ``mtp_num_hidden_layers`` 1."""
    import transformers

    cfg_name, model_name, extra = QWEN3_NEXT
    config = getattr(transformers, cfg_name)(**{**tiny_models.COMMON, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    h, i = config.hidden_size, config.moe_intermediate_size
    g = torch.Generator().manual_seed(2)
    for name, t in list(state.items()):
        if name.startswith("model.layers.1."):
            tail = name.removeprefix("model.layers.1.")
            if tail == "mlp.experts.gate_up_proj":
                for e in range(t.shape[0]):
                    state[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = t[e, :i].clone()
                    state[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = t[e, i:].clone()
            elif tail == "mlp.experts.down_proj":
                for e in range(t.shape[0]):
                    state[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = t[e].clone()
            else:
                state[f"mtp.layers.0.{tail}"] = t.clone() + 0.01
    for name, shape in (("fc", (h, 2 * h)), ("pre_fc_norm_embedding", (h,)), ("pre_fc_norm_hidden", (h,)),
                        ("norm", (h,))):
        state[f"mtp.{name}.weight"] = torch.randn(shape, generator=g) * 0.05
    path = tmp_path_factory.mktemp("mtp-qn") / "model"
    path.mkdir()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "mtp_num_hidden_layers": 1,
                                                  "architectures": [model_name]}, indent=2))
    return path


def test_an_mtp_module_family(qwen3_next, tmp_path):
    """Qwen3-Next's ``mtp.*``: found and listed apart (not FFN-like tensors no FFN claimed: its tensors are the
    head's, compared as such), dropped on purpose or named when lost."""
    s = json.loads(run_cli("inspect", qwen3_next, "--json").output)
    (head,) = s["mtp"]
    assert head["name"] == "mtp" and head["blocks"] == [0] and head["layout"] == "mtp"
    assert head["own"] == ["fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"]
    assert s["unmatched_ffn_like"] == [] and s["warnings"] == [] and s["mtp_count"] is None
    run_cli("convert", qwen3_next, "--to", "torch", "-o", tmp_path / "d", "--mtp", "drop")
    assert not any(n.startswith("mtp.") for n in tensors(tmp_path / "d"))
    lost = _planted(qwen3_next, tmp_path / "lost", lambda s: [s.pop(n) for n in list(s) if n.startswith("mtp.")])
    r = json.loads(run_cli("verify", qwen3_next, lost, "--json", "--no-load-check", ok=None).output)
    assert not r["passed"] and any(p.startswith("B lacks A's MTP head mtp (mtp,") for p in r["problems"])
    r = json.loads(run_cli("verify", qwen3_next, tmp_path / "d", "--json", "--no-load-check").output)
    assert r["passed"]


def test_a_refusal_names_the_head(deepseek, tmp_path):
    """torchtitan's DeepSeek-V3 names have no place for the NextN head's own tensors: the refusal says they are
    the head's."""
    r = run_cli("convert", deepseek, "--to", "dcp", "-o", tmp_path / "d", ok=False)
    assert "model.layers.2.eh_proj.weight" in r.output and "of the MTP head model.layers.2" in r.output


def test_an_mtp_module_s_ffns_are_ffns(qwen3_next, tmp_path):
    """The ``mtp.layers.*`` blocks' FFNs are FFNs numbered after the main layers (``mtp.layers.0`` is layer 2 of a
    2-layer model, as DeepSeek numbers its NextN block): inspect counts them as the head's, extract --layers 2
    takes them, and verify pairs the head's experts (a defect in one fails as that FFN)."""
    s = json.loads(run_cli("inspect", qwen3_next, "--json").output)
    assert s["mtp"][0]["ffn"] == {"expert": 4, "shared": 1} and s["layers"] == 2
    assert s["ffn"]["expert"]["layers"] == 2  # the main model's two MoE layers, not the head's
    out = tmp_path / "x"
    run_cli("extract", qwen3_next, "--layers", "2", "-o", out)
    got = tensors(out)
    assert len(got) == 15 and any(".experts." in n for n in got)
    with open_checkpoint(qwen3_next) as c:
        assert torch.equal(got["layers.2.experts.3.down.weight"], c["mtp.layers.0.mlp.experts.3.down_proj.weight"])
    v = json.loads(run_cli("verify", qwen3_next, qwen3_next, "--json", "--no-load-check", "--layers", "2").output)
    assert v["passed"] and sorted(f["ffn"] for f in v["ffns"]) == sorted(
        [f"layer 2 expert {e}" for e in range(4)] + ["layer 2 shared expert"])
    name = "mtp.layers.0.mlp.experts.3.down_proj.weight"
    bad = _planted(qwen3_next, tmp_path / "bad", lambda s: s.__setitem__(name, s[name] * 1.5))
    v = json.loads(run_cli("verify", qwen3_next, bad, "--json", "--no-load-check", ok=None).output)
    failed = [f["ffn"] for f in v["ffns"] if not f["passed"]]
    assert not v["passed"] and failed == ["layer 2 expert 3"] and name not in " ".join(v["outside"]["differ"])


def test_every_mtp_module_is_numbered_after_the_main_layers():
    """Each ``prefix`` layout of schemes/mtp.json has its blocks among the families' layer prefixes, numbered from
    ``num_hidden_layers`` (families.json): a head's FFNs are found as FFNs of every family with a head."""
    from ffn_tools.library import LIBRARY

    placed = {(g.prefix, g.first_layer) for g in LIBRARY}
    prefixed = [lay for lay in mtp.LAYOUTS if lay.kind == "prefix"]
    assert len(prefixed) == 3 and all((lay.blocks, "num_hidden_layers") in placed for lay in prefixed)


def test_a_head_b_lacks_is_decided_before_the_comparison(deepseek, dropped, tmp_path):
    """``heads.Heads.decide``: a head B lacks whole is left out before anything is compared (its tensors out of the
    comparison by name, its FFNs out of the pairing), and said once; a head B holds even in part is compared."""
    from ffn_tools.detect import find_ffns
    from ffn_tools.formats import registry
    from ffn_tools.verification.heads import Heads

    part = _planted(deepseek, tmp_path / "part", lambda s: s.pop("model.layers.2.eh_proj.weight"))
    with registry().open_any(deepseek) as a, registry().open_any(dropped) as b, registry().open_any(part) as p:
        fa, fb, fp = find_ffns(a), find_ffns(b), find_ffns(p)
        heads = Heads.decide(a, b, fa, fb)
        ((head, recorded),) = heads.absent
        assert recorded and heads.present == () and heads.left_out() == frozenset(head.tensors)
        kept = heads.without(fa)
        assert {f.ref.layer for f in kept.ffns} == {0, 1} and not kept.tensors & heads.left_out()
        assert len(fa.ffns) - len(kept.ffns) == 5  # the head's 4 experts and its shared expert
        partly = Heads.decide(a, p, fa, fp)
        assert partly.absent == () and [h.name for h in partly.present] == ["model.layers.2"]
        assert partly.left_out() == frozenset() and partly.without(fa) is fa
    r = json.loads(run_cli("verify", deepseek, dropped, "--json", "--no-load-check").output)
    assert r["passed"] and [n for n in r["notes"] if "MTP head" in n] == [
        "A's MTP head model.layers.2 (nextn, 32 tensors) is not in B: left out on purpose (B records --mtp drop)"]
    assert not r["only_a"] and not any(n.startswith("model.layers.2.") for n in r["outside"]["only_a"])
    r = json.loads(run_cli("verify", deepseek, dropped, "--json", "--no-load-check", "--layers", "1-2").output)
    assert r["passed"] and {f["layer"] for f in r["ffns"]} == {1}  # the head's layer not compared, said once
    r = run_cli("verify", deepseek, dropped, "--no-load-check", "--layers", "2", ok=False)
    assert "the layers of A's MTP head model.layers.2 alone, which B does not hold" in r.output


def test_drafts_held_to_their_floor(deepseek, tmp_path):
    """B's head in bfloat16 is its own floor (A's head cast to B's dtype): its drafts are the floor's, said with
    it, and verify passes; a share below the floor past its slack fails, naming what fell."""
    from ffn_tools.formats import registry
    from ffn_tools.verification.draft import Acceptance, acceptance

    bf16 = _planted(deepseek, tmp_path / "bf16", lambda s: s.update({n: t.to(torch.bfloat16) for n, t in s.items()}))
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with registry().open_any(deepseek) as a, registry().open_any(bf16) as b:
        (x,) = acceptance(a, b, tokens)
    assert x.dtype == "bfloat16" and (x.agree, x.b) == (x.floor_agree, x.floor_b) and x.below() is None
    v = json.loads(run_cli("verify", deepseek, bf16, "--json", "--no-load-check").output)
    (note,) = [n for n in v["notes"] if "MTP head" in n]
    assert v["passed"] and "agreeing" in note and "floor, A's head in bfloat16" in note
    low = Acceptance("model.layers.2", 124, agree=0.7, a=0.1, b=0.1, floor_agree=0.95, floor_b=0.1, dtype="bfloat16")
    assert "B's drafts as A's 70.0% < 95.0%" in low.below() and "next token" not in low.below()
    near = Acceptance("model.layers.2", 124, agree=0.93, a=0.1, b=0.1, floor_agree=0.95, floor_b=0.1, dtype="bf16")
    assert near.below() is None  # within three standard deviations of 124 positions
    quant = Acceptance("h", 124, agree=0.7, a=0.1, b=0.1, unjudged="B's head is quantized")
    assert quant.below() is None and "not judged: B's head is quantized" in quant.line()


def test_qwen3_next_drafts(qwen3_next, tmp_path):
    """Qwen3-Next's form (``mtp.fc`` over the normed embedding and hidden state, the block as full attention,
    ``mtp.norm``, the main model's head) run as a draft: A's head agrees with itself, ``mtp.fc``'s halves swapped do
    not, and verify says the drafts of a head that agrees, with their floor."""
    from ffn_tools.formats import registry
    from ffn_tools.verification.draft import acceptance

    def swap(s):
        s["mtp.fc.weight"] = torch.cat(s["mtp.fc.weight"].chunk(2, dim=1)[::-1], dim=1).contiguous()

    bad = _planted(qwen3_next, tmp_path / "bad", swap)
    tokens = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with registry().open_any(qwen3_next) as a, registry().open_any(bad) as b:
        (same,) = acceptance(a, a, tokens)
        (swapped,) = acceptance(a, b, tokens)
    assert same.agree == 1.0 and same.floor_agree == 1.0 and same.positions == 22
    assert swapped.agree < 0.7 and swapped.below() is not None
    v = json.loads(run_cli("verify", qwen3_next, qwen3_next, "--json", "--no-load-check").output)
    (note,) = [n for n in v["notes"] if "MTP head" in n]
    assert v["passed"] and "B's drafts are A's on 100.0%" in note and "floor, A's head in" in note


def test_a_nested_config_numbers_the_head(qwen3_next, tmp_path):
    """A multimodal config.json (Qwen3.5's) holds num_hidden_layers in text_config: the MTP module's blocks are
    numbered after it all the same (not a refusal naming the missing key)."""
    from ffn_tools.detect import find_ffns

    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "model.safetensors").symlink_to(qwen3_next / "model.safetensors")
    cfg = json.loads((qwen3_next / "config.json").read_text())
    cfg["text_config"] = {"num_hidden_layers": cfg.pop("num_hidden_layers")}
    (nested / "config.json").write_text(json.dumps(cfg))
    with open_checkpoint(nested) as c:
        layers = {f.ref.layer for f in find_ffns(c).ffns if f.names["down"].startswith("mtp.")}
    assert layers == {2}
    # split and fuse name the head's tensors through the same numbering (they raised over the missing top-level key):
    # the head's per-expert tensors come through split as stored, and fuse gives the input back
    # (test_a_mixed_form_round_trip)
    _round_trip(nested, tmp_path)


def _round_trip(src: Path, tmp_path: Path) -> Path:
    """split-gateup then fuse-gateup of ``src`` (its main layers' experts stacked, its MTP head's one by one): the
    head's tensors come through split as stored, the main layers' are split, and fuse writes back ``src``'s file
    byte for byte (names, layout, order, metadata); the fused output's path."""
    run_cli("split-gateup", src, "-o", tmp_path / "split")
    run_cli("fuse-gateup", tmp_path / "split", "-o", tmp_path / "fused")
    a, split = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "split" / "model.safetensors"))
    head = [k for k in a if k.startswith("mtp.") and ".experts." in k]
    assert head and all(torch.equal(a[k], split[k]) for k in head)
    assert "model.layers.1.mlp.experts.gate_up_proj" in a and "model.layers.1.mlp.experts.gate_up_proj" not in split
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in split
    fused = tmp_path / "fused"
    assert set(tensors(fused)) == set(a)
    assert (fused / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    return fused


def test_a_mixed_form_round_trip(qwen3_next, tmp_path):
    """A checkpoint whose MTP head's experts are stored one by one and its main layers' stacked (transformers 5's
    state dict beside the published head) comes back from split-gateup + fuse-gateup as it was given, each layer's
    experts in their own form, and verify passes it: fuse stacked the head's experts too, split-gateup's record
    holding one form per group for the whole checkpoint (now also the layers whose form was not their group's)."""
    from ffn_tools.gateup.common import SPLIT_FROM

    fused = _round_trip(qwen3_next, tmp_path)
    with open_checkpoint(tmp_path / "split") as c:
        assert json.loads(c.metadata[SPLIT_FROM]) == {"mlp.experts": "stacked", "mlp.experts layer 2": "separate",
                                                     "mlp.shared_expert": "separate"}
    v = json.loads(run_cli("verify", qwen3_next, fused, "--json", "--no-load-check").output)
    assert v["passed"] and not v["problems"]


@pytest.fixture(scope="module")
def mimo(tmp_path_factory) -> Path:
    """A tiny MiMo: a Qwen2 model of 2 main layers (config model_type mimo, as MiMo's remote code writes it) and one
    MTP layer ``model.mtp_layers.0`` laid out as MiMo's checkpoints are: a Qwen2 decoder block with
    ``token_layernorm``, ``hidden_layernorm``, ``input_proj`` and ``final_layernorm`` inside it."""
    import transformers

    cfg_name, model_name, extra = tiny_models.ARCHS["qwen2"]
    config = getattr(transformers, cfg_name)(**{**tiny_models.COMMON, **extra, "num_hidden_layers": 3})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    state = {}
    for n, t in model.state_dict().items():
        state[n.replace("model.layers.2.", "model.mtp_layers.0.")] = t.contiguous() + torch.randn_like(t) * 0.02
    h, g = config.hidden_size, torch.Generator().manual_seed(3)
    for name, shape in (("token_layernorm", (h,)), ("hidden_layernorm", (h,)), ("input_proj", (h, 2 * h)),
                        ("final_layernorm", (h,))):
        state[f"model.mtp_layers.0.{name}.weight"] = (torch.randn(shape, generator=g) * 0.05
                                                      + (1.0 if "norm" in name else 0.0))
    path = tmp_path_factory.mktemp("mtp-mimo") / "model"
    path.mkdir()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**config.to_dict(), "model_type": "mimo", "num_hidden_layers": 2, "num_nextn_predict_layers": 1,
           "architectures": ["MiMoForCausalLM"]}
    cfg["layer_types"] = cfg["layer_types"][:2]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def test_mimo_drafts(mimo, tmp_path):
    """MiMo's form ([hidden; embedding] into input_proj, the Qwen2 block, final_layernorm, the main lm_head): its
    block's FFN is the head's (layer 2), A's head agrees with itself, input_proj's halves swapped do not."""
    from ffn_tools.detect import find_ffns
    from ffn_tools.formats import registry
    from ffn_tools.verification.draft import acceptance

    def swap(s):
        w = s["model.mtp_layers.0.input_proj.weight"]
        s["model.mtp_layers.0.input_proj.weight"] = torch.cat(w.chunk(2, dim=1)[::-1], dim=1).contiguous()

    bad = _planted(mimo, tmp_path / "bad", swap)
    tokens = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with registry().open_any(mimo) as a, registry().open_any(bad) as b:
        (head,) = mtp.find_heads(a, a.config)
        assert head.name == "model.mtp_layers" and head.own() == ["token_layernorm", "hidden_layernorm",
                                                                   "input_proj", "final_layernorm"]
        assert [f.ref.layer for f in find_ffns(a).ffns] == [0, 1, 2]
        (same,) = acceptance(a, a, tokens)
        (swapped,) = acceptance(a, b, tokens)
    assert same.agree == 1.0 and same.positions == 22
    assert swapped.agree < 0.7 and swapped.below() is not None


def test_a_form_runs_for_its_own_family_only(qwen3_next, tmp_path):
    """Another family laying its head out alike (EXAONE-MoE's ``mtp.*``) is not run in Qwen3-Next's form: refused,
    naming the forms the reference runs."""
    from ffn_tools.errors import FFNToolsError
    from ffn_tools.formats import registry
    from ffn_tools.verification.draft import acceptance

    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").symlink_to(qwen3_next / "model.safetensors")
    cfg = json.loads((qwen3_next / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "exaone_moe"}))
    with registry().open_any(other) as a, pytest.raises(FFNToolsError, match="not the mtp head of a exaone_moe"):
        acceptance(a, a, torch.zeros(1, 4, dtype=torch.long))


def test_a_large_main_model_is_not_run(deepseek, monkeypatch):
    """The reference runs A's main model in float32 on this machine's CPU: past ``MAIN_LIMIT`` it refuses, saying
    the size, and verify says the drafts were not run instead of loading hundreds of GiB."""
    from ffn_tools.errors import FFNToolsError
    from ffn_tools.formats import registry
    from ffn_tools.verification import draft

    monkeypatch.setattr(draft, "MAIN_LIMIT", 1024)
    with registry().open_any(deepseek) as a, pytest.raises(FFNToolsError, match="in float32, past the draft"):
        draft.acceptance(a, a, torch.zeros(1, 4, dtype=torch.long))
