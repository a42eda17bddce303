"""Pure moves: the output's bytes are input bytes rearranged (no value changes), each with its byte runs."""

from __future__ import annotations

from dataclasses import dataclass

from ..layouts import CONCAT, GateUpLayout, fuse, split
from .base import Each, Op
from .views import View, cat, narrow


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


@dataclass(frozen=True)
class Copy(Each):
    """The tensors as they are."""

    def apply(self, ts: list) -> list:
        return list(ts)

    def reverse(self) -> Op:
        return self

    def describe(self) -> str:
        return "copy"

    def runs(self, views: list[View], cap: int) -> list[View]:
        return list(views)


@dataclass(frozen=True)
class Take(Op):
    """Tensors ``index`` of the list (an entry keeps one of the parts a split makes)."""

    index: tuple[int, ...]

    def apply(self, ts: list) -> list:
        return [ts[i] for i in self.index]

    def describe(self) -> str:
        return f"part {','.join(map(str, self.index))}"

    def pull(self, index: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[Op, ...]]:
        return tuple(self.index[i] for i in index), ()

    def runs(self, views: list[View], cap: int) -> list[View]:
        return [views[i] for i in self.index]


@dataclass(frozen=True)
class Select(Each):
    """``t[index]`` along ``dim`` of each tensor (one expert of a stack), contiguous."""

    index: int
    dim: int = 0

    def apply(self, ts: list) -> list:
        return [t.select(self.dim, self.index).contiguous() for t in ts]

    def describe(self) -> str:
        return f"[{self.index}]" if self.dim == 0 else f"index {self.index} of dim {self.dim}"

    def runs(self, views: list[View], cap: int) -> list[View]:
        out = []
        for v in views:
            d = _dim(self.dim, len(v.shape))
            n = narrow(v, d, self.index, 1, cap)
            out.append(n.reshaped(v.shape[:d] + v.shape[d + 1:]))
        return out


@dataclass(frozen=True)
class Rows(Each):
    """``t.narrow(dim, start, length)`` of each tensor, contiguous."""

    start: int
    length: int
    dim: int = 0

    def apply(self, ts: list) -> list:
        return [t.narrow(self.dim, self.start, self.length).contiguous() for t in ts]

    def describe(self) -> str:
        return f"{'rows' if self.dim == 0 else f'dim {self.dim}'} {self.start}:{self.start + self.length}"

    def runs(self, views: list[View], cap: int) -> list[View]:
        return [narrow(v, _dim(self.dim, len(v.shape)), self.start, self.length, cap) for v in views]


@dataclass(frozen=True)
class Split(Op):
    """Each fused gate/up tensor into gate, up (``layouts.split``): n tensors in, 2n out."""

    layout: GateUpLayout = CONCAT
    is_bias: bool = False
    name: str = "tensor"  # for errors

    def apply(self, ts: list) -> list:
        return [p for t in ts for p in split(t, self.layout, is_bias=self.is_bias, name=self.name)]

    def reverse(self) -> Op:
        return Fuse(self.layout, self.is_bias, self.name)

    def describe(self) -> str:
        return f"split ({self.layout.describe()})"

    def pull(self, index: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[Op, ...]]:
        need = tuple(dict.fromkeys(i // 2 for i in index))
        return need, (self, Take(tuple(2 * need.index(i // 2) + i % 2 for i in index)))

    def runs(self, views: list[View], cap: int) -> list[View]:
        out = []
        for v in views:
            d = self.layout.dim(len(v.shape), self.is_bias)
            segs = self.layout.segments(v.shape[d])
            for role in ("gate", "up"):
                out.append(cat([narrow(v, d, s, ln, cap) for r, s, _, ln in segs if r == role], d, cap))
        return out


@dataclass(frozen=True)
class Fuse(Op):
    """Each (gate, up) pair of the list fused into one tensor (``layouts.fuse``): 2n tensors in, n out."""

    layout: GateUpLayout = CONCAT
    is_bias: bool = False
    name: str = "tensor"

    def apply(self, ts: list) -> list:
        return [fuse(ts[k], ts[k + 1], self.layout, is_bias=self.is_bias, name=self.name)
                for k in range(0, len(ts), 2)]

    def reverse(self) -> Op:
        return Split(self.layout, self.is_bias, self.name)

    def describe(self) -> str:
        return f"fuse ({self.layout.describe()})"

    def pull(self, index: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[Op, ...]]:
        return tuple(j for i in index for j in (2 * i, 2 * i + 1)), (self,)

    def runs(self, views: list[View], cap: int) -> list[View]:
        out = []
        for k in range(0, len(views), 2):
            parts = {"gate": views[k], "up": views[k + 1]}
            d = self.layout.dim(len(views[k].shape), self.is_bias)
            segs = self.layout.segments(2 * views[k].shape[d])
            out.append(cat([narrow(parts[r], d, p, ln, cap) for r, _, p, ln in segs], d, cap))
        return out


@dataclass(frozen=True)
class Stack(Op):
    """The whole list stacked on a new dim 0 (experts into one tensor); ``n``: how many, where known."""

    n: int | None = None

    def apply(self, ts: list) -> list:
        import torch

        return [torch.stack(ts)]

    def reverse(self) -> Op:
        return Unstack(self.n)

    def describe(self) -> str:
        return "stack"

    def runs(self, views: list[View], cap: int) -> list[View]:
        return [cat([v.reshaped((1, *v.shape)) for v in views], 0, cap)]


@dataclass(frozen=True)
class Unstack(Op):
    """Each tensor cut along dim 0 into its slices (a stack into its experts); ``n``: its dim 0, where known."""

    n: int | None = None

    def apply(self, ts: list) -> list:
        return [s.contiguous() for t in ts for s in t.unbind(0)]

    def reverse(self) -> Op:
        return Stack(self.n)

    def describe(self) -> str:
        return "unstack"

    def pull(self, index: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[Op, ...]] | None:
        if self.n is None or len(index) != 1:
            return None
        return (index[0] // self.n,), (Select(index[0] % self.n),)

    def runs(self, views: list[View], cap: int) -> list[View]:
        return [narrow(v, 0, i, 1, cap).reshaped(v.shape[1:]) for v in views for i in range(v.shape[0])]


@dataclass(frozen=True)
class Concat(Op):
    """The whole list concatenated along ``dim``."""

    sizes: tuple[int, ...]  # each input's extent along dim: what ``Chunk`` cuts back
    dim: int = 0

    def apply(self, ts: list) -> list:
        import torch

        return [torch.cat(ts, self.dim)]

    def reverse(self) -> Op:
        return Chunk(self.sizes, self.dim)

    def describe(self) -> str:
        return f"concatenated along dim {self.dim}"

    def runs(self, views: list[View], cap: int) -> list[View]:
        return [cat(views, _dim(self.dim, len(views[0].shape)), cap)]


@dataclass(frozen=True)
class Chunk(Op):
    """One tensor cut along ``dim`` into pieces of ``sizes``."""

    sizes: tuple[int, ...]
    dim: int = 0

    def apply(self, ts: list) -> list:
        return [p.contiguous() for t in ts for p in t.split(list(self.sizes), self.dim)]

    def reverse(self) -> Op:
        return Concat(self.sizes, self.dim)

    def describe(self) -> str:
        return f"cut along dim {self.dim} into {list(self.sizes)}"

    def pull(self, index: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[Op, ...]] | None:
        if len(index) != 1:
            return None
        k, i = divmod(index[0], len(self.sizes))
        return (k,), (Rows(sum(self.sizes[:i]), self.sizes[i], self.dim),)

    def runs(self, views: list[View], cap: int) -> list[View]:
        out = []
        for v in views:
            d, start = _dim(self.dim, len(v.shape)), 0
            for n in self.sizes:
                out.append(narrow(v, d, start, n, cap))
                start += n
        return out


@dataclass(frozen=True)
class Transpose(Each):
    """Dims ``a`` and ``b`` of each tensor swapped, contiguous (a kernel stored (in, out) turned to (out, in))."""

    a: int = -2
    b: int = -1

    def apply(self, ts: list) -> list:
        return [t.transpose(self.a, self.b).contiguous() for t in ts]

    def reverse(self) -> Op:
        return self

    def describe(self) -> str:
        return "transposed"


@dataclass(frozen=True)
class Reshape(Each):
    """Each tensor viewed as ``shape`` (flattening or unflattening a stack): the bytes unchanged."""

    shape: tuple[int, ...]
    before: tuple[int, ...] | None = None  # the input's shape: what ``reverse`` gives back

    def apply(self, ts: list) -> list:
        return [t.reshape(self.shape).contiguous() for t in ts]

    def reverse(self) -> Op | None:
        return None if self.before is None else Reshape(self.before, self.shape)

    def describe(self) -> str:
        return f"reshaped to {list(self.shape)}"

    def runs(self, views: list[View], cap: int) -> list[View]:
        return [v.reshaped(self.shape) for v in views]


@dataclass(frozen=True)
class Permute(Each):
    """Each tensor's blocks along ``dim`` reordered: block ``i`` of the output is block ``order[i]`` of the input
    (``block`` entries each; rotary q/k rows reordered per head)."""

    order: tuple[int, ...]
    dim: int = 0
    block: int = 1

    def apply(self, ts: list) -> list:
        import torch

        out = []
        for t in ts:
            d = _dim(self.dim, t.ndim)
            blocks = t.unflatten(d, (len(self.order), self.block))
            out.append(blocks.index_select(d, torch.tensor(self.order)).flatten(d, d + 1).contiguous())
        return out

    def reverse(self) -> Op:
        inverse = [0] * len(self.order)
        for i, j in enumerate(self.order):
            inverse[j] = i
        return Permute(tuple(inverse), self.dim, self.block)

    def describe(self) -> str:
        return f"blocks of {self.block} reordered along dim {self.dim}"

    def runs(self, views: list[View], cap: int) -> list[View]:
        out = []
        for v in views:
            d = _dim(self.dim, len(v.shape))
            out.append(cat([narrow(v, d, i * self.block, self.block, cap) for i in self.order], d, cap))
        return out
