"""A new writable format is its own package plus one registry line: here a toy one, written under tmp_path and
registered with one line, gets its ``convert --to`` choice and its flag (help included) from its declaration alone,
is refused where its flag does not apply, and runs end to end through the command line and the library."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
from helpers import run_cli

import ffn_tools
from ffn_tools import converters

TOY = textwrap.dedent('''
    import json
    from pathlib import Path

    from ffn_tools.formats import Format, Option


    class Toy(Format):
        name = "toy"
        options = (Option("toy_scale", "Toy only: the scale the toy writes beside the names (default 1).", type=int,
                          minimum=1),)
        takes = frozenset({"dry_run"})
        runtimes = ("transformers",)  # what loads its input: no client difference to refuse

        def can_read(self, path):
            return (Path(path) / "toy.json").is_file()

        def read(self, path, absent_shards=False, like=None):
            raise NotImplementedError

        def export(self, ckpt, out, *, toy_scale=None, **common):  # dtype, force, ...: convert's own
            out.mkdir()
            names = sorted(ckpt)
            (out / "toy.json").write_text(json.dumps({"names": names, "scale": toy_scale or 1}))
            return {"output": str(out), "summary": f"wrote {out}: {len(names)} names (toy)"}

        def load_runtime(self, name):
            from ffn_tools.converters import get

            return get("torch").load_runtime(name)  # transformers, as for the PyTorch format


    FORMAT = Toy()
''')


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy package under tmp_path, importable; registering it is the test's one line."""
    (tmp_path / "toyfmt").mkdir()
    (tmp_path / "toyfmt" / "__init__.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return lambda: monkeypatch.setitem(converters.FORMATS, "toy", "toyfmt")  # the one registry line


def test_a_toy_format_gets_its_choice_and_flag_from_its_declaration_alone(toy, model_dir, tmp_path):
    src = model_dir("llama")
    r = run_cli("convert", src, "--to", "toy", "-o", tmp_path / "early", ok=False)
    assert "'toy' is not one of" in r.output and "--toy-scale" not in run_cli("convert", "--help").output
    toy()
    help_text = run_cli("convert", "--help").output
    assert "torch|mlx|flax|gguf|dcp|orbax|toy]" in help_text
    assert "--toy-scale INTEGER RANGE" in help_text and "Toy only: the scale the toy writes" in help_text

    r = run_cli("convert", src, "--to", "toy", "-o", tmp_path / "out", "--toy-scale", "3", "--json")
    assert json.loads(r.stdout)["summary"].endswith("names (toy)")
    written = json.loads((tmp_path / "out" / "toy.json").read_text())
    assert written["scale"] == 3 and "model.layers.0.mlp.gate_proj.weight" in written["names"]

    r = run_cli("convert", src, "--to", "toy", "-o", tmp_path / "zero", "--toy-scale", "0", ok=False)
    assert "0 is not in the range x>=1" in r.output  # its declared minimum, on the command line
    r = run_cli("convert", src, "--to", "torch", "-o", tmp_path / "t", "--toy-scale", "3", ok=False)
    assert "--toy-scale does not apply to --to torch" in r.output
    r = run_cli("convert", src, "--to", "toy", "-o", tmp_path / "q", "-q", ok=False)  # another format's flag
    assert "--quantize does not apply to --to toy" in r.output
    assert not (tmp_path / "zero").exists() and not (tmp_path / "t").exists() and not (tmp_path / "q").exists()

    ffn_tools.convert(src, "toy", tmp_path / "lib", toy_scale=2)  # the library takes it under the same name
    assert json.loads((tmp_path / "lib" / "toy.json").read_text())["scale"] == 2


def test_two_formats_may_not_declare_one_flag_otherwise(toy, monkeypatch):
    """The flags come from every format's declaration: one flag for two options would make one unreachable."""
    from ffn_tools.formats import Option

    toy()
    monkeypatch.setattr(converters.get("toy"), "options", (Option("toy_scale", "clash", flags=("--outtype",)),))
    with pytest.raises(ffn_tools.errors.FFNToolsError, match="--outtype"):
        converters.options()


def test_a_read_only_format_is_no_choice_of_to(toy, monkeypatch):
    """``--to`` is each registered format whose FORMAT says it writes (``Format.writes``, read, not listed again)."""
    toy()
    assert "native" not in converters.writable() and "toy" in converters.writable()
    monkeypatch.setattr(type(converters.get("toy")), "writes", False)
    assert "toy" not in converters.writable()
    assert "'toy' is not one of" in run_cli("convert", "x", "--to", "toy", "-o", "y", ok=False).output


def test_the_command_list_draws_no_format(tmp_path):
    """``ffn-tools --help`` lists convert from its help text alone: drawing the command imports every format."""
    import subprocess
    import sys

    code = ("import sys; from ffn_tools.cli import main; sys.argv = ['ffn-tools', '--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('ffn_tools.converters.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^ +convert +Convert the checkpoint at PATH", out, re.M) and out.strip().endswith("\n[]"), out
