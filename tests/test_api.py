"""One JSON shape for every command, and the Python API returning exactly what --json prints."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli

import ffn_tools

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


def test_a_formats_import_extra_is_its_own_extra():
    """converters.IMPORT_EXTRAS (the hint where a format's own import fails, so its FORMAT cannot be asked) names
    the extra each FORMAT declares (MLX: mlx-cpu here, mlx on Apple silicon; none: torch's own packages)."""
    import sys

    from ffn_tools import converters

    for name in converters.FORMATS:
        fmt = converters.get(name)
        want = "mlx" if fmt.extra == "mlx-cpu" and sys.platform == "darwin" else fmt.extra or None
        assert converters.IMPORT_EXTRAS[name] == want, name
