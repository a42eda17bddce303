"""The tensors outside the FFNs: what their comparison found (``OutsideResult``; ``verify`` compares them,
and what B's client derives from A, compared once), and the criterion of a tensor within its tolerance
row (``outside_tolerance``).

Within tolerance means, for weights ``a`` (A) and ``b`` (B): every ``|b - a| <= atol * rms(a) + rtol * |a|``
and ``cosine(a, b) >= min_cosine``, with the row of the coarser dtype and the tensor's quantization bits (the
table ``verify --help`` prints). The cosine is what catches a zeroed or replaced tensor under a loose row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import listing
from . import Check
from .diagnose import Blocks, first_difference_in_blocks

MAX_LISTED = 8
IDENTICAL, WITHIN, DIFFER = "identical", "within", "differ"  # a derived tensor's outcome (``Derived``)


@dataclass(frozen=True)
class Derived:
    """One of B's tensors compared once with what B's client derives from A (``verification.expected``): the
    tensor A's would become through the ops that make B, against B's as stored. ``outcome``: ``IDENTICAL`` (bit
    for bit), ``WITHIN`` (the tolerance row) or ``DIFFER`` (``why``, naming the tensor)."""

    name: str
    outcome: str
    why: str | None = None


@dataclass
class OutsideResult(Check):
    """Every non-FFN tensor of A and B, accounted for (``differ``, ``only_a``, ``only_b`` are its failures)."""

    name: ClassVar[str] = "outside FFNs"

    identical: int = 0
    requantized: int = 0  # of the identical: B's MLX-quantized bytes are A's re-quantized (``requant``)
    codes: int = 0  # of the identical: one side holds the other's stored codes, its values exactly (``kept``)
    within: int = 0
    differ: list[str] = field(default_factory=list)  # "name: first difference", one per tensor
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not (self.differ or self.only_a or self.only_b)

    def add(self, d: Derived) -> None:
        """Count one derived tensor's comparison (``Derived``): it is counted once, where its outcome says."""
        if d.outcome == IDENTICAL:
            self.identical += 1
        elif d.outcome == WITHIN:
            self.within += 1
        else:
            self.differ.append(d.why or f"{d.name}: differs from what B's client derives from A")

    def line(self) -> str:
        if self.skipped:
            return f"outside FFNs: not compared ({self.skipped})"
        requant = f" ({self.requantized} re-quantized bit for bit)" if self.requantized else ""
        requant += f" ({self.codes} holding the other's codes exactly)" if self.codes else ""
        return (f"outside FFNs: {self.identical} identical{requant}, {self.within} within tolerance, "
                f"{len(self.differ)} differ, {len(self.only_a)} only in A, {len(self.only_b)} only in B")

    def failures(self) -> list[str]:
        out = [f"outside FFNs: {d}" for d in self.differ]
        for side, names in (("A", self.only_a), ("B", self.only_b)):
            if names:
                out.append(f"outside FFNs: {len(names)} tensor{'s' * (len(names) > 1)} only in {side}: "
                           f"{listing(names, MAX_LISTED)}")
        return out

    def as_dict(self) -> dict:
        return {"identical": self.identical, "requantized": self.requantized, "codes": self.codes,
                "within_tolerance": self.within,
                "differ": self.differ, "only_a": self.only_a, "only_b": self.only_b, "skipped": self.skipped,
                "passed": self.verdict}


def outside_tolerance(name: str, a, b, tol) -> str | None:
    """None when B's ``b`` is within ``tol`` of A's ``a``, else one sentence saying where and by how much."""
    return tolerance_in_blocks(name, lambda: [(0, a, b)], tuple(a.shape), tol)


def tolerance_in_blocks(name: str, blocks: Callable[[], Blocks], shape: tuple[int, ...], tol) -> str | None:
    """``outside_tolerance`` of two tensors of ``shape`` given as row blocks (``blocks()`` gives them, once
    for the sums (rms, norms, cosine) and once for the bounds): float64 copies of one block at a time, not of
    the whole tensor (eight times a bfloat16 tensor's bytes, twice)."""
    import torch

    total = sq_a = sq_b = dot = 0.0
    bad_values = 0
    for _, a, b in blocks():
        if not (a.is_floating_point() and b.is_floating_point()):
            return first_difference_in_blocks(name, ((r, x, y.to(x.dtype)) for r, x, y in blocks()))
        a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
        bad_values += int((~torch.isfinite(b64)).sum())
        total += a64.numel()
        sq_a, sq_b, dot = sq_a + float(a64.square().sum()), sq_b + float(b64.square().sum()), dot + float(a64 @ b64)
    if bad_values:
        return f"{name}: B has {bad_values} inf/nan values"
    rms = math.sqrt(sq_a / total) if total else 0.0
    na, nb = math.sqrt(sq_a), math.sqrt(sq_b)
    cos = dot / (na * nb) if na and nb else (1.0 if na == nb else 0.0)
    row_size = math.prod(shape[1:]) if shape else 1
    n_bad, first, worst = 0, None, None  # first: (flat index, a, b) out of bounds; worst: (err, index, a, b)
    for row, a, b in blocks():
        a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
        err = (b64 - a64).abs()
        bad = err > tol.atol * rms + tol.rtol * a64.abs()
        if a64.numel() and (worst is None or float(err.max()) > worst[0]):
            k = int(err.argmax())
            worst = (float(err[k]), row * row_size + k, float(a64[k]), float(b64[k]))
        if bad.any():
            n_bad += int(bad.sum())
            if first is None:
                k = int(bad.nonzero()[0])
                first = (row * row_size + k, float(a64[k]), float(b64[k]))
    if not n_bad and cos >= tol.min_cosine:
        return None
    k, va, vb = first if first is not None else worst[1:] if worst is not None else (0, 0.0, 0.0)
    idx = list(map(int, torch.unravel_index(torch.tensor(k), shape))) if shape else []
    return (f"{name}{idx}: A {va:.6g} vs B {vb:.6g}; {n_bad} of {int(total)} "
            f"elements out of tolerance ({tol.row}), cosine {cos:.6f}"
            + ("" if math.isfinite(cos) and cos >= tol.min_cosine else f" < {tol.min_cosine}"))
