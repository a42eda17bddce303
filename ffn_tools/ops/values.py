"""Ops that change values: casts, affine maps, a low-rank sum, constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..io.dtypes import as_st, short_name, torch_dtype
from .base import Each, Op
from .views import View

# Casts that hold every value of the narrower type exactly: their reverse gives back the input bit for bit.
_EXACT = {("BF16", "F32"), ("F16", "F32"), ("BF16", "F64"), ("F16", "F64"), ("F32", "F64"), ("I8", "I16"),
          ("I8", "I32"), ("I8", "I64"), ("I16", "I32"), ("I16", "I64"), ("I32", "I64"), ("U8", "I16"),
          ("U8", "I32"), ("U8", "I64"), ("U8", "U16"), ("U8", "U32"), ("U8", "U64"), ("F8_E4M3", "F32"),
          ("F8_E4M3", "BF16"), ("F8_E4M3", "F16"), ("F8_E5M2", "F32"), ("F8_E5M2", "F16"), ("F8_E5M2", "BF16")}


@dataclass(frozen=True)
class Cast(Each):
    """Each tensor cast to ``dtype`` (a safetensors dtype string); ``source``: the input's, where known."""

    dtype: str
    source: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_st(self.dtype))
        if self.source is not None:
            object.__setattr__(self, "source", as_st(self.source))

    def apply(self, ts: list) -> list:
        to = torch_dtype(self.dtype)
        return [t.to(to) for t in ts]

    def reverse(self) -> Op | None:
        """The cast back, where this one widens exactly (bf16 -> f32 -> bf16 gives the same bits)."""
        if self.source is None:
            return None
        if self.source == self.dtype:
            return self
        return Cast(self.source, self.dtype) if (self.source, self.dtype) in _EXACT else None

    def describe(self) -> str:
        frm = f"{short_name(self.source)} " if self.source else ""
        return f"cast {frm}-> {short_name(self.dtype)}" if frm else f"cast to {short_name(self.dtype)}"

    def runs(self, views: list[View], cap: int) -> list[View] | None:
        return list(views) if self.source == self.dtype else None

    @property
    def elementwise(self) -> bool:
        return True

    def into(self, src: Any, out: Any) -> object:
        return out.copy_(src)


@dataclass(frozen=True)
class Affine(Each):
    """Each tensor ``t * scale + shift`` computed in float32, stored back in its dtype (a norm's +1 shift).
    No exact reverse: rounding in a narrow dtype may not undo."""

    scale: float = 1.0
    shift: float = 0.0

    def apply(self, ts: list) -> list:
        import torch

        return [(t.to(torch.float32) * self.scale + self.shift).to(t.dtype) for t in ts]

    def describe(self) -> str:
        parts = ([f"x {self.scale:g}"] if self.scale != 1 else []) + ([f"{self.shift:+g}"] if self.shift else [])
        return " ".join(parts) or "identity"

    @property
    def elementwise(self) -> bool:
        return True

    def into(self, src: Any, out: Any) -> object:
        import torch

        return out.copy_(src.to(torch.float32) * self.scale + self.shift)


@dataclass(frozen=True)
class Const(Op):
    """A constant 1-D tensor (its inputs ignored): compressed-tensors' ``weight_shape``."""

    values: tuple[int, ...]
    dtype: str = "I64"

    def apply(self, ts: list) -> list:
        import torch

        return [torch.tensor(list(self.values), dtype=torch_dtype(self.dtype))]

    def describe(self) -> str:
        return f"constant {list(self.values)}"


@dataclass(frozen=True)
class AddLowRank(Each):
    """Each tensor ``W + scale·B·A`` (a LoRA merged), summed in float32 a block of rows at a time and rounded once
    to W's dtype; a stacked (E, out, in) W takes (E, ...) factors, expert by expert. Not reversible (rounding)."""

    a: Any = field(compare=False)  # (rank, in) or (E, rank, in)
    b: Any = field(compare=False)  # (out, rank) or (E, out, rank)
    scale: float = 1.0
    block: int = 1 << 21  # float32 elements of the running sum at a time (8 MiB)

    def apply(self, ts: list) -> list:
        return [self._one(w) for w in ts]

    def _one(self, w: Any) -> Any:
        import torch

        out = torch.empty_like(w)
        a, b = self.a.to(torch.float32), self.b.to(torch.float32)
        for e in range(w.shape[0]) if w.ndim == 3 else (None,):  # a stacked tensor: expert by expert
            we, oe, ae, be = (w, out, a, b) if e is None else (w[e], out[e], a[e], b[e])
            step = max(1, self.block // we.shape[1])
            for r in range(0, we.shape[0], step):  # a block of rows at a time: float32 only for the block
                acc = we[r:r + step].to(torch.float32, copy=True)  # never the input's own memory
                acc.addmm_(be[r:r + step], ae, alpha=self.scale)  # acc += scale·B·A, in place
                oe[r:r + step] = acc
        return out

    def describe(self) -> str:
        return f"+ {self.scale:g}·B·A (rank {self.a.shape[-2]}), float32, rounded once"
