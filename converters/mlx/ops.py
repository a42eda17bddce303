"""MLX's plan ops (``ffn_tools.ops.Op`` subclasses): quantize, cast and stack as mlx_lm.convert does, with MLX's own ops.

``Quantize`` and ``StreamCast`` are source ops: they read their weight's rows from the checkpoint themselves, a few
rows at a time (``quant.stream``) or in a worker process (``workers``), so their entries have no inputs and the
input never passes through torch. ``Quantize`` DECLARES what the executor reads through ``Entry.place`` and
``Entry.shared`` (never probed):

- ``placement``: ``QuantJob.place`` for its part: told the output file and offset of the part's bytes, a worker
  that has not started the job yet writes them there itself, and ``apply`` then gives ``io.writer.Placed``;
- ``shares``: the ``QuantJob``, one per quantized weight, shared by its weight, scales and (affine) biases entries:
  quantized once for all three; a sample run sets its ``wanted`` (``io.sample.keep_shared``).

``MxCast`` casts a tensor the plan made (a split piece of a fused input, a stack of them) with MLX's ``astype``;
``Members`` applies each stacked member's own ops to its inputs (experts stacked from view entries); ``Sanitized`` is
an output mlx_lm's ``sanitize`` computes, named as data (``names.SanitizeRun``: mlx_lm's module and the config, the
checkpoint and its view), so every op here pickles with plain ``pickle``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ffn_tools.io.dtypes import itemsize, short_name
from ffn_tools.ops import Op, View

from .names import SanitizeRun
from .quant import MX_DTYPES, cast_fn, from_mx, stream, torch_to_mx
from .quantize import PARTS, QuantJob


@dataclass(frozen=True)
class Quantize(Op):
    """Part ``part`` (0 the packed weight, 1 its scales, 2 its biases: affine only) of the weight its ``job``
    quantizes with ``mx.quantize``, bit for bit as ``mlx_lm.convert`` (see the module doc for what it declares)."""

    job: QuantJob = field(compare=False)
    part: int = 0

    def apply(self, ts: list) -> list:
        return [self.job.part(self.part)]

    def describe(self) -> str:
        return f"{PARTS[self.part]} of {self.job.describe()}"

    @property
    def placement(self) -> Callable[[Any, int], None]:
        return partial(self.job.place, self.part)

    @property
    def shares(self) -> QuantJob:
        return self.job


@dataclass(frozen=True)
class StreamCast(Op):
    """The rows of ``sources`` (input tensors in order: one, or experts stacked on dim 0) cast to ``dtype`` with
    MLX's ``astype`` a few rows at a time, read from ``ckpt`` itself (a source op: the entry has no inputs)."""

    ckpt: Any = field(compare=False)
    sources: tuple[str, ...] = ()
    dtype: str = "F32"
    shape: tuple[int, ...] = ()

    def apply(self, ts: list) -> list:
        return [stream(self.ckpt, self.sources, [(self.dtype, self.shape)], cast_fn(self.dtype))[0]]

    def describe(self) -> str:
        return f"cast to {short_name(self.dtype)} with MLX, {len(self.sources)} input(s) streamed by rows"


@dataclass(frozen=True)
class MxCast(Op):
    """Each (torch) tensor cast to ``dtype`` with MLX's ``astype`` (as mlx_lm.convert casts), as a ``RawTensor``."""

    dtype: str

    def apply(self, ts: list) -> list:
        return [from_mx(torch_to_mx(t).astype(MX_DTYPES[self.dtype])) for t in ts]

    def describe(self) -> str:
        return f"cast to {short_name(self.dtype)} with MLX"


@dataclass(frozen=True)
class Members(Op):
    """Plan entries side by side, each made by its own ops from its own inputs: ``groups`` is (its first input in
    the list, the entry) per member, in order; the output is the members' tensors, in order (``Stack`` then stacks
    them). Its byte runs are the members' pieces, where every member has them."""

    groups: tuple[tuple[int, Any], ...]  # (first input, plan.Entry)

    def apply(self, ts: list) -> list:
        return [e.apply(ts[a:a + len(e.inputs)]) for a, e in self.groups]

    def describe(self) -> str:
        return f"{len(self.groups)} members made by their own ops"

    def runs(self, views: list[View], cap: int) -> list[View] | None:
        out = []
        for a, e in self.groups:
            if e.pieces is None:
                return None
            out.append(View(tuple(e.shape), itemsize(e.st_dtype), tuple((a + k, o, n) for k, o, n in e.pieces)))
        return out


@dataclass(frozen=True)
class Sanitized(Op):
    """Output ``name`` as mlx_lm's ``sanitize`` computes it from the whole input (``run``: that run, made once
    for every such output), cast to ``dtype`` with MLX where given. A source op: the entry has no inputs."""

    name: str
    run: SanitizeRun = field(compare=False)
    dtype: str | None = None

    def apply(self, ts: list) -> list:
        a = self.run.get(self.name)
        return [from_mx(a.astype(MX_DTYPES[self.dtype]) if self.dtype else a)]

    def describe(self) -> str:
        cast = f", cast to {short_name(self.dtype)}" if self.dtype else ""
        return f"computed by mlx_lm's sanitize{cast}"
