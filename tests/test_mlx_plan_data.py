"""An MLX export's plan is data (#53): every entry pickles with plain ``pickle`` (no closure, no bound method: what
mlx_lm's ``sanitize`` computes and what a quantized weight reads are named by mlx_lm's module name, the config and
the checkpoint), and the unpickled plan executes to the same bytes as the export."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from ffn_tools.converters import convert  # noqa: E402
from ffn_tools.executor import execute  # noqa: E402
from ffn_tools.gateup import fuse_gateup  # noqa: E402

import ffn_tools.converters.mlx.exporter as exporter  # noqa: E402
from ffn_tools.converters.mlx.ops import Quantize, Sanitized  # noqa: E402


def _digests(path: Path) -> dict[str, str]:
    """sha256 of every file of an MLX directory, by name (but the receipt, which names its output path)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())
            if p.is_file() and p.name != "ffn-tools-receipt.json"}


def _captured(monkeypatch, src: Path, out: Path, **kw) -> tuple:
    """The plan the MLX export of ``src`` executes (and the run it executes it with), as it writes ``out``."""
    seen: list = []
    real = exporter.execute

    def capture(plan, run):
        seen.append((plan, run))
        return real(plan, run)

    monkeypatch.setattr(exporter, "execute", capture)
    convert(src, "mlx", out, **kw)
    monkeypatch.undo()
    (plan, run), = seen
    return plan, run


@pytest.fixture(scope="module")
def fused_llama(model_dir, tmp_path_factory) -> Path:
    """A dense llama with its gate and up fused: mlx_lm's llama wants them apart, so the export splits them
    (view entries, not input tensors: a quantized one reads its whole array)."""
    out = tmp_path_factory.mktemp("fused") / "llama"
    fuse_gateup(model_dir("llama", torch.float32), out)
    return out


CASES = [("deepseek_v3", None), ("deepseek_v3", 4), ("llama-fused", None), ("llama-fused", 4)]


@pytest.mark.parametrize("family,bits", CASES, ids=[f"{f}-{b or 'plain'}" for f, b in CASES])
def test_every_entry_pickles_and_the_unpickled_plan_writes_the_same_bytes(family, bits, model_dir, fused_llama,
                                                                           tmp_path, monkeypatch):
    src = fused_llama if family == "llama-fused" else model_dir(family, torch.float32)
    kw = {"quantize": bits} if bits else {}
    plan, run = _captured(monkeypatch, src, tmp_path / "a", **kw)
    kinds = {type(op) for e in plan.entries for op in e.ops}
    if family == "deepseek_v3":  # sanitize computes embed_q / unembed_out from kv_b_proj
        assert Sanitized in kinds
    if bits:
        assert Quantize in kinds
    if family == "llama-fused" and bits:  # quantized weights that are split pieces, not input rows: whole arrays
        assert any(isinstance(op, Quantize) and op.job.whole is not None for e in plan.entries for op in e.ops)
    for e in plan.entries:
        pickle.dumps(e)  # plain pickle: a closure or a local function anywhere in it fails here
    back = pickle.loads(pickle.dumps(plan.entries))
    assert [e.name for e in back] == [e.name for e in plan.entries]
    execute(dataclasses.replace(plan, entries=back), run.but(out=tmp_path / "b"))
    assert _digests(tmp_path / "b") == _digests(tmp_path / "a")
