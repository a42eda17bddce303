"""split-gateup and fuse-gateup name their outputs from one table (``gateup.naming``): the pairs split writes from a
fused FFN are the pairs fuse reads back from the split FFN, and they name every tensor of it."""

from __future__ import annotations

import pytest
import torch

from ffn_tools.detect import find_ffns
from ffn_tools.gateup import fuse_gateup, split_gateup
from ffn_tools.gateup.naming import COUNTERPARTS, out_names, pairs
from ffn_tools.io.readers import open_checkpoint


@pytest.mark.parametrize("arch,stack", [("llama-bias", False), ("qwen3_moe", True)])
def test_the_pairs_split_writes_are_the_pairs_fuse_reads_back(arch, stack, model_dir, tmp_path):
    fused, split = tmp_path / "fused", tmp_path / "split"
    fuse_gateup(model_dir(arch, torch.float32), fused, stack_experts=stack)
    split_gateup(fused, split)
    with open_checkpoint(fused) as a, open_checkpoint(split) as b:
        apart = {f.ref: f for f in find_ffns(b, None, None).ffns}
        together = [f for f in find_ffns(a, None, None).ffns if f.form.fused]
        assert together
        for f in together:
            g = apart[f.ref]
            there = pairs(f.names, out_names(f, f.group.forms[f.group.unfused or "separate"], a.config))
            back = pairs(out_names(g, f.form, b.config), g.names)
            assert there == back
            assert {r for p in there for r in COUNTERPARTS[p.role]} == set(g.names)  # every tensor of it
            assert {n for p in there for n in p.apart} == set(g.names.values())
            assert any(p.cut and p.bias for p in there) == (arch == "llama-bias")
