"""``verify --layers`` on a machine that holds only some shards (README "Over several machines").

A real 4-layer Phi-3 saved by ``save_pretrained(max_shard_size=...)`` into many shards (A) and its
``split-gateup`` output, sharded too (B); copies keep only the shards that hold layers 2-3's FFNs, found
here from the indexes by name (independently of the code under test). The range passes and says what did
not run; a range needing a deleted shard, and a run without --layers, are refused naming the shards; a
defect planted in the range still fails.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner
from helpers import run_cli
from safetensors.torch import load_file, save_file
from tiny_models import COMMON

from ffn_tools.cli import cli

RANGE = {2, 3}


def _weight_map(path) -> dict[str, str]:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def _ffn_shards(path, layers) -> set[str]:
    """The shards holding an MLP tensor of ``layers``, by name."""
    return {f for n, f in _weight_map(path).items()
            if (m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\..*", n)) and int(m[1]) in layers}


def _keep_only(src, dst, shards: set[str]) -> list[str]:
    """A copy of ``src`` without the shards not in ``shards``; the deleted ones, sorted."""
    shutil.copytree(src, dst)
    gone = sorted(set(_weight_map(dst).values()) - shards)
    for f in gone:
        (dst / f).unlink()
    return gone


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(A, B, A with only the range's shards, B likewise, the shards deleted from each)."""
    import transformers

    root = tmp_path_factory.mktemp("partial")
    cfg = transformers.Phi3Config(**{**COMMON, "num_hidden_layers": 4})
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    a, b = root / "a", root / "b"
    model.save_pretrained(a, max_shard_size="100KB")
    run_cli("split-gateup", a, "-o", b, "--max-shard-size", "100KB")
    need_a, need_b = _ffn_shards(a, RANGE), _ffn_shards(b, RANGE)
    gone_a, gone_b = _keep_only(a, root / "a-part", need_a), _keep_only(b, root / "b-part", need_b)
    assert gone_a and gone_b and _ffn_shards(a, {0}) - need_a and _ffn_shards(b, {0}) - need_b
    return a, b, root / "a-part", root / "b-part", gone_a, gone_b


def verify(*args):
    r = CliRunner().invoke(cli, ["verify", *map(str, args), "--tokens", "4"])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    return r.exit_code, r.output


def test_shards_needed_lists_the_files_of_the_range_from_the_indexes(pair):
    a, b, a_part, b_part, *_ = pair
    r = json.loads(run_cli("verify", a, b, "--layers", "2-3", "--shards-needed", "--json").stdout)
    assert set(r["a"]["needed"]) == _ffn_shards(a, RANGE) and set(r["b"]["needed"]) == _ffn_shards(b, RANGE)
    assert r["a"]["total"] == len(set(_weight_map(a).values())) and r["a"]["absent"] == []
    out = run_cli("verify", a_part, b_part, "--layers", "0", "--shards-needed").stdout
    assert out.startswith("A: ") and "not here: " in out and "needs" in out
    assert all(f in out for f in _ffn_shards(a, {0}) | _ffn_shards(b, {0}))
    r = run_cli("verify", a, b, "--shards-needed", ok=False)
    assert "--shards-needed lists the shards a --layers range needs; give --layers" in r.output


def test_the_range_whose_shards_are_here_passes_and_says_what_did_not_run(pair):
    *_, a_part, b_part, gone_a, gone_b = pair
    code, out = verify(a_part, b_part, "--layers", "2-3", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["passed"], rep["failures"]
    assert sorted(f["layer"] for f in rep["ffns"]) == [2, 3]
    assert {f["exact"] for f in rep["ffns"]} == {"identical"}
    assert rep["a"]["absent_shards"] == gone_a and rep["b"]["absent_shards"] == gone_b
    n_b = len(set(_weight_map(b_part).values()))
    assert rep["load_check"]["ok"] is False and rep["load_check"]["skipped"].startswith(
        f"{len(gone_b)} of {n_b} shards absent ({gone_b[0]}")
    assert any(s.startswith("load check not run") for s in rep["not_run"])
    assert rep["outside"]["skipped"]  # a --layers run compares FFNs only, as before
    code, out = verify(a_part, b_part, "--layers", "2-3", "--logits")
    assert code == 0 and "logits not run (A and B have shards absent" in out
    assert out.splitlines()[-1].startswith("PASS: 2 FFNs") and "load check not run" in out.splitlines()[-1]


def test_a_range_needing_an_absent_shard_is_refused_naming_it(pair):
    a, b, a_part, b_part, *_ = pair
    missing = sorted(_ffn_shards(a, {0, 1, 2}) - _ffn_shards(a, RANGE))
    r = run_cli("verify", a_part, b_part, "--layers", "0-2", ok=False)
    assert f"A ({a_part}): --layers 0-2 needs {len(missing)} shard" in r.output
    assert all(f in r.output for f in missing) and "B (" in r.output and "--shards-needed" in r.output
    r = run_cli("verify", a_part, b, "--layers", "1", ok=False)  # one side whole, the other partial
    assert "A (" in r.output and "B (" not in r.output


def test_without_layers_a_missing_shard_is_still_refused(pair):
    *_, a_part, b_part, gone_a, _ = pair
    r = run_cli("verify", a_part, b_part, ok=False)
    assert "names shard(s) that do not exist" in r.output and gone_a[0] in r.output
    r = run_cli("verify", a_part, b_part, "--experts", "0", ok=False)
    assert "names shard(s) that do not exist" in r.output


def test_a_defect_planted_in_the_range_still_fails(pair, tmp_path):
    *_, b_part, _, _ = pair
    a_part = pair[2]
    bad = tmp_path / "bad"
    shutil.copytree(b_part, bad)
    g, u = "model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight"
    where = _weight_map(bad)
    values = {n: load_file(bad / where[n])[n] for n in (g, u)}
    for name, other in ((g, u), (u, g)):  # gate and up swapped, each in its own shard
        sd = load_file(bad / where[name])
        sd[name] = values[other]
        save_file(sd, bad / where[name], metadata={"format": "pt"})
    code, out = verify(a_part, bad, "--layers", "2-3")
    assert code == 1 and "FAIL" in out and "layer 3: not bit-identical" in out, out
    assert "gate and up are swapped" in out and "layer 2 " not in out.split("\n\n")[-1]


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
def test_an_mlx_export_holding_only_the_range_passes(pair, tmp_path):
    a, _, a_part, *_ = pair
    run_cli("convert", a, "--to", "mlx", "-o", tmp_path / "mlx", "--max-shard-size", "100KB")
    gone = _keep_only(tmp_path / "mlx", tmp_path / "mlx-part", _ffn_shards(tmp_path / "mlx", RANGE))
    code, out = verify(a_part, tmp_path / "mlx-part", "--layers", "2-3", "--json")
    rep = json.loads(out)
    assert code == 0 and sorted(f["layer"] for f in rep["ffns"]) == [2, 3], rep["failures"]
    assert gone and rep["b"]["absent_shards"] == gone and rep["load_check"]["client"] == "mlx_lm"
    assert rep["load_check"]["skipped"].startswith(f"{len(gone)} of ")
