"""Byte runs of a tensor made by pure moves: what makes an entry a zero-copy copy (``Entry.pieces``).

A ``View`` is a C-contiguous tensor whose bytes are the concatenation of ``runs`` (input position, byte offset in
that input, length). A move op maps input views to output views without touching data; the output's runs are the
entry's pieces. ``TooMany`` stops a view growing past ``cap`` runs (then computing is faster than copying).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from math import prod

Run = tuple[int, int, int]


class TooMany(Exception):
    """More byte runs than the cap: not worth copying run by run."""


@dataclass(frozen=True)
class View:
    shape: tuple[int, ...]
    isz: int
    runs: tuple[Run, ...]

    @property
    def nbytes(self) -> int:
        return self.isz * prod(self.shape)

    def reshaped(self, shape: tuple[int, ...]) -> "View":
        return View(tuple(shape), self.isz, self.runs)


def coalesce(runs: list[Run], cap: int) -> tuple[Run, ...]:
    out: list[Run] = []
    for k, o, n in runs:
        if n == 0:
            continue
        if out and out[-1][0] == k and out[-1][1] + out[-1][2] == o:
            out[-1] = (k, out[-1][1], out[-1][2] + n)
        else:
            out.append((k, o, n))
            if len(out) > cap:
                raise TooMany
    return tuple(out)


class _Bytes:
    """Sub-ranges of a view's byte string, found by bisection."""

    def __init__(self, v: View):
        self.runs = v.runs
        self.starts = [0, *accumulate(n for _, _, n in v.runs)][:-1]

    def sub(self, off: int, n: int, out: list[Run]) -> None:
        i = bisect_right(self.starts, off) - 1
        while n > 0:
            k, o, m = self.runs[i]
            skip = off - self.starts[i]
            take = min(m - skip, n)
            out.append((k, o + skip, take))
            off, n, i = off + take, n - take, i + 1


def narrow(v: View, dim: int, start: int, length: int, cap: int) -> View:
    """``t.narrow(dim, start, length)`` of a view, contiguous."""
    inner = v.isz * prod(v.shape[dim + 1:])
    size, src = v.shape[dim], _Bytes(v)
    out: list[Run] = []
    for o in range(prod(v.shape[:dim])):
        src.sub((o * size + start) * inner, length * inner, out)
        if len(out) > 4 * cap:
            out[:] = coalesce(out, cap)
    shape = list(v.shape)
    shape[dim] = length
    return View(tuple(shape), v.isz, coalesce(out, cap))


def cat(vs: list[View], dim: int, cap: int) -> View:
    """``torch.cat(vs, dim)`` of views of one dtype and equal shapes but along ``dim``."""
    srcs = [_Bytes(v) for v in vs]
    out: list[Run] = []
    inners = [v.isz * prod(v.shape[dim:]) for v in vs]
    for o in range(prod(vs[0].shape[:dim])):
        for src, inner in zip(srcs, inners):
            src.sub(o * inner, inner, out)
        if len(out) > 4 * cap:
            out[:] = coalesce(out, cap)
    shape = list(vs[0].shape)
    shape[dim] = sum(v.shape[dim] for v in vs)
    return View(tuple(shape), vs[0].isz, coalesce(out, cap))
