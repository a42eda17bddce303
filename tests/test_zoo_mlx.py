"""MLX export of transformers' zoo: every gated causal-LM type mlx_lm has a model for, built tiny.

Each type is built with its own attention/MLP bias and head-tying defaults (the zoo's TINY forces biases on
and heads untied, which mlx_lm's models, written for the real checkpoints, do not all have). For each:
``convert --to mlx`` succeeds, ``mlx_lm.load`` opens the output, its logits match transformers' within fp32
tolerance, and ``mlx_lm.convert`` of the same checkpoint (given the config keys the export added, which
mlx_lm cannot do without on transformers v5 configs) writes bit-identical tensors, plain and with ``-q``.
Exceptions are listed with their reason and checked, so a fix shows up as a failure here.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers import assert_identical, once, tensors, write_tokenizer
from test_zoo import BUDGET, TOO_BIG, UNBUILDABLE, zoo_root

import zoo
import ffn_tools
from ffn_tools.clients import runtime
from ffn_tools.converters import convert, open_any
from ffn_tools.errors import FFNToolsError
from ffn_tools.verification.steps import AsLoaded

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
import ffn_tools.converters.mlx.models as models  # noqa: E402  (our own: must import where mlx does)

KEEP = ("attention_bias", "mlp_bias", "tie_word_embeddings")
# Settings a type needs at this size, or that its real checkpoints have and transformers' defaults lack.
EXTRA = {
    "deepseek_v3": {"n_group": 1, "topk_group": 1},  # 4 experts cannot form the default 8 groups
    "deepseek_v32": {"n_group": 1, "topk_group": 1},
    "ernie4_5_moe": {"moe_k": 2},  # the default top-6 of 4 experts
    "phimoe": {"attention_bias": True, "lm_head_bias": True},  # as Phi-3.5-MoE (mlx_lm's phimoe has both)
    "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 128,  # its default config cannot build
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},  # 8 as DBRX: mlx_lm needs one
             "ffn_config": {"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2}},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},  # an attention layer among 2 (mlx_lm needs one)
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # its default leaves None
    "deepseek_v2": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,  # DeepSeek-V2's
                                        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "mscale": 0.707, "mscale_all_dim": 0.707}},  # (mlx_lm's reads it)
    "qwen2_moe": {"mlp_only_layers": []},  # experts in every layer, as Qwen1.5-MoE (mlx_lm's qwen2_moe has them so)
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},  # both kinds, as LFM2's checkpoints
    "recurrent_gemma": {"num_hidden_layers": 3, "num_key_value_heads": 1},  # its first attention layer is the
    # third; mlx_lm's has one key/value head, as RecurrentGemma-2B
}
_V4 = "mlx_lm 0.32's {} reads a transformers v4 config; 5.24's lacks or renamed {}"
# Gated types the module-tree oracle does not count (it counts DBRX's flat (E * I, H) expert stacks now).
ALSO_GATED: set[str] = set()
# model_type -> why ffn-tools refuses to export it (asserted: it refuses in one line, and mlx_lm.convert fails).
REFUSED = {
    "bailing_hybrid": _V4.format("bailing_hybrid", "n_group, group_norm_size, ..."),
    "bitnet": "mlx_lm's bitnet loads packed ternary weights with weight_scale; transformers saves them unpacked",
    "exaone4": "mlx_lm's exaone4 wants sliding_window_pattern as a string; transformers 5.24 writes a number",
    "gemma4_unified_text": "mlx_lm maps gemma4_unified to its multimodal gemma4, which wants language_model.* names",
    "granitemoehybrid": "mlx_lm's granitemoehybrid does not know transformers 5.24's linear_attention layers",
    "glm_moe_dsa": _V4.format("glm_moe_dsa", "moe_layer_freq, scoring_func, topk_method"),
    "kimi_linear": _V4.format("kimi_linear", "linear_attn_config"),
    "llama4_text": "mlx_lm's llama4_text is dense: no routed experts",
    "mimo_v2_flash": _V4.format("mimo_v2_flash", "hybrid_layer_pattern and 15 more"),
    "minicpm3": "mlx_lm's minicpm3 needs a rope_scaling dict; transformers 5.24 writes none",
    "minimax": _V4.format("minimax", "rotary_dim, shared_intermediate_size"),
    "minimax_m2": _V4.format("minimax", "rotary_dim, shared_intermediate_size"),
    "minimax_m3_vl_text": "mlx_lm's minimax_m3_vl is the multimodal model and wants text_config",
    "olmo": "mlx_lm's olmo imports ai2-olmo (hf_olmo), which is not installed",
    "olmo_hybrid": "mlx_lm's olmo_hybrid wants input_layernorm; transformers 5.24 saves attention_layer_norm",
    "solar_open": _V4.format("solar_open", "first_k_dense_replace, intermediate_size"),
}
# How mlx_lm.convert fails on each REFUSED type's checkpoint, with the mlx_lm pinned here (its own error, not any:
# a fix in mlx_lm, or another failure, shows up here).
MISSING_ARGS = (TypeError, "ModelArgs.__init__\\(\\) missing")
MLX_LM_FAILS = {
    "bailing_hybrid": MISSING_ARGS, "exaone4": MISSING_ARGS, "glm_moe_dsa": MISSING_ARGS,
    "kimi_linear": MISSING_ARGS, "llama4_text": MISSING_ARGS, "mimo_v2_flash": MISSING_ARGS,
    "minimax": MISSING_ARGS, "minimax_m2": MISSING_ARGS, "solar_open": MISSING_ARGS,
    "bitnet": (ValueError, "(?s)Missing .* parameters: .*weight_scale"),
    "gemma4_unified_text": (ValueError, "Model type gemma4_unified_text not supported"),
    "granitemoehybrid": (ValueError, "Unknown layer type: linear_attention"),
    "minicpm3": (AttributeError, "'NoneType' object has no attribute 'get'"),
    "minimax_m3_vl_text": (ValueError, "Model type minimax_m3_vl_text not supported"),
    "olmo": (SystemExit, "1"),  # mlx_lm's olmo exits when ai2-olmo is not installed
    "olmo_hybrid": (ValueError, "(?s)parameters not in model: .*attention_layer_norm"),
}
# model_type -> why mlx_lm.convert cannot read the transformers checkpoint that ffn-tools exports (asserted: it
# still fails);
# its reference is mlx_lm.convert of the checkpoint in the layout mlx_lm reads (OTHER_LAYOUT).
OTHER_LAYOUT = {
    "qwen3_5_moe_text": "mlx_lm's qwen3_5_moe sanitize stacks only experts.gate_up_proj (E, 2I, H); transformers "
                        "5.24 saves per-expert gate/up/down, which ffn-tools stacks in the export plan",
    "gpt_oss": "mlx_lm's gpt_oss sanitize reads OpenAI's layout, experts (E, out, in) named .weight; transformers "
               "saves (E, in, out) without .weight, which ffn-tools turns in the export plan",
}


def _other_layout(model_type: str, src: Path, dst: Path) -> Path:
    """``src`` in the layout mlx_lm reads: fuse-gateup --stack-experts' output, or (GPT-OSS) the experts turned
    to (E, out, in) and named .weight, with torch alone."""
    if model_type == "gpt_oss":
        from safetensors.torch import load_file, save_file

        shutil.copytree(src, dst)
        w = load_file(src / "model.safetensors")
        w = {(k + ".weight" if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else k):
             (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
             for k, v in w.items()}
        save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
        return dst
    from ffn_tools.gateup import fuse_gateup

    fuse_gateup(src, dst, stack_experts=True)
    return dst
# model_type -> why mlx_lm's own forward differs from transformers' (asserted: it still differs).
OTHER_LOGITS = {
    "glm": "mlx_lm's glm ropes the whole head; transformers' GlmConfig ropes half (partial_rotary_factor 0.5)",
    "jamba": "mlx_lm's jamba renormalizes the top-k router weights (jamba.py:244); transformers' leaves them "
             "unnormalized (modeling_jamba.py:696-697): every token, up to 0.05 (test_newuser_zoo pins it)",
    "ernie4_5_moe": "mlx_lm's sanitize drops moe_statics.e_score_correction_bias, which transformers adds before "
                    "choosing the top-k experts: 3 of 16 tokens routed otherwise (test_newuser_zoo pins it)",
}


# model_type -> the setting mlx_lm runs otherwise than transformers (``checks.semantics``, read from both clients'
# code): convert refuses the export unless told, verify fails naming it unless told (asserted both ways).
CLIENT_DIFFERS = {"jamba": "norm_topk_prob", "ernie4_5_moe": "router_bias", "glm4_moe_lite": "mla_norm_eps"}


def allowed(model_type: str) -> list[str]:
    """``allow_config`` for ``model_type``'s conversions: its ``CLIENT_DIFFERS`` setting, if any."""
    return [CLIENT_DIFFERS[model_type]] if model_type in CLIENT_DIFFERS else []


# model_type -> why verify cannot run on a correct export (asserted: it still cannot).
UNVERIFIED: dict[str, str] = {}


def _candidates() -> list[str]:
    out = []
    for t in zoo.causal_lm_types():
        if (t in UNBUILDABLE and t not in EXTRA) or t in TOO_BIG:
            continue
        if models.module_name({"model_type": t}) is not None:
            out.append(t)
    return out


def _built(request, model_type: str):
    """(path, {"logits", "tested"}) of the tiny model, built once per run (``test_zoo.zoo_root``)."""
    root = zoo_root(request, "zoo-mlx", Path(zoo.__file__).read_bytes() + repr((KEEP, EXTRA)).encode())

    def make(tmp: Path) -> None:
        tmp.mkdir()
        _, meta = zoo.meta_model(model_type, KEEP, EXTRA.get(model_type))
        small = sum(p.numel() for p in meta.parameters()) <= BUDGET
        gated = zoo.module_tree_counts(meta).as_tuple() != (0, 0, 0) or model_type in ALSO_GATED
        logits = None
        if small and gated:
            model = zoo.build(model_type, tmp / "model", keep=KEEP, extra=EXTRA.get(model_type))
            write_tokenizer(tmp / "model", json.loads((tmp / "model" / "config.json").read_text()).get("vocab_size")
                            or 160)
            logits = zoo.logits(model)
        torch.save({"logits": logits, "tested": small and gated}, tmp / "logits.pt")

    built = once(root / model_type, make)
    return built / "model", torch.load(built / "logits.pt", weights_only=True)


def _exported(request, model_type: str) -> Path:
    """``convert --to mlx`` of the tiny model (``_built``; the setting its clients run otherwise allowed,
    ``CLIENT_DIFFERS``), made once per run: read-only."""
    src, _ = _built(request, model_type)
    return once(src.parent / "mlx", lambda tmp: convert(src, "mlx", tmp, allow_config=allowed(model_type)))


def _mlx_logits(path: Path):
    model, _ = mlx_lm.load(str(path))
    out = model(mx.array(zoo.TOKENS.numpy()))
    return torch.from_numpy(__import__("numpy").array(out.astype(mx.float32)))


def _reference(src: Path, exported: Path, dst: Path, **kw) -> None:
    """mlx_lm.convert of ``src`` given the config export wrote (the keys it added; no quantization block)."""
    ref_src = dst.parent / f"{dst.name}-src"
    shutil.copytree(src, ref_src)
    cfg = json.loads((exported / "config.json").read_text())
    for k in ("quantization", "quantization_config"):
        cfg.pop(k, None)
    (ref_src / "config.json").write_text(json.dumps(cfg))
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlx_lm.convert(str(ref_src), str(dst), **kw)


@pytest.mark.parametrize("model_type", _candidates())
def test_zoo_mlx(model_type, tmp_path, request):
    src, built = _built(request, model_type)
    if not built["tested"]:
        pytest.skip("not gated, or not tiny (test_zoo covers it)")
    out = tmp_path / "mlx"
    if model_type in REFUSED:
        with pytest.raises(FFNToolsError) as e:
            convert(src, "mlx", out)
        assert "\n" not in str(e.value) and not out.exists()
        assert sorted(MLX_LM_FAILS) == sorted(REFUSED)
        error, match = MLX_LM_FAILS[model_type]
        with pytest.raises(error, match=match), contextlib.redirect_stdout(io.StringIO()):
            mlx_lm.convert(str(src), str(tmp_path / "theirs"))  # mlx_lm cannot either
        return
    allow = allowed(model_type)
    if allow:
        with pytest.raises(FFNToolsError, match=f"{allow[0]}: the input's client \\(transformers\\) runs"):
            convert(src, "mlx", out)
    out = _exported(request, model_type)
    got, want = _mlx_logits(out), built["logits"]
    if want is not None:
        close = (got - want).abs().max().item() <= 1e-3 * max(1.0, want.abs().max().item())
        assert close != (model_type in OTHER_LOGITS), model_type
    quant = tmp_path / "mlx-q"
    convert(src, "mlx", quant, quantize=True, allow_config=allow)
    for exported in (out, quant):  # verify pairs B with A as mlx_lm loads B: no false alarm on a correct export
        if model_type in UNVERIFIED:
            with pytest.raises(FFNToolsError, match="no gated FFN tensors found"):
                ffn_tools.verify(src, exported, backends=["reference"], tokens=4)
            continue
        if allow:  # the clients' difference is named, and passes only when accepted on purpose
            report = ffn_tools.verify(src, exported, backends=["reference"], tokens=4)
            assert [p.split(":")[0] for p in report.config.problems] == allow, report.failures()
        report = ffn_tools.verify(src, exported, backends=["reference"], tokens=4, allow_config=allow)
        assert report.passed, report.failures()
    if model_type in OTHER_LAYOUT:
        with pytest.raises(ValueError, match="parameters not in model"):
            _reference(src, out, tmp_path / "theirs")
        src = _other_layout(model_type, src, tmp_path / "other")
    _reference(src, out, tmp_path / "ref")
    assert_identical(tensors(out), tensors(tmp_path / "ref"))
    _reference(src, out, tmp_path / "ref-q", quantize=True)
    assert_identical(tensors(quant), tensors(tmp_path / "ref-q"))
    assert json.loads((quant / "config.json").read_text()) == json.loads((tmp_path / "ref-q" / "config.json").read_text())


# Falcon-H1 with the multipliers its real checkpoints have (mlx_lm's defaults; the zoo's are 1.0): mlx_lm's sanitize
# folds them into the tensors in place (``param *= m``), so they are computed outputs, not renames.
FALCON_H1_MULTIPLIERS = {"mlp_multipliers": [0.8838834764831844, 0.5859375], "embedding_multiplier": 5.656854249492381,
                         "lm_head_multiplier": 0.0390625}


def _edited_mlx(src: Path, dst: Path, edit) -> Path:
    """A copy of MLX model ``src`` with ``edit(tensors)`` applied, its safetensors metadata kept (the view reads it)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            metadata = fh.metadata()
        w = load_file(f)
        edit(w)
        save_file({k: v.contiguous() for k, v in w.items()}, f, metadata=metadata)
    return dst


def test_folded_multipliers_are_exported_as_mlx_lm_folds_them(tmp_path):
    src = tmp_path / "src"
    model = zoo.build("falcon_h1", src, keep=KEEP, extra=FALCON_H1_MULTIPLIERS)
    write_tokenizer(src, 160)
    out = tmp_path / "mlx"
    convert(src, "mlx", out)
    got, want = _mlx_logits(out), zoo.logits(model)
    assert (got - want).abs().max().item() <= 1e-3 * max(1.0, want.abs().max().item())
    _reference(src, out, tmp_path / "ref")
    mine, ref, a = tensors(out), tensors(tmp_path / "ref"), tensors(src)
    assert_identical(mine, ref)
    gate = "model.layers.0.feed_forward.gate_proj.weight"
    assert torch.equal(mine[gate], a[gate] * FALCON_H1_MULTIPLIERS["mlp_multipliers"][0])  # folded, not copied
    convert(src, "mlx", tmp_path / "mlx-q", quantize=True)
    _reference(src, out, tmp_path / "ref-q", quantize=True)
    assert_identical(tensors(tmp_path / "mlx-q"), tensors(tmp_path / "ref-q"))
    # verify pairs B's FFN with A as mlx_lm loads it (the plan's folded gate and down), and says so
    for exported, how in ((out, "bit for bit"), (tmp_path / "mlx-q", "re-quantized")):
        report = ffn_tools.verify(src, exported, backends=["reference"], tokens=4)
        assert report.passed, report.failures()
        want = "identical" if how == "bit for bit" else "requantized"  # a 4-bit B holds A's codes, not its bits
        assert all(r.exact == want for r in report.results), [r.problems for r in report.results]
        folded = next(n for n in report.notes if "as mlx_lm's sanitize computes them" in n)
        assert gate in folded and "down_proj" in folded and "up_proj" not in folded, folded
        assert how != "re-quantized" or any("re-quantized with B's parameters, bit for bit" in n for n in report.notes)
    up = gate.replace("gate_proj", "up_proj")
    with open_any(src) as ca, open_any(out) as cb:  # what verify reads A through: the folded gate, as often as asked
        pairing = runtime(cb.format).pairing(ca, cb)  # A as B's client, mlx_lm, loads it
        computed = pairing.computed([gate, up])
        assert computed == {gate}
        as_loaded = AsLoaded(ca, pairing, computed)
        assert all(torch.equal(as_loaded[gate], mine[gate]) for _ in range(2)) and torch.equal(as_loaded[up], a[up])

    def rescale(w):  # another factor than the config's: what a wrong multiplier folds
        w[gate] = w[gate] * 2

    def swap(w):  # gate and up exchanged in the 4-bit export, codes, scales and biases alike
        for part in ("weight", "scales", "biases"):
            g, u = gate.replace("weight", part), up.replace("weight", part)
            w[g], w[u] = w[u], w[g]

    for planted, base, edit in (("scaled", out, rescale), ("swapped", tmp_path / "mlx-q", swap)):
        bad = _edited_mlx(base, tmp_path / planted, edit)
        report = ffn_tools.verify(src, bad, backends=["reference"], tokens=4)
        failures = " ".join(report.failures())
        assert not report.passed and "layer 0" in failures and "gate" in failures, (planted, failures)
        assert "layer 1" not in failures, failures  # only the planted layer
