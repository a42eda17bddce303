"""One JSON shape for every command, and the Python API returning exactly what --json prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_cli

import ffn_tools
from ffn_tools.errors import FFNToolsError

ENVELOPE = ["command", "input", "output", "summary", "warnings"]


def test_every_command_json_starts_with_the_same_keys(model_dir, tmp_path):
    src = model_dir("phi3", torch.float32)
    runs = {
        "inspect": (["inspect", src], str(src), None),
        "extract": (["extract", src, "-o", tmp_path / "ffn"], str(src), str(tmp_path / "ffn")),
        "split-gateup": (["split-gateup", src, "-o", tmp_path / "split"], str(src), str(tmp_path / "split")),
        "fuse-gateup": (["fuse-gateup", tmp_path / "split", "-o", tmp_path / "fused"], str(tmp_path / "split"),
                        str(tmp_path / "fused")),
        "convert": (["convert", src, "--to", "flax", "-o", tmp_path / "flax"], str(src), str(tmp_path / "flax")),
        "verify": (["verify", src, tmp_path / "fused", "--backend", "reference", "--tokens", "2"],
                   [str(src), str(tmp_path / "fused")], None),
    }
    for command, (args, inputs, output) in runs.items():
        r = run_cli(*args, "--json")
        j = json.loads(r.stdout)
        assert list(j)[:5] == ENVELOPE, (command, list(j)[:6])
        assert (j["command"], j["input"], j["output"]) == (command, inputs, output)
        assert isinstance(j["summary"], str) and j["summary"] and isinstance(j["warnings"], list)
    text = run_cli("inspect", src).output
    assert "architecture" in text
    assert json.loads(run_cli("verify", src, tmp_path / "fused", "--backend", "reference", "--tokens", "2",
                              "--json").stdout)["summary"].startswith("PASS")


def test_python_api_returns_what_json_prints(model_dir, tmp_path):
    src = model_dir("llama", torch.float32)
    assert ffn_tools.inspect(src) == json.loads(run_cli("inspect", src, "--json").stdout)
    report = ffn_tools.verify(src, src, backends=["reference"], tokens=2)
    assert report.passed and report.verdict.startswith("PASS")  # a property, like the JSON's string
    assert ffn_tools.api.json_of(report)["verdict"] == report.verdict
    r = ffn_tools.fuse_gateup(src, tmp_path / "fused", load_check=True)
    assert r["command"] == "fuse-gateup" and r["output"] == str(tmp_path / "fused") and r["warnings"]


@pytest.mark.parametrize("fn", ["inspect", "extract", "split_gateup", "fuse_gateup", "convert", "verify"])
def test_api_functions_are_exported(fn):
    assert callable(getattr(ffn_tools, fn)) and fn in ffn_tools.__all__


def test_a_formats_import_extra_is_its_own_extra(tmp_path, monkeypatch):
    """The hint where a format's own import fails (so its FORMAT cannot be asked) comes from the one table of extras
    (``formats.EXTRAS``, import name -> extras): for each format, the packages the table says its extra installs are
    there, each extra is one pyproject.toml declares, and a format whose package fails to import one of them is
    refused naming that extra (MLX: mlx-cpu here, mlx on Apple silicon; none: torch's own packages)."""
    import sys
    import tomllib

    from ffn_tools import converters
    from ffn_tools.errors import pip_install
    from ffn_tools.formats import EXTRAS

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert {e for extras in EXTRAS.values() for e in extras} <= set(declared["optional-dependencies"])
    for name in list(converters.FORMATS):
        extra = converters.get(name).extra
        if not extra:
            continue
        packages = [p for p, extras in EXTRAS.items() if extra in extras]
        assert packages, (name, extra)
        (tmp_path / f"broken_{name}.py").write_text(f"import {packages[0]}.absent_for_the_test\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setitem(sys.modules, packages[0], None)  # as Python's import system reads a package not there
        monkeypatch.setitem(converters.FORMATS, f"broken-{name}", f"broken_{name}")
        with pytest.raises(FFNToolsError, match="not installed") as e:
            converters.get(f"broken-{name}")
        assert pip_install(extra) in str(e.value), (name, str(e.value))
