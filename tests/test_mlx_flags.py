"""`convert --to mlx` with mlx_lm.convert's own flags, against mlx_lm.convert itself: quantization modes and
mixed recipes bit for bit, the model card, v5 stacked experts exported directly, inputs mlx_lm would refuse
refused before anything is written, and an export that needs no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import assert_identical, run_cli, tensors
from test_mlx import _copy, assert_nothing_written, config

from ffn_tools.converters import convert
from ffn_tools.errors import FFNToolsError

mlx_lm = pytest.importorskip("mlx_lm")


@pytest.mark.parametrize("flags, theirs", [
    (["-q", "--q-mode", "mxfp4"], dict(quantize=True, q_mode="mxfp4")),
    (["-q", "--q-mode", "nvfp4"], dict(quantize=True, q_mode="nvfp4")),
    (["-q", "--q-mode", "mxfp8"], dict(quantize=True, q_mode="mxfp8")),
    (["-q", "--q-bits", "3", "--q-group-size", "32"], dict(quantize=True, q_bits=3, q_group_size=32)),
    (["-q", "--quant-predicate", "mixed_3_6"], dict(quantize=True, quant_predicate="mixed_3_6")),
    (["-q", "--quant-predicate", "mixed_2_6", "--q-group-size", "32"],
     dict(quantize=True, quant_predicate="mixed_2_6", q_group_size=32)),
    (["--dtype", "float16", "-q"], dict(quantize=True, dtype="float16")),
])
def test_flags_write_what_mlx_lm_convert_writes(flags, theirs, hf, tmp_path):
    src = hf("qwen2_moe" if "mixed" in str(flags) else "mixtral")
    run_cli("convert", "--hf-path", src, "--mlx-path", tmp_path / "mine", *flags)
    mlx_lm.convert(str(src), str(tmp_path / "theirs"), **theirs)
    assert_identical(tensors(tmp_path / "mine"), tensors(tmp_path / "theirs"))
    assert config(tmp_path / "mine")["quantization"] == config(tmp_path / "theirs")["quantization"]
    model, _ = mlx_lm.load(str(tmp_path / "mine"))  # and it runs
    assert model is not None
    assert (tmp_path / "mine" / "README.md").read_text() == (tmp_path / "theirs" / "README.md").read_text()


def test_older_flags_and_the_global_quiet_still_work(hf, tmp_path):
    src = hf("llama")
    run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "old", "--quantize", "4", "--group-size", "64")
    r = run_cli("-q", "convert", src, "--to", "mlx", "-o", tmp_path / "new", "-q", "--q-bits", "4")
    assert_identical(tensors(tmp_path / "old"), tensors(tmp_path / "new"))
    assert "\u2588" not in r.output  # quiet: no progress bar
    for args, words in ((["--to", "mlx", "-o", tmp_path / "x", "-q", "-d"], "either -q/--quantize or -d"),
                        (["--mlx-path", tmp_path / "x", "--to", "torch"], "--mlx-path is the output of --to mlx"),
                        (["--to", "mlx"], "missing -o"),
                        (["--to", "mlx", "-o", tmp_path / "x", "--q-bits", "4"], "only apply with -q")):
        r = run_cli("convert", src, *args, ok=False)
        assert words in r.output, r.output
    r = run_cli("convert", "--to", "mlx", "-o", tmp_path / "x", "-q", src, ok=False)  # -q swallowed PATH
    assert "takes no value" in r.output
    assert not (tmp_path / "x").exists()


def test_dry_run_lists_every_parameter_and_writes_nothing(hf, tmp_path):
    r = run_cli("convert", hf("mixtral"), "--to", "mlx", "-o", tmp_path / "o", "--dry-run", "-q", "--json")
    s = json.loads(r.stdout)
    assert s["command"] == "convert" and s["summary"].startswith("would write") and not (tmp_path / "o").exists()
    assert any("switch_mlp.gate_proj.scales" in line for line in s["plan"])
    assert s["mlx_model"] == "mixtral" and s["quantized"] > 0
    r = run_cli("convert", hf("llama"), "--to", "torch", "-o", tmp_path / "t", "--dry-run")
    assert "model.embed_tokens.weight" in r.output and not (tmp_path / "t").exists()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_v5_stacked_experts_export_directly(arch, hf, tmp_path):
    from ffn_tools.gateup import fuse_gateup

    src = hf(arch)
    fuse_gateup(src, tmp_path / "stacked", stack_experts=True)
    convert(src, "mlx", tmp_path / "from-experts", quantize=4)
    convert(tmp_path / "stacked", "mlx", tmp_path / "from-stacked", quantize=4)
    assert_identical(tensors(tmp_path / "from-stacked"), tensors(tmp_path / "from-experts"))


def test_inputs_mlx_lm_would_refuse_are_refused_before_writing(hf, tmp_path):
    from safetensors.torch import load_file, save_file

    # config.json says 4 layers over tensors of 2
    more = _copy(hf("llama"), tmp_path / "layers", lambda c: c.update(num_hidden_layers=4))
    # gate and up of different shapes in one FFN
    odd = _copy(hf("llama"), tmp_path / "odd")
    w = load_file(odd / "model.safetensors")
    w["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"][:-8].contiguous()
    save_file(w, odd / "model.safetensors", metadata={"format": "pt"})
    for path, words in ((more, "missing 18 parameter(s) mlx_lm's llama model has: model.layers.2."),
                        (odd, "model.layers.0.mlp.up_proj.weight: [88, 64], model wants [96, 64]")):
        with pytest.raises(FFNToolsError, match=__import__("re").escape(words)) as e:
            convert(path, "mlx", tmp_path / "out")
        assert "\n" not in str(e.value)
        assert_nothing_written(tmp_path / "out")
        with pytest.raises(ValueError):  # and mlx_lm's own load of such a model fails
            mlx_lm.convert(str(path), str(tmp_path / "theirs"))
            mlx_lm.load(str(tmp_path / "theirs"))


def test_the_mlx_export_needs_no_torch(hf, tmp_path):
    """mlx_lm's package imports transformers, which imports torch (about 1.2 s of its 2.5 s import): the export
    pays that once it reaches mlx_lm, and only then. Nothing of its own needs torch: with torch unimportable
    (None in sys.modules, as Python's import system reads a package that is absent) it writes the model."""
    code = ("import sys; sys.modules['torch'] = None; import ffn_tools.converters.mlx.exporter; "
            "from ffn_tools.converters import convert; "
            "print('mlx_lm' in sys.modules, 'transformers' in sys.modules); "
            f"convert({str(hf('mixtral'))!r}, 'mlx', {str(tmp_path / 'o')!r}, quantize=True); "
            "print('mlx_lm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "True"]
    assert (tmp_path / "o" / "model.safetensors").is_file()


def test_model_card_from_a_hub_snapshot_names_its_base_model(hf, tmp_path):
    from ffn_tools.converters.mlx.card import model_card
    from ffn_tools.io.readers import open_checkpoint

    snap = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / "abc123"
    _copy(hf("llama"), snap)
    (snap / "README.md").write_text("---\nlicense: mit\ntags:\n- text\n---\n# Tiny\nSome words.\n")
    with open_checkpoint(snap) as c:
        card = model_card(c)
    assert "base_model: acme/tiny-llama" in card and "license: mit" in card and "- mlx" in card
    assert "Some words" not in card  # mlx_lm drops the card's text
    with open_checkpoint(hf("llama")) as c:  # a local directory: mlx_lm's template
        assert model_card(c) == "---\nlanguage: en\nlibrary_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n---\n"


def test_bf16_export_is_bit_exact_both_ways(hf, tmp_path):
    src = hf("qwen3_moe", torch.bfloat16)
    convert(src, "mlx", tmp_path / "mlx")
    convert(tmp_path / "mlx", "torch", tmp_path / "back")
    assert_identical(tensors(tmp_path / "back"), tensors(src))
