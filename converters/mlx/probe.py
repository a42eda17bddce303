"""Which input element each element of a tensor mlx_lm's ``sanitize`` computed is: sanitize run on probes.

The function from a Hugging Face checkpoint to an MLX model's tensors is the export's (``exporter._match``): its
view of the input (FFNs split, fused or stacked, GPT-OSS's experts turned) and then the model's ``sanitize``.
Where that function only moves data (reshape, transpose, slice, split, concatenate, stack) and adds constants
(Qwen3-Next's norms ``+ 1.0``), each output element is one input element plus a constant, and the inverse is a
gather. The function is run three times on stand-ins for every input, in float64 on the CPU and lazily, so
only the outputs asked for are computed:

    zero    every input 0                        output = the constant c of each element
    count   element i of all inputs i + 1        output - c = 1 + the global index of its input element
    random  random integers below 2**30          output - c must equal the random value of that element

The ``random`` run rejects anything that is not data movement (a sum, a mean or a scale that happens to give an
integer in ``count``). Integers below 2**53 and small constants are exact in float64, so nothing is guessed.
An output element that is c in every run comes from no input (padding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ffn_tools.errors import CheckpointError, FFNToolsError
from ffn_tools.io.dtypes import itemsize
from ffn_tools.io.raw import RawTensor
from ffn_tools.plan import Entry

from .names import sanitize
from .quant import MX_DTYPES

RANDOM_BELOW = 1 << 30
TORCH_PROBE_MAX = 1 << 26  # elements: a view entry computed by torch (GPT-OSS's turned experts) is probed eagerly
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class NotRearranged(FFNToolsError):
    """An output of sanitize is not input data moved (plus constants): it has no exact inverse here."""


@dataclass(frozen=True)
class Trace:
    """Where the elements of one output come from: ``positions`` (flat, in the output) hold the input elements
    ``sources`` (global flat indices over all inputs) plus ``offsets`` (None: all 0); other positions are
    constants."""

    output: str
    positions: np.ndarray
    sources: np.ndarray
    offsets: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.sources.nbytes + (0 if self.offsets is None else self.offsets.nbytes)


def plain(e: Entry, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether a view entry is one input as it is (named as in the input or not)."""
    return len(e.inputs) == 1 and e.pieces == ((0, 0, e.nbytes),) and tuple(shapes[e.inputs[0]]) == tuple(e.shape)


class Probe:
    """sanitize on probes of the inputs ``shapes`` (name -> shape, in order), through the export's view."""

    def __init__(self, fresh: Callable[[], object], shapes: Mapping[str, tuple[int, ...]], view: list[Entry],
                 st_dtype: str):
        """``fresh`` gives a new lazy mlx_lm model per run; ``st_dtype``: the dtype the view's byte pieces count in."""
        self.fresh, self.shapes, self.view, self.isz = fresh, dict(shapes), view, itemsize(st_dtype)
        sizes = [math.prod(s) for s in self.shapes.values()]
        self.bases = np.cumsum([0, *sizes])  # input i holds global indices bases[i] .. bases[i + 1]
        self.index = {n: i for i, n in enumerate(self.shapes)}
        self._runs: dict[str, dict[str, mx.array]] = {}

    @property
    def total(self) -> int:
        return int(self.bases[-1])

    def _input(self, kind: str, i: int, shape: tuple[int, ...]) -> mx.array:
        if kind == "zero":
            return mx.zeros(shape, mx.float64)
        if kind == "count":
            return (mx.arange(math.prod(shape), dtype=mx.int64) + int(self.bases[i]) + 1).astype(mx.float64).reshape(shape)
        return mx.random.randint(1, RANDOM_BELOW, shape, dtype=mx.int32, key=mx.random.key(i)).astype(mx.float64)

    def _standins(self, kind: str) -> dict[str, mx.array]:
        inputs = {n: self._input(kind, i, s) for i, (n, s) in enumerate(self.shapes.items())}
        out = {}
        for e in self.view:
            if plain(e, self.shapes):
                out[e.name] = inputs[e.inputs[0]]
            elif e.pieces is not None:  # byte runs of the inputs, counted in the view's dtype
                runs = [inputs[e.inputs[k]].reshape(-1)[o // self.isz:(o + n) // self.isz] for k, o, n in e.pieces]
                out[e.name] = mx.concatenate(runs).reshape(e.shape)
            elif math.prod(e.shape) <= TORCH_PROBE_MAX:
                import torch

                made = e.apply([torch.from_numpy(np.array(inputs[n])) for n in e.inputs])
                out[e.name] = mx.array(made.double().contiguous().numpy())
            else:  # too large to compute eagerly: its outputs read as constants, so they are not inverted
                out[e.name] = mx.zeros(tuple(e.shape), mx.float64)
        return out

    def _values(self, kind: str, name: str) -> np.ndarray:
        run = self._runs.get(kind)
        if run is None or name not in run:  # evaluated outputs are popped, so their memory goes
            with mx.stream(mx.cpu):
                run = self._runs[kind] = sanitize(self.fresh(), self._standins(kind))
        a = run.pop(name)
        with mx.stream(mx.cpu):
            return np.array(a.astype(mx.float64)).reshape(-1)

    def input_values(self, kind: str, name: str) -> np.ndarray:
        i = self.index[name]
        with mx.stream(mx.cpu):
            return np.array(self._input(kind, i, self.shapes[name])).reshape(-1)

    def trace(self, name: str) -> Trace:
        """Where output ``name``'s elements come from.

        Raises:
            NotRearranged: some element is not one input element plus a constant.
        """
        y0, y1, y2 = (self._values(k, name) for k in ("zero", "count", "random"))
        d1, d2 = y1 - y0, y2 - y0
        const = (d1 == 0) & (d2 == 0)
        k = d1 - 1
        moved = (k >= 0) & (k < self.total) & (k == np.floor(k))
        if not (const | moved).all():
            raise NotRearranged(f"{name}: {int((~(const | moved)).sum())} of its {d1.size} values are computed by "
                                "mlx_lm's sanitize, not moved from the input")
        positions = np.flatnonzero(~const)
        sources = k[positions].astype(np.int64)
        owners = np.searchsorted(self.bases, sources, side="right") - 1
        for u in np.unique(owners):
            sel = owners == u
            want = self.input_values("random", list(self.shapes)[u])[sources[sel] - self.bases[u]]
            if not np.array_equal(d2[positions[sel]], want):
                raise NotRearranged(f"{name}: mlx_lm's sanitize combines input values into it (not a rearrangement)")
        offsets = y0[positions]
        return Trace(name, positions, sources, offsets if offsets.any() else None)

    def owners(self, t: Trace) -> list[str]:
        """The inputs output ``t`` takes elements from."""
        names = list(self.shapes)
        return [names[u] for u in np.unique(np.searchsorted(self.bases, t.sources, side="right") - 1)]

    def covered(self, name: str, traces: list[Trace]) -> int:
        """How many elements of input ``name`` the outputs ``traces`` hold."""
        lo, hi = int(self.bases[self.index[name]]), int(self.bases[self.index[name] + 1])
        got = [t.sources[(t.sources >= lo) & (t.sources < hi)] for t in traces]
        return int(np.unique(np.concatenate(got)).size) if got else 0


def _step(bits: np.ndarray, width: int, up: bool) -> np.ndarray:
    """The next float up (or down) of floats given by their bits (sign and magnitude, as IEEE and bfloat16)."""
    sign = np.array(1 << (width - 1), dtype=bits.dtype)
    neg, mag = (bits & sign) != 0, bits & ~sign
    one = np.array(1, dtype=bits.dtype)
    away = neg != up  # moving away from zero: the magnitude grows
    toward = np.where(mag == 0, (sign if not up else 0) | one, bits - one)  # through zero to the other side
    return np.where(away, bits + one, toward).astype(bits.dtype)


def _as_mx(bits: np.ndarray, st: str) -> mx.array:
    return mx.array(bits).view(MX_DTYPES[st])


def _bits(a: mx.array, dtype) -> np.ndarray:
    return np.array(a.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size])).astype(dtype)


def unoffset(bits: np.ndarray, offsets: np.ndarray, st: str, name: str) -> tuple[np.ndarray, bool]:
    """``y - c`` in dtype ``st`` for stored values ``y`` (their bits) that sanitize made as ``x + c``, and whether
    that is provably the input (no other value of the dtype plus c rounds to the same y).

    Raises:
        CheckpointError: some ``y`` is no value plus c in this dtype (the MLX tensor was not made so).
    """
    out, unique = bits.copy(), True
    width = bits.dtype.itemsize * 8
    for c in np.unique(offsets):
        sel = offsets == c
        with mx.stream(mx.cpu):
            y = _as_mx(bits[sel], st)
            x = y - float(c)  # in the dtype, as sanitize's ``v + c``: the scalar does not widen it
            if not mx.array_equal(x + float(c), y).item():
                raise CheckpointError(f"{name}: its MLX values are not the source's plus {c} in {st}, as mlx_lm's "
                                      "sanitize makes them; the MLX tensor was changed after export")
            xb = _bits(x, bits.dtype)
            for up in (True, False):
                near = _as_mx(_step(xb, width, up), st)
                unique &= not mx.any(mx.equal(near + float(c), y)).item()
        out[sel] = xb
    return out, unique


def gather(name: str, shape: tuple[int, ...], st: str, probe: Probe, traces: list[Trace],
           read: Callable[[str], RawTensor]) -> tuple[RawTensor, bool]:
    """Input ``name`` rebuilt from the outputs ``traces`` (``read`` gives an output's bytes, in dtype ``st``), and
    whether it is exact (False: an offset rounded, so the source's low bits may differ).

    Raises:
        CheckpointError: outputs disagree on an element, or an offset cannot be undone.
    """
    i = probe.index[name]
    lo, n = int(probe.bases[i]), math.prod(shape)
    utype = _UINTS[itemsize(st)]
    x, filled, exact = np.zeros(n, utype), np.zeros(n, bool), True
    for t in traces:
        sel = (t.sources >= lo) & (t.sources < lo + n)
        if not sel.any():
            continue
        y = np.frombuffer(read(t.output), dtype=utype)
        where, vals = t.sources[sel] - lo, y[t.positions[sel]]
        if t.offsets is not None and (c := t.offsets[sel]).any():
            moved = c != 0
            vals = vals.copy()
            vals[moved], ok = unoffset(vals[moved], c[moved], st, name)
            exact &= ok
        again = filled[where]
        if again.any() and not np.array_equal(x[where[again]], vals[again]):
            raise CheckpointError(f"{name}: {t.output} disagrees with the other MLX tensors made from it")
        x[where], filled[where] = vals, True
    if not filled.all():
        raise CheckpointError(f"{name}: {int((~filled).sum())} of its values are in no MLX tensor")
    return RawTensor(st, shape, x.tobytes()), exact
