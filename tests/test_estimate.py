"""--dry-run's estimates (ffn_tools.estimate): a sample of the command's own plan streamed in this process (no child
re-running the command), against the real run; and the sample's choice of tensors (io.sample.narrow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ffn_tools.io import sample
from ffn_tools.ops import Copy
from ffn_tools.plan import Entry, Plan

from helpers import run_cli


def _size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


@pytest.mark.parametrize("args", [["split-gateup"], ["convert", "--to", "torch", "--dtype", "float16"]],
                         ids=["split", "cast"])
def test_dry_run_estimates_the_run_from_a_sample_and_writes_nothing(model_dir, tmp_path, args):
    src = model_dir("phi3", torch.bfloat16)
    out = tmp_path / "out"
    cmd = [args[0], src, *args[1:], "-o", out]
    r = run_cli(*cmd, "--dry-run", "--estimate", "--json")
    e = json.loads(r.stdout)["estimate"]
    assert e["made"], e
    assert not out.exists() and list(tmp_path.iterdir()) == []  # the sample's directory removed, nothing written
    assert e["sample"]["tensors"] == e["sample"]["of"] > 0  # a tiny model: sampled whole
    # in-process the start-up (planning) of a tiny model can take under a millisecond: within the run, never negative
    assert e["peak_rss"] > 20e6 and 0 < e["seconds"] < 120 and 0 <= e["sample"]["startup_seconds"] <= e["seconds"]
    # the writer's time is what scales with the tensors; the side files, the receipt and the move are once a run
    assert 0 < e["sample"]["writing_seconds"] < e["sample"]["seconds"]
    text = run_cli(*cmd, "--dry-run", "--estimate").output
    assert "estimate: writes" in text and "peak RSS" in text and "a sample run here" in text
    run_cli(*cmd)
    assert e["output_bytes"] == e["temporary_disk"]
    assert abs(e["output_bytes"] - _size(out)) <= 0.02 * _size(out)  # the receipt's options differ by a few bytes


def test_the_estimate_knows_every_weight_byte_of_a_sampled_sharded_output(tmp_path):
    """A model the sample reads only part of (~100 MB, 48 MB sampled), split into shards with an index: the weight
    files' bytes the estimate gives are the real run's, headers and index included, to the byte (the plan knows
    them; a scaled sample's were off by kilobytes)."""
    import transformers

    src, out = tmp_path / "phi3", tmp_path / "out"
    config = transformers.Phi3Config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=8, vocab_size=8192, pad_token_id=0)
    with torch.device("meta"):
        model = transformers.Phi3ForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(0.01 * (i + 1))
    model.save_pretrained(src)
    cmd = ["split-gateup", src, "-o", out, "--max-shard-size", "20MB"]
    e = json.loads(run_cli(*cmd, "--dry-run", "--estimate", "--json").stdout)["estimate"]
    assert e["made"] and e["exact"] and e["sample"]["tensors"] < e["sample"]["of"], e
    run_cli(*cmd)
    weights = [f for f in out.iterdir() if f.name.startswith("model")]
    assert len(weights) > 3 and (out / "model.safetensors.index.json") in weights
    assert e["weight_bytes"] == sum(f.stat().st_size for f in weights)


def test_no_estimate_where_the_output_is_not_streamed_through_the_executor(model_dir, tmp_path):
    """A GGUF is written by llama.cpp's converter: the sample run stops before it starts, and says so."""
    r = run_cli("convert", model_dir("llama", torch.bfloat16), "--to", "gguf", "-o", tmp_path / "m.gguf",
                "--dry-run", "--estimate", "--json")
    e = json.loads(r.stdout)["estimate"]
    assert e == {"made": False, "why": e["why"]} and "not streamed through the plan executor" in e["why"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("to,args", [("mlx", ["-q"]), ("dcp", []), ("flax", []), ("orbax", [])])
def test_every_streamed_format_s_estimate_is_its_run_s_output(hf, tmp_path, to, args):
    """MLX quantized (its shared quantization jobs and pool), and the formats whose writers cannot size their
    output before writing (DCP, Flax, Orbax: the sample's bytes scaled): the estimate's bytes are the run's."""
    src, out = hf("llama", torch.bfloat16), tmp_path / "out"
    cmd = ["convert", src, "--to", to, *args, "-o", out]
    e = json.loads(run_cli(*cmd, "--dry-run", "--estimate", "--json").stdout)["estimate"]
    assert e["made"] and e["sample"]["tensors"] == e["sample"]["of"] > 0, e
    assert list(tmp_path.iterdir()) == []  # nothing written, the sample's directory removed
    run_cli(*cmd)
    assert abs(e["output_bytes"] - _size(out)) <= 0.02 * _size(out), (e["output_bytes"], _size(out))


def test_the_estimate_prices_the_plan_the_command_made_without_running_it_again(model_dir, tmp_path, monkeypatch):
    """The dry run plans once and streams a sample of that plan here: the command is neither planned again nor run
    again in a child process."""
    import subprocess

    import ffn_tools
    from ffn_tools import gateup

    planned = []
    real = gateup.plan_split
    monkeypatch.setattr(gateup, "plan_split", lambda *a, **k: planned.append(1) or real(*a, **k))

    def no_child(*a, **k):
        raise AssertionError(f"a child process was started: {a[:1]}")

    monkeypatch.setattr(subprocess, "Popen", no_child)
    r = ffn_tools.split_gateup(model_dir("phi3", torch.bfloat16), tmp_path / "out", dry_run=True, estimate=True)
    e = r["estimate"]
    assert e["made"] and e["exact"] and e["peak_rss"] > 20e6 and e["seconds"] > 0, e
    assert planned == [1] and list(tmp_path.iterdir()) == []
    r = ffn_tools.split_gateup(model_dir("phi3", torch.bfloat16), tmp_path / "out", dry_run=True, estimate=False)
    assert "estimate" not in r


def test_a_sample_run_that_fails_leaves_the_dry_run_standing_and_says_why(model_dir, tmp_path, monkeypatch):
    import ffn_tools
    from ffn_tools import executor

    def full(plan, run):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(executor, "execute", full)
    r = ffn_tools.split_gateup(model_dir("phi3", torch.bfloat16), tmp_path / "out", dry_run=True, estimate=True)
    assert r["plan"] and r["estimate"]["made"] is False and "No space left" in r["estimate"]["why"]
    assert list(tmp_path.iterdir()) == []


def _entry(i: int, n: int) -> Entry:
    return Entry(f"t{i}", "U8", (n,), (f"t{i}",), (Copy(),), sources=(("U8", (n,)),), text="unchanged")


def test_the_sample_is_every_kth_tensor_and_the_largest():
    mb = 1 << 20
    entries = [_entry(i, mb) for i in range(3000)] + [_entry(3000, 60 * mb)]
    plan = Plan(source=None, entries=entries, config=None)  # type: ignore[arg-type]
    narrowed, facts = sample.narrow(plan)
    names = [e.name for e in narrowed.entries]
    assert "t3000" in names and "t0" in names
    assert facts["reads"] == 3060 * mb and facts["entries"] == 3001
    # about 3% of the bytes (92 MB), and at least twice the largest tensor (120 MB): within a factor of 2
    assert 120 * mb / 2 <= facts["sample_reads"] <= 2 * 120 * mb
    assert facts["sample_reads"] == sum(e.nbytes for e in narrowed.entries) == facts["sample_bytes"]
    # a few huge tensors: never looping, never empty
    few = Plan(source=None, entries=[_entry(0, 2000 * mb), _entry(1, 2000 * mb)], config=None)  # type: ignore
    narrowed, facts = sample.narrow(few)
    assert 1 <= len(narrowed.entries) <= 2
    small = Plan(source=None, entries=[_entry(i, 1000) for i in range(10)], config=None)  # type: ignore
    assert len(sample.narrow(small)[0].entries) == 10


def test_the_writeback_throttle_holds_a_large_output_to_the_disk_s_speed():
    """``io.writeback.seconds``: an output made faster than the disk takes it runs at its own speed until the dirty
    pages reach the freerun point (written back from the background threshold on), then at the disk's."""
    from ffn_tools.io import writeback

    g = 1e9
    slow = {"background": 2 * g, "limit": 4 * g, "dirty": 0, "flushed": g, "flush_seconds": 4.0}  # a 0.25 GB/s disk
    # 2 GB at 1 GB/s; 1.33 GB more (dirty grows at 0.75 GB/s to the 3 GB freerun point); the last 0.67 GB at 0.25
    assert abs(writeback.seconds(4 * g, g, slow) - 6.0) < 1e-9
    assert writeback.seconds(1.5 * g, g, slow) == 1.5  # below the background threshold: its own speed
    assert writeback.seconds(4 * g, g, {**slow, "flush_seconds": 0.25}) == 4.0  # a disk faster than the writer
    assert writeback.seconds(4 * g, g, None) == 4.0  # nothing known of the disk
    assert writeback.seconds(4 * g, g, {**slow, "dirty": 3 * g}) == 16.0  # dirty already: the disk's speed at once


def test_the_sample_times_the_disk_only_where_the_output_passes_the_freerun_point(tmp_path, monkeypatch):
    from ffn_tools.io import writeback

    t = writeback.thresholds()
    if t is None:
        pytest.skip("no /proc/meminfo and /proc/sys/vm here")
    assert 0 < t["background"] < t["limit"] and t["dirty"] >= 0
    f = tmp_path / "w.bin"
    f.write_bytes(b"\7" * (4 << 20))
    assert "flushed" not in writeback.measure([f], 1 << 20)  # 1 MB: never near the thresholds
    monkeypatch.setattr(writeback, "thresholds", lambda: {"background": 1 << 20, "limit": 2 << 20, "dirty": 5 << 20})
    m = writeback.measure([f], 64 << 20)
    assert m["flushed"] == 4 << 20 and m["flush_seconds"] > 0 and m["dirty"] == 1 << 20  # the sample's own not counted


def test_an_estimate_whose_output_the_disk_holds_back_says_so():
    """``estimate._scaled`` with a sample run's facts: the tensors' part of its time scaled by the bytes read, the
    rest once, and the writeback throttle's wait added and said."""
    from ffn_tools import estimate

    g = 1e9
    facts = {"files": {"model.safetensors": int(0.1 * g), "config.json": 1000}, "bytes": 4 * g, "sample_bytes": 0.1 * g,
             "reads": 4 * g, "sample_reads": 0.1 * g, "sampled": 3, "entries": 120, "peak_rss": 10 ** 8,
             "started": 100.0, "ended": 100.5, "writing": 0.1}  # 0.1 s of tensors (1 GB/s), 0.4 s once a run
    unthrottled = estimate._scaled(facts, begun=99.0)
    assert abs(unthrottled["seconds"] - (1.0 + 0.4 + 4.0)) < 0.01 and unthrottled["sample"]["waits_on_disk"] == 0
    slow = {"background": 2 * g, "limit": 4 * g, "dirty": 0, "flushed": int(0.1 * g), "flush_seconds": 0.4}
    held = estimate._scaled({**facts, "writeback": slow}, begun=99.0)
    assert abs(held["seconds"] - (1.0 + 0.4 + 6.0)) < 0.01 and abs(held["sample"]["waits_on_disk"] - 2.0) < 0.01
    assert "waiting for the disk" in estimate.line({"estimate": held})[0]
    assert "waiting for the disk" not in estimate.line({"estimate": unthrottled})[0]
