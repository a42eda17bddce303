"""Casts made a chunk at a time (``io.chunked``): the same bits as a whole-tensor ``.to``, every byte counted, buffers
reused, and torch's thread count given back."""

from __future__ import annotations

import pytest
import torch
from helpers import plant, progress_bars, raw, run_cli, tensors

from ffn_tools.io import chunked
from ffn_tools.io.store import TensorInfo


def _awkward(sd: dict) -> None:
    """Values whose rounding a cast must get right: overflow to inf in float16, NaN, subnormals, signed zeros."""
    name = next(n for n in sd if n.endswith("mlp.down_proj.weight"))
    t = sd[name].float().reshape(-1).clone()
    t[:8] = torch.tensor([70000.0, -1e30, float("nan"), float("inf"), 1e-40, -0.0, 65519.0, 65520.0])
    sd[name] = t.reshape(sd[name].shape).to(sd[name].dtype)


@pytest.mark.parametrize("src, to", [(torch.bfloat16, "float16"), (torch.float32, "bfloat16"),
                                     (torch.float16, "float32"), (torch.float32, "float16")])
def test_a_cast_made_in_chunks_is_the_whole_cast_bit_for_bit(model_dir, tmp_path, monkeypatch, src, to):
    model = plant(model_dir("llama", src), tmp_path / "src", _awkward)
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 1000)  # not a whole row, nor a power of two: chunks end mid-row
    made = []
    real = chunked.chunks

    def counted(*a, **k):
        n = 0
        for c in real(*a, **k):
            n += 1
            yield c
        made.append(n)

    monkeypatch.setattr(chunked, "chunks", counted)
    threads = torch.get_num_threads()
    run_cli("convert", model, "--to", "torch", "--dtype", to, "-o", tmp_path / "out")
    assert torch.get_num_threads() == threads
    before, after = tensors(model), tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    target = getattr(torch, to)
    for n, t in before.items():
        want = t.to(target) if t.is_floating_point() else t
        assert after[n].dtype == want.dtype and after[n].shape == want.shape, n
        assert raw(after[n]) == raw(want), n  # bits: NaN included
    assert made and max(made) > 1  # the stream ran, chunk by chunk


def test_every_byte_of_a_streamed_cast_is_counted_once(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4096)
    bars = progress_bars(monkeypatch)
    run_cli("convert", model_dir("llama"), "--to", "torch", "--dtype", "bfloat16", "-o", tmp_path / "out")
    (bar,) = bars
    assert sum(bar.steps) == bar.total and min(bar.steps) > 0
    assert len(bar.steps) > len(tensors(tmp_path / "out"))  # progress moves within a tensor, not once per tensor


def test_the_chunks_come_in_two_buffers_reused_to_the_end(tmp_path):
    data = torch.randn(3, 1001, dtype=torch.float32)
    f = tmp_path / "raw"
    f.write_bytes(b"\0" * 24 + data.numpy().tobytes())
    info = TensorInfo("x", torch.float32, (3, 1001), f, 24)
    got, ptrs = [], set()
    for c in chunked.chunks(info, torch.bfloat16, lambda s, o: o.copy_(s), step=4000):
        got.append(c.clone())
        ptrs.add(c.data_ptr())
    assert [len(c) for c in got] == [1000, 1000, 1000, 3]
    assert len(ptrs) == 1  # one output buffer, whatever the tensor's size
    assert torch.equal(torch.cat(got), data.reshape(-1).to(torch.bfloat16))


def test_a_file_that_ends_early_is_an_error_not_a_short_tensor(tmp_path):
    f = tmp_path / "raw"
    f.write_bytes(b"\0" * 100)
    info = TensorInfo("x", torch.float32, (1000,), f, 0)
    with pytest.raises(OSError, match="ended early"):
        list(chunked.chunks(info, torch.float16, lambda s, o: o.copy_(s)))
