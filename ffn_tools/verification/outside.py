"""The tensors outside the FFNs, in ``verify``: paired by name (each reader presents Hugging Face names),
compared bit for bit where the copy should be lossless, within the tolerance row where it cannot be (a cast,
a quantized tensor read back dequantized; ``checks.outside.outside_tolerance``), and listed when present on
one side only. A tensor both sides store quantized alike is first compared as stored bytes (``stored.same_stored``:
codes and scales, nothing dequantized); only if they differ is it compared dequantized. A tensor B stores quantized where A's is not must be A's re-quantized with B's parameters, bit
for bit, where its scheme can re-derive its codes (``QuantScheme.requantized``).
"""

from __future__ import annotations

import functools
import logging

from ..checks.diagnose import Blocks, first_difference, first_difference_in_blocks
from ..checks.outside import OutsideResult, outside_tolerance, tolerance_in_blocks
from ..errors import CheckpointError
from ..io.dtypes import short_name
from ..io.store import TensorInfo, read_bytes
from ..quant import IDENTICAL, WITHIN
from ..tolerances import tolerance_for
from .kept import difference, kept_side
from .quant import quantization, tensor_bits
from .stored import same_stored, scale_under_same_codes

log = logging.getLogger(__name__)


def _requantized(res: OutsideResult, name: str, ca, cb) -> bool:
    """B's quantized ``name`` against A's re-quantized with B's parameters (A's stored unquantized): identical
    (counted), or a difference (listed); False where it does not apply or cannot decide (a scheme that cannot
    re-derive its codes, A's bits not reproducible: the tolerance row decides, as for any dequantized tensor)."""
    q, parts = cb.quantized(name), cb.quantized_parts(name)
    if q is None or parts is None:
        return False
    outcome, why = q.scheme.requantized(name, ca[name], q, parts)
    if outcome == WITHIN:
        log.info("%s", why)
        return False
    if outcome == IDENTICAL:
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
        if (same := same_stored(ca, cb, name)):  # B stores A's quantized bytes: compared so, nothing dequantized
            res.identical += 1
            continue
        if same is False and (defect := scale_under_same_codes(ca, cb, name)):  # A's codes under another scale
            res.differ.append(defect)
            continue
        qa, qb = tensor_bits(ca, name, ga), tensor_bits(cb, name, gb)
        if (sides := kept_side(ca, cb, name, name)) is not None:  # one side holds the other's codes: exactly
            k, q = sides
            same, why = difference(name, ca if q == "A" else cb, name, (cb if k == "B" else ca)[name], k, q)
            if same is not None:
                if same:
                    res.identical += 1
                    res.codes += 1
                else:
                    res.differ.append(why or name)
                continue
            log.info("%s", why)  # not codes on the other side: the tolerance row below
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
