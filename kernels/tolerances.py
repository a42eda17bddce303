"""Per-dtype tolerances for comparing a backend against the float64 reference, in one table.

An element passes when `|actual - ref| <= atol + rtol * |ref|` (llm.c's validate_result). The bounds come
from the numerics each backend promises, with room for the float32 math libraries disagreeing:

* activation (`silu_mul*`): two roundings to the dtype (unit roundoff u = 2**-24, 2**-11, 2**-8 for
  float32, float16, bfloat16), so rtol ~ 2u plus a few float32 ulp of exp/erf/tanh error; atol covers the
  cancellation in `1 + erf(x)` / `1 + tanh(.)` for very negative x, where every float32 gelu (PyTorch's
  included) loses relative accuracy, and float16 subnormals.
* ffn: inputs O(1) (x ~ N(0, 1), weights ~ N(0, 1/fan_in)); the gate/up/down matmuls each round their
  float32 accumulations to the dtype once more, so the bounds are looser and atol dominates.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ACTIVATION_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-5, 2e-3),
    torch.bfloat16: (1e-5, 1.6e-2),
}
"""(atol, rtol) per dtype for `silu_mul` and `silu_mul_fused` against the float64 reference."""

FFN_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
"""(atol, rtol) per dtype for `ffn` against the float64 reference, for O(1) inputs."""


class Comparison(NamedTuple):
    ok: bool
    max_abs: float
    max_rel: float
    n_bad: int
    first_bad: list[tuple[tuple[int, ...], float, float]]  # (index, actual, reference)

    def summary(self) -> str:
        bad = ", ".join(f"{list(i)}: {a!r} vs {r!r}" for i, a, r in self.first_bad)
        return (
            f"max abs {self.max_abs:.3e}, max rel {self.max_rel:.3e}, {self.n_bad} element(s) out of tolerance"
            + (f"; first: {bad}" if bad else "")
        )


def tolerance(dtype: torch.dtype, kind: str = "activation") -> tuple[float, float]:
    """(atol, rtol) for `dtype`; kind is "activation" or "ffn"."""
    table = {"activation": ACTIVATION_TOL, "ffn": FFN_TOL}[kind]
    return table[dtype]


def compare(actual: torch.Tensor, reference: torch.Tensor, atol: float, rtol: float, show: int = 5) -> Comparison:
    """Compare in float64; NaN or inf in `actual` where the reference is finite always fails."""
    if actual.shape != reference.shape:
        raise ValueError(f"Shape mismatch: actual {tuple(actual.shape)} vs reference {tuple(reference.shape)}.")
    a = actual.detach().double().cpu()
    r = reference.detach().double().cpu()
    diff = (a - r).abs()
    bad = ~(diff <= atol + rtol * r.abs())  # NaN compares False, so it is bad
    finite = torch.isfinite(diff)
    max_abs = float(diff[finite].max()) if finite.any() else 0.0
    rel = diff / r.abs().clamp_min(1e-30)
    max_rel = float(rel[finite].max()) if finite.any() else 0.0
    if not finite.all():
        max_abs = max_rel = float("inf")
    idx = bad.nonzero()[:show]
    first = [(tuple(int(v) for v in i), float(a[tuple(i)]), float(r[tuple(i)])) for i in idx]
    return Comparison(not bool(bad.any()), max_abs, max_rel, int(bad.sum()), first)
