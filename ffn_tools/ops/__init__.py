"""How an output tensor is made, as data: a tuple of ops (``plan.Entry.ops``).

Every op is a frozen dataclass (plain ``pickle`` sends it to a Ray task) taking a list of tensors to a list of
tensors (``Op.apply``); an entry's ops run in order from its inputs and end with one tensor. Each op says:

- ``reverse()``: the op undoing it bit for bit (``Split`` <-> ``Fuse``, ``Stack`` <-> ``Unstack``, ``Transpose``,
  ``Permute``, ``Concat`` <-> ``Chunk``, an exact widening ``Cast``), or None (``Take``, ``Rows``, ``Affine``).
  ``reverse(ops)`` reverses a sequence: split-gateup's entries are fuse-gateup's ops reversed, then ``Take``.
- ``describe()``: the --dry-run note.
- ``runs(views, cap)``: for a pure move, the output's byte runs from the inputs' (``views.View``); an entry whose
  every op has them is a zero-copy copy (``Entry.pieces``).
- ``elementwise`` / ``into(src, out)``: a cast, which the executor streams a chunk at a time (``Entry.into``).
- ``placement`` / ``shares``: DECLARED by an op that writes its own output (a format's Quantize op, subclassing
  ``Op`` in the format's package). ``placement`` is None or ``place(path, offset)``: the last op of an entry with
  one is told where the output's bytes go in its file, and its ``apply`` may write them there and return
  ``io.writer.Placed`` (``Entry.place``). ``shares`` is None or the work it shares with other entries (the parts
  of one quantized weight, made once): an object with a settable ``wanted`` (``Entry.shared``). The executor reads
  these only through the entry; no probe of the op.

A format's own ops (MLX's ``Quantize``, ``StreamCast``, ``Sanitized``; the kept codes of a quantized module) subclass
``Op`` in the format's package. No op wraps an arbitrary callable; the one holding a callable is MLX's ``Sanitized``
(a run of mlx_lm's own ``sanitize``, shared by its outputs: not plain-picklable, as a ``QuantJob`` given its array).
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Each, Op
from .moves import Chunk, Concat, Copy, Fuse, Permute, Reshape, Rows, Select, Split, Stack, Take, Transpose, Unstack
from .values import AddLowRank, Affine, Cast, Const
from .views import TooMany, View

MAX_RUNS = 256  # byte runs per pair of inputs above which computing is faster than copying run by run

__all__ = ["MAX_RUNS", "Op", "Copy", "Take", "Select", "Rows", "Split", "Fuse", "Stack", "Unstack", "Concat", "Chunk",
           "Transpose", "Reshape", "Permute", "Cast", "Affine", "AddLowRank", "Const", "View", "run", "reverse",
           "runs", "describe", "take", "Each"]


def run(ops: Sequence[Op], tensors: list) -> list:
    """The ops applied in order to ``tensors``."""
    ts = list(tensors)
    for op in ops:
        ts = op.apply(ts)
    return ts


def reverse(ops: Sequence[Op]) -> tuple[Op, ...] | None:
    """The ops undoing ``ops`` (each reversed, in the other order), or None where one has no reverse."""
    out = []
    for op in reversed(ops):
        r = op.reverse()
        if r is None:
            return None
        out.append(r)
    return tuple(out)


def take(ops: Sequence[Op], index: tuple[int, ...], inputs: int | None = None) -> tuple[Op, ...]:
    """``ops`` then ``Take(index)``, the ``Take`` moved as far ahead as the ops let it (``Op.pull``): one expert's
    gate from a fused stack is that expert's slice split, not the whole stack split. ``inputs``: how many inputs
    the ops take, to drop a leading ``Take`` that keeps them all."""
    suffix: tuple[Op, ...] = ()
    for i in range(len(ops) - 1, -1, -1):
        got = ops[i].pull(index)
        if got is None:
            return (*ops[:i + 1], Take(index), *suffix)
        index, made = got
        suffix = made + suffix
    return suffix if inputs is not None and index == tuple(range(inputs)) else (Take(index), *suffix)


def runs(ops: Sequence[Op], views: list[View], cap: int) -> list[View] | None:
    """The output views of ``ops`` on input ``views``, or None where an op computes or they pass ``cap`` runs."""
    try:
        for op in ops:
            got = op.runs(views, cap)
            if got is None:
                return None
            views = got
    except TooMany:
        return None
    return views


def describe(ops: Sequence[Op]) -> str:
    """The ops in words, in order."""
    return ", ".join(op.describe() for op in ops) or "copy"
