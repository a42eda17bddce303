"""Layouts: fuse and split are exact inverses for every combination, and arrange rows as documented."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import raw

from ffn_tools.errors import LayoutError
from ffn_tools.layouts import GateUpLayout, fuse, split

LAYOUTS = [GateUpLayout(order, arr, tp) for order in ("gate-up", "up-gate")
           for arr, tp in (("concat", 1), ("interleaved", 1), ("tp", 1), ("tp", 2), ("tp", 4))]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rand(*shape, dtype):
    # random bits in every position, not just small values: any misplaced element changes bytes
    return torch.randn(*shape, dtype=torch.float32).to(dtype) * 3


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("axis", ["rows", "columns"])
def test_round_trip_bit_exact(layout, dtype, stacked, axis):
    layout = GateUpLayout(layout.order, layout.arrangement, layout.tp, axis)
    i, h = 8, 5
    lead = (3,) if stacked else ()
    shape = (*lead, i, h) if axis == "rows" else (*lead, h, i)
    g, u = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    fused = fuse(g, u, layout)
    g2, u2 = split(fused, layout)
    assert raw(g2) == raw(g) and raw(u2) == raw(u)
    assert raw(fuse(g2, u2, layout)) == raw(fused)
    gb, ub = rand(*lead, i, dtype=dtype), rand(*lead, i, dtype=dtype)
    fb = fuse(gb, ub, layout, is_bias=True)
    assert [raw(t) for t in split(fb, layout, is_bias=True)] == [raw(gb), raw(ub)]


def test_arrangements_as_documented():
    g = torch.arange(4).reshape(4, 1)
    u = 10 + torch.arange(4).reshape(4, 1)
    rows = lambda t: t.reshape(-1).tolist()  # noqa: E731
    assert rows(fuse(g, u)) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert rows(fuse(g, u, GateUpLayout("up-gate"))) == [10, 11, 12, 13, 0, 1, 2, 3]
    assert rows(fuse(g, u, GateUpLayout(arrangement="interleaved"))) == [0, 10, 1, 11, 2, 12, 3, 13]
    assert rows(fuse(g, u, GateUpLayout("up-gate", "interleaved"))) == [10, 0, 11, 1, 12, 2, 13, 3]
    assert rows(fuse(g, u, GateUpLayout(arrangement="tp", tp=2))) == [0, 1, 10, 11, 2, 3, 12, 13]
    assert rows(fuse(g, u, GateUpLayout(arrangement="tp", tp=4))) == [0, 10, 1, 11, 2, 12, 3, 13]


def test_segments_cover_every_row_once():
    for layout, n in itertools.product(LAYOUTS, (8, 16, 24)):
        segs = layout.segments(n)
        covered = sorted(r for _, s, _, ln in segs for r in range(s, s + ln))
        assert covered == list(range(n))
        for role in ("gate", "up"):
            parts = sorted(r for ro, _, p, ln in segs if ro == role for r in range(p, p + ln))
            assert parts == list(range(n // 2))


@pytest.mark.parametrize("rows, layout, message", [
    (7, GateUpLayout(), "odd number"),
    (12, GateUpLayout(arrangement="tp", tp=4), "tensor-parallel"),
    (10, GateUpLayout(arrangement="interleaved"), None),
])
def test_bad_sizes(rows, layout, message):
    t = torch.zeros(rows, 3)
    if message is None:
        split(t, layout)
        return
    with pytest.raises(LayoutError, match=message):
        split(t, layout, name="w")


def test_bad_layout_values():
    with pytest.raises(LayoutError, match="order"):
        GateUpLayout("gate-down")
    with pytest.raises(LayoutError, match="--tp"):
        GateUpLayout(arrangement="concat", tp=2)
    with pytest.raises(LayoutError, match="same shape"):
        fuse(torch.zeros(2, 3), torch.zeros(3, 3))
