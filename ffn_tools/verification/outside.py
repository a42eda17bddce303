"""The tensors outside the FFNs, in ``verify``: paired by name (each reader presents Hugging Face names),
compared bit for bit where the copy should be lossless, within the tolerance row where it cannot be (a cast,
a quantized tensor read back dequantized), and listed when present on one side only. A tensor B stores
MLX-quantized where A's is not must be A's re-quantized with B's parameters, bit for bit (``requant``).

Within tolerance means, for weights ``a`` (A) and ``b`` (B): every ``|b - a| <= atol * rms(a) + rtol * |a|``
and ``cosine(a, b) >= min_cosine``, with the row of the coarser dtype and the tensor's quantization bits (the
table ``verify --help`` prints). The cosine is what catches a zeroed or replaced tensor under a loose row.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import CheckpointError, listing
from ..io.dtypes import short_name
from ..io.store import TensorInfo, read_bytes
from ..tolerances import tolerance_for
from .diagnose import Blocks, first_difference, first_difference_in_blocks
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
        if qa is None and qb is None and in_blocks(ia, ib):  # from the files, a block of rows at a time
            dtypes, exact = [ia.dtype, ib.dtype], ia.st_dtype == ib.st_dtype
            blocks = functools.partial(row_blocks, ia, ib)
            why = (first_difference_in_blocks(name, blocks()) if exact else tolerance_in_blocks(
                name, blocks, tuple(ia.shape), tolerance_for(dtypes, None, atol=atol, rtol=rtol)))
        else:
            a, b = ca[name], cb[name]
            exact = qa is None and qb is None and a.dtype == b.dtype
            why = first_difference(name, a, b) if exact else outside_tolerance(name, a, b, tolerance_for(
                [a.dtype, b.dtype], min((q for q in (qa, qb) if q is not None), default=None), atol=atol, rtol=rtol))
            del a, b
        if why:
            res.differ.append(why)
        elif exact:
            res.identical += 1
        else:
            res.within += 1
    return res


BLOCK_BYTES = 32 << 20  # a larger tensor stored as plain bytes is compared in row blocks of about this size
PLAIN = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8"})


def in_blocks(ia: TensorInfo, ib: TensorInfo) -> bool:
    """Whether a pair is compared in row blocks read from the files (``row_blocks``) rather than whole:
    both stored as their bytes (``start``), in a dtype of whole bytes, with rows to divide, and larger than
    ``BLOCK_BYTES`` (an embedding: a Llama-3-70B's is 2 GB, and a cast pair's float64 copies eight times that)."""
    return (ia.start is not None and ib.start is not None and ia.st_dtype in PLAIN and ib.st_dtype in PLAIN
            and len(ia.shape) > 1 and ia.shape[0] > 1 and max(ia.nbytes, ib.nbytes) > BLOCK_BYTES)


def row_blocks(ia: TensorInfo, ib: TensorInfo) -> Blocks:
    """(first row, A's rows, B's rows) of two tensors of the same shape, about ``BLOCK_BYTES`` a block, each
    read with ``pread`` when it is compared and dropped after."""
    rows = ia.shape[0]
    step = max(1, BLOCK_BYTES // max(ia.nbytes // rows, ib.nbytes // rows))
    for row in range(0, rows, step):
        end = min(rows, row + step)
        yield row, _rows(ia, row, end), _rows(ib, row, end)


def _rows(info: TensorInfo, start: int, end: int):
    import torch

    size = info.nbytes // info.shape[0]
    assert info.start is not None
    try:
        data = read_bytes(info.file, info.start + start * size, (end - start) * size)
    except OSError as e:
        raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r} ({e})") from None
    return torch.frombuffer(data, dtype=info.dtype).reshape((end - start, *info.shape[1:]))


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
