"""What a new user hit (issue 37): a fuse that wrote what transformers refuses, round trips that changed names,
an MLX export mlx_lm cannot load, a traceback left over, messages naming Python keywords, a silent long run.
Each test runs the real client (transformers' ``from_pretrained``, ``mlx_lm.load``) on the output."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_identical, run_cli, tensors

import zoo


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(path, logits) of a tiny GPT-OSS saved by transformers: experts stacked (E, H, 2I), stored (in, out),
    gate and up columns interleaved."""
    path = tmp_path_factory.mktemp("gptoss") / "model"
    model = zoo.build("gpt_oss", path)
    return path, zoo.logits(model)


def _loaded_logits(path):
    """transformers' logits of ``path``, asserting it loads every tensor with no size mismatch."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    return zoo.logits(model.eval())


def test_fusing_gpt_oss_with_its_own_layout_named_writes_its_orientation(gpt_oss, tmp_path):
    """37.2: --layout interleaved fused the turned (in, out) stack's rows, [E, 2H, I] -> transformers: size mismatch."""
    src, logits = gpt_oss
    run_cli("split-gateup", src, "-o", tmp_path / "s")
    r = run_cli("fuse-gateup", tmp_path / "s", "-o", tmp_path / "f", "--stack-experts", "--layout", "interleaved")
    assert torch.equal(_loaded_logits(tmp_path / "f"), logits)
    assert_identical(tensors(tmp_path / "f"), tensors(src))  # as without --layout: byte for byte the source
    assert "interleaved, gate-up, columns" in r.stdout and "warning" not in r.stderr, r.output
    # reading it with the layout named works too (it was refused: "the layout says rows")
    run_cli("split-gateup", src, "-o", tmp_path / "s2", "--layout", "interleaved")
    assert_identical(tensors(tmp_path / "s2"), tensors(tmp_path / "s"))


def test_fusing_gpt_oss_in_a_layout_it_does_not_store_says_so(gpt_oss, tmp_path):
    """Another arrangement under GPT-OSS's names loads (same shape) and computes another function: warned."""
    src, logits = gpt_oss
    run_cli("split-gateup", src, "-o", tmp_path / "s")
    r = run_cli("fuse-gateup", tmp_path / "s", "-o", tmp_path / "f", "--stack-experts", "--layout", "concat")
    assert "warning: 8 FFNs fused 'concat, gate-up'" in r.stderr and "gpt-oss" in r.stderr, r.stderr
    assert "'interleaved, gate-up'" in r.stderr and "--layout" in r.stderr, r.stderr
    fused = tensors(tmp_path / "f")["model.layers.0.mlp.experts.gate_up_proj"]
    assert fused.shape == tensors(src)["model.layers.0.mlp.experts.gate_up_proj"].shape  # (E, H, 2I), its orientation
    assert not torch.equal(_loaded_logits(tmp_path / "f"), logits)  # what the warning is for
    run_cli("split-gateup", tmp_path / "f", "-o", tmp_path / "back", "--layout", "concat")
    assert_identical(tensors(tmp_path / "back"), tensors(tmp_path / "s"))


@pytest.mark.parametrize("case", ["aria_text", "granitemoe", "granitemoeshared", "granitemoehybrid", "granitemoe_swa", "gpt_oss", "phi3"])
def test_a_saved_fused_form_round_trips_to_its_own_names(case, tmp_path):
    """37.11: split -> fuse gave Aria's fc1/fc2 and Granite's input_linear/output_linear back as transformers v5's
    (or per-expert) names: separate experts fuse back into the form the family's checkpoints are saved in."""
    model_type, extra = zoo.case(case)
    src = tmp_path / "src"
    model = zoo.build(model_type, src, extra=extra)
    run_cli("split-gateup", src, "-o", tmp_path / "s")
    run_cli("fuse-gateup", tmp_path / "s", "-o", tmp_path / "f", *(["--stack-experts"] if case != "phi3" else []))
    assert_identical(tensors(tmp_path / "f"), tensors(src))
    logits = zoo.logits(model)
    if logits is not None:
        assert torch.equal(_loaded_logits(tmp_path / "f"), logits)
    if case in ("granitemoe", "granitemoeshared", "granitemoehybrid"):  # only stacked experts: stacked untold
        run_cli("fuse-gateup", tmp_path / "s", "-o", tmp_path / "f2")
        assert_identical(tensors(tmp_path / "f2"), tensors(src))


def test_an_mlx_export_mlx_lm_cannot_run_is_refused(tmp_path):
    """37.11: LFM2 with attention layers only (transformers' default layer_types) exported to MLX with exit 0, and
    mlx_lm failed on the first token (IndexError: its model indexes the cache by its first conv layer)."""
    mx = pytest.importorskip("mlx.core")
    lfm2 = pytest.importorskip("mlx_lm.models.lfm2")
    from helpers import write_tokenizer

    src = tmp_path / "lfm2"
    zoo.build("lfm2", src, keep=("attention_bias", "mlp_bias", "tie_word_embeddings"))
    write_tokenizer(src, 160)
    config = __import__("json").loads((src / "config.json").read_text())
    assert set(config["layer_types"]) == {"full_attention"}
    r = run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "mlx", ok=False)
    assert "mlx_lm's lfm2 model builds from this config.json but fails on its first token (IndexError" in r.output
    assert "mlx_lm/models/lfm2.py:" in r.output and not (tmp_path / "mlx").exists(), r.output
    # what mlx_lm itself does with this config: its model builds (so it loads) and fails when it runs
    args = lfm2.ModelArgs.from_dict({**config, "block_dim": config["hidden_size"]})
    model = lfm2.Model(args)
    with pytest.raises(IndexError):
        model(mx.array([[0]]))


# model_type -> (what mlx_lm computes otherwise than transformers from the same weights and config, settings under
# which the two agree). The export is exact: neutralise the difference and mlx_lm's logits are transformers' to
# float32 rounding. (Found by reading both clients; the lines are mlx_lm 0.32.2's and transformers 5.24's.)
CLIENT_DIFFERS = {
    "ernie4_5_moe": ("transformers picks the top-k experts on softmax + mlp.moe_statics.e_score_correction_bias "
                     "(modeling_ernie4_5_moe.py:351, :293); mlx_lm's sanitize drops the bias (ernie4_5_moe.py:269) and "
                     "picks on the softmax alone (:149)", "bias", {}),
    "jamba": ("transformers leaves the top-k softmax weights unnormalized (modeling_jamba.py:696-697); mlx_lm "
              "renormalizes them over the k chosen (jamba.py:244): alike only when every expert is chosen",
              None, {"num_experts_per_tok": 4}),
    "glm4_moe_lite": ("transformers' q_a_layernorm and kv_a_layernorm use RMSNorm's default eps 1e-6 "
                      "(modeling_glm4_moe_lite.py:253, :265, :418), mlx_lm's config rms_norm_eps (glm4_moe_lite.py:83, "
                      ":93): alike only when rms_norm_eps is 1e-6", None, {"rms_norm_eps": 1e-6}),
}
# the differences convert names (and refuses without --allow-config); where every expert is chosen it has none
CONVERT_NAMES = {"jamba": "norm_topk_prob", "glm4_moe_lite": "mla_norm_eps"}


@pytest.mark.parametrize("model_type", sorted(CLIENT_DIFFERS))
def test_mlx_logits_that_differ_are_mlx_lm_s_semantics_not_the_export(model_type, tmp_path):
    """37.11: the float32 logits of ernie4_5_moe, jamba and glm4_moe_lite exports under mlx_lm differ from
    transformers' (6.2e-3, 6.5e-3, 1.3e-4 on a user's models): each is mlx_lm's own model computing another
    function (CLIENT_DIFFERS); with that difference neutralised the export runs as the source to 1e-5."""
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import json

    import numpy as np
    from helpers import write_tokenizer
    from safetensors.torch import load_file, save_file
    from test_zoo_mlx import EXTRA, KEEP

    _, edit, settings = CLIENT_DIFFERS[model_type]

    def gap(path, settings, *allow):
        model = zoo.build(model_type, path, keep=KEEP, extra={**(EXTRA.get(model_type) or {}), **settings})
        if edit == "bias":  # the correction bias transformers routes with and mlx_lm drops, zeroed
            w = load_file(path / "model.safetensors")
            w = {k: torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v for k, v in w.items()}
            save_file(w, path / "model.safetensors", metadata={"format": "pt"})
            model = _loaded_model(path)
        write_tokenizer(path, json.loads((path / "config.json").read_text()).get("vocab_size") or 160)
        want = zoo.logits(model)
        run_cli("convert", path, "--to", "mlx", "-o", path.parent / f"{path.name}-mlx", *allow)
        m, _ = mlx_lm.load(str(path.parent / f"{path.name}-mlx"))
        got = torch.from_numpy(np.array(m(mx.array(zoo.TOKENS.numpy())).astype(mx.float32)))
        return (got - want).abs().max().item()

    assert gap(tmp_path / "alike", settings) <= 1e-5
    if edit is None:
        # the difference is still mlx_lm's (else: drop it here); convert names it unless allowed
        allow = ("--allow-config", CONVERT_NAMES[model_type]) if model_type in CONVERT_NAMES else ()
        assert gap(tmp_path / "as-built", {}, *allow) > 1e-5


def _loaded_model(path):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a file system mounted read-only (a tmpfs; needs root and mount): skipped where it cannot."""
    import subprocess

    d = tmp_path / "ro"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only file system here (needs root and mount)")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_a_read_only_output_is_said_of_o_and_called_read_only(model_dir, read_only_dir):
    """37.13: extract -o on a read-only file system named its temporary manifest (".out.json.tmp-PID: Read-only
    file system"), and the other commands called it "permission denied"."""
    src = model_dir("phi3")
    for args in (["extract", src, "-o", read_only_dir / "out.safetensors"], ["extract", src, "-o", read_only_dir / "x"],
                 ["split-gateup", src, "-o", read_only_dir / "s"], ["fuse-gateup", model_dir("llama"), "-o",
                                                                     read_only_dir / "f"]):
        r = run_cli(*args, ok=False)
        assert f"Error: {args[-1]}: cannot write into {read_only_dir} (read-only file system)" in r.output, r.output
        assert ".tmp" not in r.output


def test_the_cli_names_its_flags_and_the_api_its_keywords(model_dir, tmp_path):
    """37.13: "choose another output path (-o, out=) or pass --force (force=True)": each caller is told in its
    own terms."""
    import ffn_tools
    from ffn_tools.errors import OutputExistsError

    out = tmp_path / "split"
    run_cli("split-gateup", model_dir("phi3"), "-o", out)
    r = run_cli("split-gateup", model_dir("phi3"), "-o", out, ok=False)
    assert f"Error: {out}: already exists; choose another output path (-o) or pass --force to replace it" in r.output
    assert "out=" not in r.output and "force=True" not in r.output, r.output
    with pytest.raises(OutputExistsError) as e:
        ffn_tools.split_gateup(model_dir("phi3"), out)
    assert str(e.value) == f"{out}: already exists; choose another output path (out=) or pass force=True to replace it"


def test_one_of_a_thing_is_not_plural(tmp_path):
    """37.13: "1 FFNs in 1 layers"."""
    from safetensors.torch import save_file

    d = tmp_path / "one"
    d.mkdir()
    save_file({"model.layers.0.mlp.gate_proj.weight": torch.randn(8, 4), "model.layers.0.mlp.up_proj.weight":
               torch.randn(8, 4), "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8),
               "model.norm.weight": torch.ones(4)}, d / "model.safetensors")
    out = run_cli("inspect", d).output
    assert "dense         1 FFN in 1 layer, d_ffn 8, separate, 3 tensors" in out and "outside FFNs  1 tensor," in out
    assert "1 FFNs" not in run_cli("inspect", d, "--json").output
    assert f"wrote {tmp_path / 'x'}: 1 FFN, 3 tensors" in run_cli("extract", d, "-o", tmp_path / "x").output
    assert "1 of 1 FFN (concat, gate-up)" in run_cli("fuse-gateup", d, "-o", tmp_path / "f").output
    assert "nothing to split: its one FFN already has" in run_cli("split-gateup", d, "-o", tmp_path / "s", ok=False).output


def test_a_long_run_says_it_is_alive_when_stderr_is_not_a_terminal(model_dir, tmp_path, monkeypatch):
    """37.13: without a terminal nothing reported progress; now a plain line every LINE_EVERY seconds (here every
    update) and one when it ends, and none under --quiet."""
    from ffn_tools import progress

    monkeypatch.setattr(progress, "LINE_EVERY", 0.0)
    r = run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "s")  # CliRunner's stderr is no terminal
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("warning: ")]  # a split Phi-3's line (59.4)
    assert any(ln.startswith("split-gateup: ") and "%" in ln and "ETA" in ln for ln in lines), r.stderr
    assert lines[-1].startswith("split-gateup: done, ") and "\r" not in r.stderr, r.stderr
    r = run_cli("-q", "split-gateup", model_dir("phi3"), "-o", tmp_path / "q")
    assert all(ln.startswith("warning: ") for ln in r.stderr.splitlines()), r.stderr  # no progress


def test_another_arrangement_is_warned_for_a_family_not_for_ones_own_templates(model_dir, tmp_path):
    src = model_dir("llama")
    r = run_cli("fuse-gateup", src, "-o", tmp_path / "a", "--layout", "interleaved")
    assert "fused 'interleaved, gate-up', but hf's names hold gate and up as 'concat, gate-up'" in r.stderr, r.stderr
    own = ["--gate", "model.layers.{layer}.mlp.gate_proj.weight", "--up", "model.layers.{layer}.mlp.up_proj.weight",
           "--down", "model.layers.{layer}.mlp.down_proj.weight", "--gate-up", "model.layers.{layer}.mlp.gu.weight"]
    r = run_cli("fuse-gateup", src, "-o", tmp_path / "b", "--layout", "interleaved", *own)
    assert "warning" not in r.stderr, r.stderr
