"""The tensors outside the FFNs, in ``verify``: paired by name (each reader presents Hugging Face names),
compared bit for bit where the copy should be lossless, within the tolerance row where it cannot be (a cast,
a quantized tensor read back dequantized), and listed when present on one side only. A tensor B stores
MLX-quantized where A's is not must be A's re-quantized with B's parameters, bit for bit (``requant``).

Within tolerance means, for weights ``a`` (A) and ``b`` (B): every ``|b - a| <= atol * rms(a) + rtol * |a|``
and ``cosine(a, b) >= min_cosine``, with the row of the coarser dtype and the tensor's quantization bits (the
table ``verify --help`` prints). The cosine is what catches a zeroed or replaced tensor under a loose row.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from ..io.dtypes import short_name
from ..errors import listing
from ..tolerances import tolerance_for
from .diagnose import first_difference
from .quant import quantization, row_bits

log = logging.getLogger(__name__)

MAX_LISTED = 8


@dataclass
class OutsideResult:
    """Every non-FFN tensor of A and B, accounted for."""

    identical: int = 0
    requantized: int = 0  # of the identical: B's MLX-quantized bytes are A's re-quantized (``requant``)
    within: int = 0
    differ: list[str] = field(default_factory=list)  # "name: first difference", one per tensor
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    skipped: str | None = None  # why the comparison did not run (--ffn-only, an FFN-only extract)

    @property
    def passed(self) -> bool:
        return not (self.differ or self.only_a or self.only_b)

    def line(self) -> str:
        if self.skipped:
            return f"outside FFNs: not compared ({self.skipped})"
        requant = f" ({self.requantized} re-quantized bit for bit)" if self.requantized else ""
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
        return {"identical": self.identical, "requantized": self.requantized, "within_tolerance": self.within,
                "differ": self.differ, "only_a": self.only_a, "only_b": self.only_b, "skipped": self.skipped,
                "passed": self.passed}


def _bits(ckpt, name: str, default: int | None) -> int | None:
    """The tolerance bits of one tensor: as its reader resolves them, else the checkpoint's recorded
    quantization (weights written dequantized from a quantized model: every tensor may carry its error)."""
    if ckpt.resolves_quantization:
        p = ckpt.quant_params(name)
        return row_bits(p) if p else None
    return default


def _requantized(res: OutsideResult, name: str, ca, cb) -> bool:
    """B's MLX-quantized ``name`` against A's re-quantized with B's parameters (A's stored unquantized):
    identical (counted), or a difference (listed); False where it does not apply or cannot decide (A's bits
    not reproducible, every row above the floor: the tolerance row decides, as for any dequantized tensor)."""
    parts = cb.quantized_parts(name)
    if parts is None:
        return False
    from .requant import check_requantized

    outcome, why = check_requantized(name, ca[name], parts)
    if outcome == "within":
        log.info("%s", why)
        return False
    if outcome == "identical":
        res.identical += 1
        res.requantized += 1
    else:
        res.differ.append(why or f"{name}: differs from A re-quantized")
    return True


def compare_outside(ca, cb, fa, fb, *, atol: float | None = None, rtol: float | None = None,
                    elsewhere: frozenset[str] = frozenset()) -> OutsideResult:
    """Compare the tensors of ``ca`` and ``cb`` that belong to no FFN of ``fa`` / ``fb``, except B's
    ``elsewhere``, which another check compares (a GGUF's weights stored plus one: ``gguf_checks``)."""
    res = OutsideResult()
    ga, gb = ((q or {}).get("bits") if not c.resolves_quantization else None
              for c, q in ((ca, quantization(ca)), (cb, quantization(cb))))
    a_names = [n for n in ca if n not in fa.tensors and n not in elsewhere]
    b_set = {n for n in cb if n not in fb.tensors and n not in elsewhere}
    res.only_a = sorted(n for n in a_names if n not in b_set)
    res.only_b = sorted(b_set.difference(a_names))
    for name in sorted(n for n in a_names if n in b_set):
        ia, ib = ca.info(name), cb.info(name)
        if tuple(ia.shape) != tuple(ib.shape):
            res.differ.append(f"{name}: A is {short_name(ia.st_dtype)}{list(ia.shape)}, "
                              f"B is {short_name(ib.st_dtype)}{list(ib.shape)}")
            continue
        qa, qb = _bits(ca, name, ga), _bits(cb, name, gb)
        if qa is None and qb is not None and _requantized(res, name, ca, cb):
            continue
        a, b = ca[name], cb[name]
        if qa is None and qb is None and a.dtype == b.dtype:
            diff = first_difference(name, a, b)
            if diff:
                res.differ.append(diff)
            else:
                res.identical += 1
            continue
        why = outside_tolerance(name, a, b, tolerance_for([a.dtype, b.dtype], min(
            (q for q in (qa, qb) if q is not None), default=None), atol=atol, rtol=rtol))
        if why:
            res.differ.append(why)
        else:
            res.within += 1
    return res


def outside_tolerance(name: str, a, b, tol) -> str | None:
    """None when B's ``b`` is within ``tol`` of A's ``a``, else one sentence saying where and by how much."""
    import torch

    if not (a.is_floating_point() and b.is_floating_point()):
        return first_difference(name, a, b.to(a.dtype))
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    if not torch.isfinite(b64).all():
        return f"{name}: B has {int((~torch.isfinite(b64)).sum())} inf/nan values"
    err = (b64 - a64).abs()
    rms = float(a64.square().mean().sqrt()) if a64.numel() else 0.0
    bound = tol.atol * rms + tol.rtol * a64.abs()
    na, nb = float(a64.norm()), float(b64.norm())
    cos = float(a64 @ b64) / (na * nb) if na and nb else (1.0 if na == nb else 0.0)
    bad = err > bound
    if not bad.any() and cos >= tol.min_cosine:
        return None
    k = int(bad.nonzero()[0]) if bad.any() else int(err.argmax())
    idx = list(map(int, torch.unravel_index(torch.tensor(k), tuple(a.shape)))) if a.dim() else []
    return (f"{name}{idx}: A {float(a64[k]):.6g} vs B {float(b64[k]):.6g}; {int(bad.sum())} of {a64.numel()} "
            f"elements out of tolerance ({tol.row}), cosine {cos:.6f}"
            + ("" if math.isfinite(cos) and cos >= tol.min_cosine else f" < {tol.min_cosine}"))
