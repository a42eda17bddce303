"""The streaming writer: byte-exact shard sizes, HF names and index, metadata, readable by safe_open."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import progress_bars
from safetensors import safe_open

from ffn_tools.errors import FFNToolsError
from ffn_tools.sizes import parse_size
from ffn_tools.io.writer import OutTensor, plan_shards, write_sharded


def items(sizes):
    out = []
    for k, n in enumerate(sizes):
        t = torch.arange(n, dtype=torch.float32) + k
        out.append(OutTensor(f"t.{k:03d}", "F32", (n,), 4 * n, lambda t=t: t))
    return out


@pytest.mark.parametrize("limit", [3000, 5000, 12345, 10**6])
def test_every_shard_fits_and_reads_back(tmp_path, limit):
    its = items([100, 300, 7, 500, 1, 250, 250, 640, 3])
    out = tmp_path / str(limit)
    out.mkdir()
    names = write_sharded(out, its, max_shard_size=limit, metadata={"format": "pt", "k": "v"})
    for n in names:
        assert (out / n).stat().st_size <= max(limit, 4 * 640 + 200)
        with safe_open(out / n, "pt") as f:
            assert f.metadata() == {"format": "pt", "k": "v"}
    if len(names) == 1:
        assert names == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
        return
    assert names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in its)
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    for t in its:
        with safe_open(out / index["weight_map"][t.name], "pt") as f:
            assert torch.equal(f.get_tensor(t.name), t.produce())


def test_shards_are_filled_greedily():
    its = items([100] * 10)  # 400 bytes each
    shards = plan_shards(its, 1000, None)
    assert [len(s) for s in shards] == [2, 2, 2, 2, 2]  # 2 x 400 + header < 1000 < 3 x 400
    assert [len(s) for s in plan_shards(its, 10**9, None)] == [10]


@pytest.mark.parametrize("text, value", [("500MB", 500 * 10**6), ("5GB", 5 * 10**9), ("2GiB", 2 * 2**30),
                                         ("1.5G", 15 * 10**8), ("1048576", 2**20), ("64kib", 65536)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["5XB", "GB", "-1MB", "0"])
def test_bad_sizes(text):
    with pytest.raises(FFNToolsError):
        parse_size(text)


def test_copied_bytes_keep_their_page_offset(model_dir, tmp_path):
    """Data copied from an input lands at the same offset modulo 4096 (copy_file_range is faster so)."""
    from ffn_tools.gateup import split_gateup
    from ffn_tools.io.readers import open_checkpoint

    src = model_dir("phi3", torch.bfloat16)
    split_gateup(src, tmp_path / "out")
    with open_checkpoint(src) as a, open_checkpoint(tmp_path / "out") as b:
        same = [n for n in b if n in a]
        assert same and all(b.info(n).start % 4096 == a.info(n).start % 4096 for n in same)
        assert all(b.info(n).start % 8 == 0 for n in b)
        for n in same:
            assert torch.equal(a[n], b[n])


def test_progress_moves_as_bytes_are_copied(model_dir, tmp_path, monkeypatch):
    """Byte-copied tensors count when copied (step by step), not when queued: no single 100% frame."""
    import ffn_tools.io.writer as writer
    from ffn_tools.gateup import split_gateup

    monkeypatch.setattr(writer, "COPY_STEP", 4096)
    bars = progress_bars(monkeypatch)
    split_gateup(model_dir("phi3"), tmp_path / "out")
    (bar,) = bars
    assert len(bar.steps) > 20 and max(bar.steps) <= 4096  # one step per copy_file_range call
    assert sum(bar.steps) == bar.total  # every byte counted once


def test_progress_line_has_rate_and_eta(monkeypatch, capsys):
    import io

    from ffn_tools import progress

    class TTY(io.StringIO):
        def isatty(self):
            return True

    err = TTY()
    monkeypatch.setattr("sys.stderr", err)
    progress.set_enabled(True)
    p = progress.Progress(1000, "copying")
    p.update(1000)
    p.close()
    assert "copying: 100.0%" in err.getvalue() and "ETA 0:00" in err.getvalue() and "/s" in err.getvalue()


def test_quantized_mlx_progress_counts_input_bytes(hf, tmp_path, monkeypatch):
    """A 4-bit export writes a quarter of what it reads: the bar counts the input, ending exactly at it."""
    pytest.importorskip("mlx_lm")
    from ffn_tools.converters import convert
    from ffn_tools.io.readers import open_checkpoint

    bars = progress_bars(monkeypatch)
    src = hf("mixtral")
    convert(src, "mlx", tmp_path / "q", quantize=4)
    (bar,) = bars
    with open_checkpoint(src) as c:
        read = sum(c.info(n).nbytes for n in c)  # every tensor is written (mixtral drops none)
    written = sum(p.stat().st_size for p in (tmp_path / "q").glob("*.safetensors"))
    assert sum(bar.steps) == bar.total == read and written < read / 2
