"""FP8 block scales read with the block the checkpoint uses (``quant.fp8.block``): the config's
``weight_block_size`` where it gives the scales' shape (32 x 32, not a 128 assumed), and without one a partial
last block of a power of two (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows over 5 scales of 128). Checked against
DeepSeek's own definition (``weight_dequant``: element (i, j) times ``s[i // B, j // B]``)."""

from __future__ import annotations

import pytest
import torch

from ffn_tools.quant import fp8


def reference(w: torch.Tensor, s: torch.Tensor, b: tuple[int, int]) -> torch.Tensor:
    i = torch.arange(w.shape[0]) // b[0]
    j = torch.arange(w.shape[1]) // b[1]
    return w.float() * s.float()[i][:, j]


@pytest.mark.parametrize("rows,cols,given,want", [
    (576, 256, None, (128, 128)),      # 5 x 2 scales: ceil(576 / 5) = 116 would be wrong
    (100, 96, (32, 32), (32, 32)),     # 4 x 3 scales: the config's 32, where 100 / 4 = 25 divides
    (256, 256, (32, 32), (32, 32)),
    (256, 256, None, (128, 128)),
])
def test_block_and_decode_are_deepseeks(rows, cols, given, want):
    g = torch.Generator().manual_seed(0)
    b = given or want
    w = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(-(-rows // b[0]), -(-cols // b[1]), generator=g) + 0.5
    got = fp8.block((rows, cols), tuple(s.shape), given)
    assert got == want
    assert torch.equal(fp8.decode(w, s, got), reference(w, s, want))
    assert torch.equal(fp8.dequantize(w, s, got).float(), reference(w, s, want))


def test_a_wrong_block_would_differ():
    """The check above can fail: reading 576 rows' scales with the old ceil(576 / 5) = 116 moves rows 116-127
    onto the second scale."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(576, 128, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(5, 1, generator=g) + 0.5
    assert not torch.equal(fp8.decode(w, s, (116, 128)), reference(w, s, (128, 128)))
    assert torch.equal(fp8.decode(w, s), reference(w, s, (128, 128)))
