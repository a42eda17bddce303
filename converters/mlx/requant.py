"""Is B's MLX-quantized tensor exactly A's tensor quantized with B's parameters?

MLX quantization is deterministic: ``mx.quantize`` of the same values, in the same dtype, with the same
group size, bits and mode gives the same packed codes, scales and (affine) biases. Export, like
``mlx_lm.convert``, casts a weight with MLX's ``astype`` to the dtype it quantizes in (affine scales are in
that dtype; see the MLX view for the other modes) and then quantizes it; groups lie within rows, so
quantizing rows in chunks, as export does and as this check does, gives the bits of the whole tensor. So
where A's tensor is B's source (the same name, or a split, fuse or expert slice, all exact), verify demands
B's bytes: ``check_requantized`` quantizes A's tensor as B says it was quantized and compares.

A difference is then located row by row: B's dequantized rows that differ against A's, with a cosine floor
per bits (``ROW_FLOORS``), naming the worst. A row shuffle or a swapped tensor shows as rows near cosine 0, a
small edit (one scale) as a row above its floor. Where the bits cannot be reproduced (A's dtype is one MLX
has no type for, so it goes through float32), the floor alone decides; it is a weaker test (two similar
embedding rows of a real model may be closer than a 2-bit floor), so the bits decide wherever they can.

Floors, from the worst row cosine of correct quantizations (``mx.quantize`` then ``mx.dequantize`` of bf16
rows of 64 and 512 values, 4,000 rows each, and of 4,096 values, 600 rows: Gaussian, Student-t with 2 and 3
degrees of freedom, 0.2% outliers x50, per-row offsets; affine groups 32, 64, 128), at 2-3 times the worst
1 - cosine:

    bits  measured worst row cosine                    floor
    2     0.731                                        0.4
    3     0.911                                        0.75
    4     0.967 affine, 0.962 mxfp4, 0.991 nvfp4       0.9
    5     0.989                                        0.97
    6     0.996                                        0.985
    8     0.9986 affine, 0.9990 mxfp8                  0.995

Rows taken from elsewhere (8 rows shuffled, gate for up) measure -0.3..0.1 on a tiny model: far below.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ffn_tools.io.dtypes import as_st, short_name

if TYPE_CHECKING:
    import torch

ROW_FLOORS = {2: 0.4, 3: 0.75, 4: 0.9, 5: 0.97, 6: 0.985, 8: 0.995}
CHUNK_ELEMENTS = 1 << 22  # A's values quantized per chunk of rows (as export streams them)


def row_floor(bits: int) -> float:
    """The row cosine floor of ``bits`` (the nearest row of ``ROW_FLOORS``, the coarser on a tie)."""
    return ROW_FLOORS[min(ROW_FLOORS, key=lambda b: (abs(b - bits), b))]


def check_requantized(name: str, a: "torch.Tensor", parts: tuple) -> tuple[str, str | None]:
    """Quantize A's tensor ``a`` with the parameters of B's stored ``parts`` and compare the bytes.

    Args:
        name: what to call the tensor in a sentence (B's name, with its role in an FFN).
        a: A's tensor, in B's stored arrangement (its shape before packing).
        parts: B's ``quantized_parts``: (packed weight, scales, biases or None, parameters).

    Returns:
        ("identical", None): B's codes, scales and biases are A's re-quantized, bit for bit;
        ("within", note): not reproducible bit for bit (A's dtype), every differing row above the floor;
        ("differs", sentence): naming the parameters, how many codes/scales/biases differ, and the worst of
        the rows that differ (B's dequantized row against A's).
    """
    import mlx.core as mx

    from .quant import MX_DTYPES

    w, s, b, q = parts
    gs, bits, mode = q["group_size"], q["bits"], q["mode"]
    how = f"{bits}-bit {mode} group {gs} in {short_name(q['dtype'])}"
    cols = a.shape[-1] if a.dim() else 1
    stored = [p.reshape(-1, p.shape[-1]) for p in (w, s, b) if p is not None]
    rows = a.numel() // cols if cols else 0
    if a.dim() < 1 or not cols or cols % gs or [p.shape[0] for p in stored] != [rows] * len(stored) \
            or stored[0].shape[1] * 32 != cols * bits or stored[1].shape[1] * gs != cols:
        return "differs", (f"{name}: B's packed {list(w.shape)} and scales {list(s.shape)} ({how}) do not fit "
                           f"A's {list(a.shape)}")
    exact = as_st(a.dtype) in MX_DTYPES
    dtype, step = MX_DTYPES[q["dtype"]], max(1, CHUNK_ELEMENTS // cols)
    chunks = [(r, min(rows, r + step)) for r in range(0, rows, step)]
    a2 = a.reshape(rows, cols)

    def mine(r0: int, r1: int) -> list:
        return list(mx.quantize(_to_mx(a2[r0:r1], exact).astype(dtype), gs, bits, mode=mode))

    if all(all(mx.array_equal(m, p[r0:r1]).item() for m, p in zip(mine(r0, r1), stored)) for r0, r1 in chunks):
        return "identical", None
    differ = [0, 0, 0]  # codes, scales, biases
    bad_rows, worst = 0, (math.inf, -1)
    for r0, r1 in chunks:
        got = [p[r0:r1] for p in stored]
        ours = mine(r0, r1)
        ne = [_codes(ours[0], bits, mode) != _codes(got[0], bits, mode)] + \
             [_bits(m) != _bits(g) for m, g in zip(ours[1:], got[1:])]
        for k, n in enumerate(ne):
            differ[k] += _count(n)
        bad = mx.any(mx.concatenate([n.reshape(r1 - r0, -1) for n in ne], 1), axis=1)
        bad_rows += _count(bad)
        w, s, *b = got
        cos = _row_cosines(_to_mx(a2[r0:r1], exact).astype(mx.float32),
                           mx.dequantize(w, s, b[0] if b else None, group_size=gs, bits=bits, mode=mode,
                                         dtype=mx.float32))
        cos = mx.where(bad, cos, math.inf)  # the rows that differ: the others are A's, re-quantized
        k = int(mx.argmin(cos))
        worst = min(worst, (float(cos[k]), r0 + k))
    floor = row_floor(bits)
    row = f"row {_index(worst[1], tuple(a.shape[:-1]))}: cosine {worst[0]:.4f}"
    count = ", ".join(f"{n} of {p.size if k else rows * cols} {what}" for k, (n, p, what) in
                      enumerate(zip(differ, stored, ("codes", "scales", "biases"))))
    if not exact:
        why = (f"A is {short_name(as_st(a.dtype))}, which MLX has no dtype for (read through float32), so the "
               f"bits are not reproducible and the {bits}-bit row floor {floor} decides")
        if worst[0] >= floor:
            return "within", f"{name}: not bit-identical to A re-quantized ({how}: {count} differ); {why}: worst {row}"
        return "differs", f"{name}: B is not A quantized ({how}): {count} differ; {why}: worst {row} < {floor}"
    verdict = (f"worst {row} < the {bits}-bit floor {floor}" if worst[0] < floor else
               f"{'it is' if bad_rows == 1 else 'each is'} above the {bits}-bit floor {floor} (worst {row}): a "
               "small edit, a source other than A (say a rounded copy of it), or a quantizer other than this MLX's")
    return "differs", (f"{name}: B is not A re-quantized with B's parameters ({how}): {count} differ, in "
                       f"{bad_rows} of {rows} rows; {verdict}")


def recast_difference(role: str, a: "torch.Tensor", b: "torch.Tensor") -> str | None:
    """None when B's unquantized ``b`` is A's ``a`` cast to B's dtype with MLX's ``astype`` (as export
    casts), bit for bit; else the first difference, or why the cast cannot be replayed."""
    from .quant import MX_DTYPES, from_mx, torch_to_mx

    from ffn_tools.checks.diagnose import first_difference

    sa, sb = as_st(a.dtype), as_st(b.dtype)
    if sa not in MX_DTYPES or sb not in MX_DTYPES:
        return f"{role}: A is {short_name(sa)}, B {short_name(sb)}: MLX cannot replay that cast"
    cast = from_mx(torch_to_mx(a).astype(MX_DTYPES[sb])).to_torch()
    diff = first_difference(role, cast, b)
    return f"{diff} (A cast to {short_name(sb)} with MLX's astype, as export casts)" if diff else None


def _index(k: int, lead: tuple[int, ...]) -> str:
    """Row ``k`` of a tensor whose leading dims are ``lead``: ``18``, or ``[1, 2]`` for (2, 16, cols)."""
    if len(lead) == 1:
        return str(k)
    out = []
    for d in reversed(lead):
        k, i = divmod(k, d)
        out.append(i)
    return str(out[::-1])


def _to_mx(t: "torch.Tensor", exact: bool):
    """``t`` as an mx array: its bytes where MLX has its dtype, else through float32."""
    from .quant import torch_to_mx

    return torch_to_mx(t if exact else t.float())


def _codes(wq, bits: int, mode: str):
    """The integer codes of packed ``wq`` (rows, packed): affine by ``mx.dequantize`` with unit scales and
    zero biases (3, 5, 6 bits straddle words); the float modes' 4 or 8 bits by shifts."""
    import mlx.core as mx

    if mode == "affine":
        n = wq.shape[1] * 32 // bits
        unit = mx.ones((wq.shape[0], n // 32), mx.float32)
        return mx.dequantize(wq, unit, mx.zeros_like(unit), group_size=32, bits=bits)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    return ((wq[..., None] >> shifts) & ((1 << bits) - 1)).reshape(wq.shape[0], -1)


def _bits(x):
    """``x``'s elements as unsigned integers of their size (so -0.0 differs from 0.0, nan from nan not)."""
    import mlx.core as mx

    return x.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[x.dtype.size])


def _row_cosines(a, b):
    """Cosine of each row of ``a`` with the same row of ``b`` (1 where both are zero, 0 where one is)."""
    import mlx.core as mx

    dot, na, nb = (mx.sum(x * y, axis=1) for x, y in ((a, b), (a, a), (b, b)))
    both = (na == 0) & (nb == 0)
    return mx.where(both, 1.0, dot / mx.maximum(mx.sqrt(na) * mx.sqrt(nb), 1e-30))


def _count(a) -> int:
    """How many elements of a boolean mx array are true."""
    import mlx.core as mx

    return int(mx.sum(a))
