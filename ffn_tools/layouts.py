"""How gate and up share one tensor: named layouts, and ``fuse``/``split`` as exact inverses.

A fused tensor holds 2I gate/up rows (for an (out, in) weight; columns for a transposed (in, out) kernel)
arranged one of three ways, each with either projection first:

    concat       [g; u]                              Phi-3, transformers v5 experts, vLLM merged columns
    interleaved  g0, u0, g1, u1, ... row by row      GPT-OSS
    tp (N)       [g_0; u_0; g_1; u_1; ...]           vLLM / Megatron, rank r holding [g_r; u_r]

``split(fuse(g, u, L), L) == (g, u)`` bit for bit for every layout: both are pure row moves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import LayoutError

if TYPE_CHECKING:
    import torch

ORDERS = ("gate-up", "up-gate")
ARRANGEMENTS = ("concat", "interleaved", "tp")
AXES = ("rows", "columns")


@dataclass(frozen=True)
class GateUpLayout:
    """A named, exactly reversible arrangement of gate and up in one tensor.

    Attributes:
        order: "gate-up" (gate first) or "up-gate".
        arrangement: "concat", "interleaved" or "tp".
        tp: number of tensor-parallel ranks for "tp" (1 otherwise).
        axis: "rows": the fused dim is the output dim of an (out, in) weight (dim -2; -1 for a bias);
            "columns": the last dim, as in a transposed (in, out) kernel.
    """

    order: str = "gate-up"
    arrangement: str = "concat"
    tp: int = 1
    axis: str = "rows"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise LayoutError(f"unknown gate/up order {self.order!r}; use one of {', '.join(ORDERS)}")
        if self.arrangement not in ARRANGEMENTS:
            raise LayoutError(f"unknown arrangement {self.arrangement!r}; use one of {', '.join(ARRANGEMENTS)}")
        if self.axis not in AXES:
            raise LayoutError(f"unknown axis {self.axis!r}; use one of {', '.join(AXES)}")
        if self.tp < 1 or (self.arrangement != "tp" and self.tp != 1):
            raise LayoutError(f"--tp {self.tp} needs --layout tp (and a degree of at least 1)")

    @property
    def roles(self) -> tuple[str, str]:
        """The two projections in storage order."""
        return ("gate", "up") if self.order == "gate-up" else ("up", "gate")

    def describe(self) -> str:
        """'concat, gate-up' / 'tp=4, up-gate' / 'interleaved, gate-up' (+ ', columns')."""
        arr = f"tp={self.tp}" if self.arrangement == "tp" else self.arrangement
        return f"{arr}, {self.order}" + (", columns" if self.axis == "columns" else "")

    def oriented(self, turned: bool) -> "GateUpLayout":
        """This layout on a tensor stored (in, out) (``turned``: gate and up share its columns) or (out, in) (its
        rows). The axis is the stored tensor's, not a choice: ``--layout interleaved`` fusing into GPT-OSS's
        (E, H, 2I) interleaves columns, as GPT-OSS stores them."""
        axis = "columns" if turned else "rows"
        return self if self.axis == axis else dataclasses.replace(self, axis=axis)

    def same_arrangement(self, other: "GateUpLayout") -> bool:
        """Whether gate and up are arranged alike (order, arrangement, ranks), whatever the axis."""
        return (self.order, self.arrangement, self.tp) == (other.order, other.arrangement, other.tp)

    def dim(self, ndim: int, is_bias: bool = False) -> int:
        """The (non-negative) dim holding the 2I gate/up entries of a tensor with ``ndim`` dims."""
        d = -1 if (is_bias or self.axis == "columns") else -2
        return ndim + d

    def segments(self, fused: int) -> list[tuple[str, int, int, int]]:
        """Contiguous runs of a fused dim of size ``fused`` = 2I.

        Returns:
            (role, fused_start, part_start, length) in storage order: rows fused_start:+length of the
            fused tensor are rows part_start:+length of ``role``.

        Raises:
            LayoutError: ``fused`` is odd, or not divisible by 2 * tp.
        """
        ranks = self.tp if self.arrangement == "tp" else (fused // 2 if self.arrangement == "interleaved" else 1)
        if fused % 2 or (fused // 2) % max(ranks, 1):
            raise LayoutError(self._bad_size(fused))
        step = fused // 2 // ranks  # rows of each projection per run
        out = []
        for r in range(ranks):
            for k, role in enumerate(self.roles):
                out.append((role, (2 * r + k) * step, r * step, step))
        return out

    def _bad_size(self, fused: int) -> str:
        if fused % 2:
            return f"odd number of gate/up rows ({fused}): gate and up must be equal halves"
        return f"{fused // 2} rows per projection do not divide into {self.tp} tensor-parallel ranks (--tp)"


CONCAT = GateUpLayout()


def split(fused: "torch.Tensor", layout: GateUpLayout = CONCAT, *, is_bias: bool = False,
          name: str = "tensor") -> "tuple[torch.Tensor, torch.Tensor]":
    """Split a fused gate/up tensor into (gate, up), each contiguous.

    Raises:
        LayoutError: the fused dim does not fit the layout (message names ``name``).
    """
    import torch

    dim = layout.dim(fused.ndim, is_bias)
    n = fused.shape[dim]
    try:
        segs = layout.segments(n)
    except LayoutError as e:
        raise LayoutError(f"{name} {list(fused.shape)}: {e}") from None
    if layout.arrangement == "interleaved":
        pairs = fused.unflatten(dim, (n // 2, 2))  # (..., I, 2, ...): pair k = (first_k, second_k)
        first, second = pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)
        parts = dict(zip(layout.roles, (first, second)))
    else:  # one run per role (concat) is a view: contiguous as it is along dim 0, no copy made
        runs = {role: [fused.narrow(dim, s, ln) for r, s, _, ln in segs if r == role] for role in ("gate", "up")}
        parts = {role: rs[0] if len(rs) == 1 else torch.cat(rs, dim) for role, rs in runs.items()}
    return parts["gate"].contiguous(), parts["up"].contiguous()


def fuse(gate: "torch.Tensor", up: "torch.Tensor", layout: GateUpLayout = CONCAT, *, is_bias: bool = False,
         name: str = "tensor") -> "torch.Tensor":
    """Fuse gate and up into one tensor in ``layout``; the exact inverse of ``split``.

    Raises:
        LayoutError: gate and up differ in shape or dtype, or their size does not fit the layout.
    """
    import torch

    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise LayoutError(f"{name}: gate {list(gate.shape)} {gate.dtype} and up {list(up.shape)} {up.dtype} "
                          "must have the same shape and dtype to be fused")
    dim = layout.dim(gate.ndim, is_bias)
    try:
        segs = layout.segments(2 * gate.shape[dim])
    except LayoutError as e:
        raise LayoutError(f"{name} {list(gate.shape)}: {e}") from None
    parts = {"gate": gate, "up": up}
    if layout.arrangement == "interleaved":
        first, second = (parts[r] for r in layout.roles)
        return torch.stack([first, second], dim + 1).flatten(dim, dim + 1)
    return torch.cat([parts[r].narrow(dim, p, ln) for r, _, p, ln in segs], dim)
