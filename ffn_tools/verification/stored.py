"""Bytes compared as bytes: where B stores A's FFN bytes (FP8 blocks with their scales, any scheme's codes, scales
and zero points, or unquantized weights, copied or moved by split, fuse, extract or a rename), ``verify`` compares
the stored parts, byte for byte, and dequantizes nothing.

``role_parts`` reads one FFN's stored parts per canonical role (gate, up, down: ``{part: tensor}``) from the stored
tensors (``Checkpoint.stored``, as views of the files' mapped pages: ``io.mapped``, nothing copied): a role stored
on its own is its module's parts (one expert's slice of a stacked module), or the tensor itself where it is not
quantized; a fused gate_up is split with the FFN's layout, part by part, where the parts are rows of the weight's
(an unquantized weight; FP8's weight and its row blocks of scales, when the layout's gate/up runs fall on the
blocks: ``fp8.fits``); a pair stored fused alike on both sides is compared as stored. Anything else (transposed or
flattened experts, biases, one side quantized and the other not, a cast, a scheme whose parts do not split by rows,
a fused layout the scales do not follow) is not a ``candidate``, and the pair is checked as before.

Outside the FFNs, ``same_stored(ca, cb, name)`` does the same for one tensor both sides store quantized alike.

``same_bytes(ca, cb, read_a, read_b, x, y)`` is True (every part of every role: dtype, shape and bytes equal),
False (with a sentence naming the first difference) or None (not comparable as bytes; ``candidates`` says so before
anything is read); it also says whether B's parts are finite (``finite_part``: what a float64 run of the weights
could still show, a non-finite value, checked on the parts' bytes), and names a ``defect``: a role whose FP8 codes
are A's byte for byte while its scale's values differ. A re-quantization that changes a block's scale changes
that block's codes with it (the codes are the weight divided by the scale), so codes kept and a scale changed is
no rounding the tolerance row should absorb: the block, and its scale on both sides, are named."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from ..ffn import FFN
from ..io.mapped import Mapped
from ..layouts import split
from ..quant import fp8

if TYPE_CHECKING:
    import torch

WEIGHTS = ("gate", "up", "down")
PLAIN = "stored"  # the one part of a weight stored unquantized
ROW_SCHEMES = ("fp8",)  # schemes whose every part is rows of the weight (split with it by a fused layout)
# float8 bit patterns that are not finite, as the bits that are all ones in them and only in them: e4m3fn has only
# NaN (S.1111.111), e5m2 Inf and NaN (S.11111.xx)
NONFINITE_MASKS = {"float8_e4m3fn": 0x7F, "float8_e5m2": 0x7C}
CHUNK = 1 << 20  # bytes masked at a time (cache-sized: one pass over memory, not three)


def stored_name(f: FFN, role: str) -> str:
    return f.names["gate_up"] if role in ("gate", "up") and "gate_up" in f.names else f.names[role]


def comparable(c, f: FFN) -> bool:
    """Whether ``f``'s weights can be compared as stored bytes at all: per FFN or one expert of a stack, no biases,
    none stored (in, out)."""
    return not (f.has_bias or f.form.transposed or f.form.flat or any(f.form.turns(r) for r in WEIGHTS))


def _module_parts(c, read: Mapping, f: FFN, name: str) -> dict[str, "torch.Tensor"] | None:
    m = c.quantized(name)
    if m is None:  # stored unquantized: one part, the tensor
        t = read[name]
        return {PLAIN: t if f.index is None else t[f.index]}
    parts = {p: read[n] for p, n in m.parts.items()}
    if f.index is None:
        return parts
    if m.scheme.name in ROW_SCHEMES:  # weight (E, rows, cols) and scales (E, row blocks, col blocks)
        return {p: t[f.index] for p, t in parts.items()}
    return m.scheme.slice_parts(parts, f.index)


def role_parts(c, read: Mapping, f: FFN, split_fused: bool) -> dict[str, dict[str, "torch.Tensor"]] | None:
    """``f``'s stored parts per role (see the module docstring); ``split_fused``: split a fused gate_up into gate
    and up (else it is one role, "gate_up", as stored). None: not comparable as bytes."""
    out: dict[str, dict] = {}
    if "gate_up" in f.names:
        parts = _module_parts(c, read, f, f.names["gate_up"])
        if parts is None:
            return None
        if split_fused:
            m = c.quantized(f.names["gate_up"])
            w = parts.get("weight")
            if m is not None and (m.scheme.name not in ROW_SCHEMES or w is None or any(
                    not fp8.fits(f.layout, w.shape[0], t.shape[0]) for t in parts.values() if t.dim())):
                return None
            halves = {p: split(t, f.layout) for p, t in parts.items()}
            out["gate"] = {p: h[0] for p, h in halves.items()}
            out["up"] = {p: h[1] for p, h in halves.items()}
        else:
            out["gate_up"] = parts
    else:
        for r in ("gate", "up"):
            if (parts := _module_parts(c, read, f, f.names[r])) is None:
                return None
            out[r] = parts
    if (down := _module_parts(c, read, f, f.names["down"])) is None:
        return None
    out["down"] = down
    return out


def alike(ma, mb) -> bool:
    """Two quantized modules whose equal bytes mean equal values: one scheme, parts of the same roles (named: a
    view that does not name its modules' parts, MLX's, is compared its own way), the same parameters (bits, group,
    mode) and settings (FP8's scale suffix and block, compressed-tensors' arguments)."""
    return (bool(ma.parts) and ma.scheme.name == mb.scheme.name and sorted(ma.parts) == sorted(mb.parts)
            and ma.scheme.params(ma) == mb.scheme.params(mb) and ma.args == mb.args)


def candidates(ca, cb, x: FFN, y: FFN) -> bool:
    """Whether A's FFN ``x`` and B's ``y`` may be compared as stored bytes (before reading anything): both
    ``comparable``; each role stored alike (quantized modules ``alike``, or unquantized in one dtype); every part
    stored as plain bytes in a file (mapped)."""
    if not (comparable(ca, x) and comparable(cb, y)):
        return False
    stored: list[tuple] = []
    for r in WEIGHTS:
        na, nb = stored_name(x, r), stored_name(y, r)
        ma, mb = ca.quantized(na), cb.quantized(nb)
        if (ma is None) != (mb is None):
            return False
        if ma is None:
            if na not in ca.stored or nb not in cb.stored:
                return False  # presented under another name than stored (MLX, GGUF): read through the view
            if ca.stored.info(na).st_dtype != cb.stored.info(nb).st_dtype:
                return False  # a cast: compared by the tolerance row
            stored += [(ca, na), (cb, nb)]
        elif not alike(ma, mb):
            return False
        else:
            stored += [(ca, n) for n in ma.parts.values()] + [(cb, n) for n in mb.parts.values()]
    return all(n in c.stored and c.stored.info(n).start is not None for c, n in stored)  # (a view renames: no)


class Stored(NamedTuple):
    """What ``same_bytes`` found: ``same`` (True, False, or None: not comparable as bytes), ``why`` (the first
    difference), ``finite`` (B's parts, where ``same``), ``defect`` (a scale changed under A's codes)."""

    same: bool | None
    why: str | None = None
    finite: bool | None = None
    defect: str | None = None


def same_bytes(ca, cb, read_a: Mapping, read_b: Mapping, x: FFN, y: FFN) -> Stored:
    """Do A's FFN ``x`` and B's ``y`` store the same bytes, role by role (see the module docstring)? (True, None,
    whether B's parts are all finite), (False, the first difference, None, a scale changed under A's codes or None)
    or (None, ...) where they cannot be compared so. Part by part: each pair is compared, B's checked finite, and
    (where ``read_a``/``read_b`` are ``io.mapped.Mapped``) its pages released before the next, so one part pair is
    held at a time, not the FFN pair (a Llama-70B FFN is 1.4 GB a side in bf16, its largest part 470 MB)."""
    if not candidates(ca, cb, x, y):
        return Stored(None)
    same_form = ("gate_up" in x.names) == ("gate_up" in y.names) and (
        "gate_up" not in x.names or x.layout.same_arrangement(y.layout))
    pa, pb = role_parts(ca, read_a, x, not same_form), role_parts(cb, read_b, y, not same_form)
    if pa is None or pb is None:
        return Stored(None)
    if any(not parts for parts in (*pa.values(), *pb.values())):
        return Stored(None)  # a module whose parts its view does not name (MLX's): nothing to compare here
    if any(sorted(parts) != sorted(pb.get(role, {})) for role, parts in pa.items()):
        return Stored(None)  # laid out as different parts: not a copy's form
    finite, first = True, None
    for role, parts in pa.items():
        differ = []
        for p, a in parts.items():
            b = pb[role][p]
            name = y.names["gate_up"] if role == "gate_up" else stored_name(y, role)
            what = role if p == PLAIN else f"{role}'s {p}"
            if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
                differ.append(p)
                first = first or (f"{what} ({name}): A {str(a.dtype).removeprefix('torch.')}{list(a.shape)}, "
                                  f"B {str(b.dtype).removeprefix('torch.')}{list(b.shape)}")
            elif not _equal_bytes(a, b):
                differ.append(p)
                first = first or f"{what} ({name}) differs"
            else:
                finite = finite and finite_part(b)
            for read in (read_a, read_b):
                if hasattr(read, "release"):
                    read.release(done=False)  # the FFN's other parts are views of the same mappings, still due
        if differ and "weight" not in differ and (defect := scale_defect(cb, y, role, parts, pb[role], same_form)):
            return Stored(False, first, None, defect)
    return Stored(True, None, finite) if first is None else Stored(False, first)


def scale_defect(cb, y: FFN, role: str, a: dict, b: dict, same_form: bool) -> str | None:
    """Where ``role``'s FP8 codes are A's byte for byte (``a``, ``b``: its parts) but a scale's values differ: the
    sentence naming B's scale tensor, the first differing block (in B's tensor: a fused gate_up's row blocks as B
    stores them) and both values; None where every scale value is A's (rounded to B's dtype, where B stores its
    scales in another: a cast, which the tolerance row judges)."""
    m = cb.quantized(stored_name(y, role if role != "gate_up" else "gate"))
    if m is None or m.scheme.name not in ROW_SCHEMES or "weight" not in a:
        return None
    for p, sa in a.items():
        if p == "weight" or (found := scale_differs(sa, b[p])) is None:
            continue
        off, first, had, got = found
        if role in ("gate", "up") and "gate_up" in y.names and not same_form:  # B's own row block of it
            seg = next(sg for sg in y.layout.segments(2 * sa.shape[0]) if sg[0] == role and sg[2] <= first[0] < sg[2] + sg[3])
            first[0] = seg[1] + first[0] - seg[2]
        rb, cbk = m.args.block  # the checkpoint's own (its config's weight_block_size): 32 x 32 is not 25 x 25
        rows, cols = m.shape[-2:]  # a partial last block ends with the weight
        where = f"block {first}" + (f" (rows {first[0] * rb}-{min(first[0] * rb + rb, rows) - 1}" + (
            f", columns {first[1] * cbk}-{min(first[1] * cbk + cbk, cols) - 1})" if len(first) > 1 else ")"))
        expert = f" (expert {y.index})" if y.index is not None else ""
        n = int(off.sum())
        return (f"{role}: B's codes are A's byte for byte but its scale {m.parts.get(p, p)}{expert} is not A's at "
                f"{n} of {off.numel()} block{'s' * (off.numel() != 1)}, first {where}: A {had:.9g}, B {got:.9g}; a "
                "re-quantization that changes a scale changes its block's codes, so this is a defect, not rounding")
    return None


def scale_differs(sa: "torch.Tensor", sb: "torch.Tensor") -> tuple["torch.Tensor", list[int], float, float] | None:
    """Where scale part ``sb`` (B's) is not A's ``sa`` of the same shape: (which values differ, the first one's index,
    A's value there, B's); None where every value is A's (rounded to B's dtype, where B stores its scales in another:
    a cast, which the tolerance row judges) or the shapes differ."""
    import torch

    if tuple(sa.shape) != tuple(sb.shape):
        return None
    va, vb = sa.to(torch.float64), sb.to(torch.float64)
    if sa.dtype != sb.dtype and sb.dtype.is_floating_point:  # a scale stored in another dtype: A's, rounded
        va = sa.to(sb.dtype).to(torch.float64)
    off = ~((va == vb) | (va.isnan() & vb.isnan()))
    if not bool(off.any()):
        return None
    first = [int(i) for i in off.nonzero()[0]]
    return off, first, float(va[tuple(first)]), float(vb[tuple(first)])


def quantized_alike(ca, cb, name: str) -> bool:
    """Whether A and B both store ``name`` quantized under one scheme, in parts of the same roles (a tensor outside
    the FFNs ``same_stored`` can compare as bytes)."""
    ma, mb = ca.quantized(name), cb.quantized(name)
    return ma is not None and mb is not None and alike(ma, mb)


def same_stored(ca, cb, name: str) -> bool | None:
    """Do A and B store ``name`` (outside the FFNs) as the same quantized bytes, part by part? None where they do
    not store it ``quantized_alike``. The parts are compared as views of the files' pages (``io.mapped``), nothing
    is dequantized."""
    if not quantized_alike(ca, cb, name):
        return None
    ma, mb = ca.quantized(name), cb.quantized(name)
    ra, rb = Mapped(ca.stored), Mapped(cb.stored)
    try:
        for p, n in ma.parts.items():
            ia, ib = ra.ckpt.info(n), rb.ckpt.info(mb.parts[p])
            if ia.st_dtype != ib.st_dtype or tuple(ia.shape) != tuple(ib.shape):
                return False
        return all(_equal_bytes(ra[n], rb[mb.parts[p]]) for p, n in ma.parts.items())
    finally:
        for m in (ra, rb):
            m.release()
            m.close()


def scale_under_same_codes(ca, cb, name: str) -> str | None:
    """Outside the FFNs, ``scale_defect``'s rule for one tensor both sides store ``quantized_alike``: where its codes
    (the ``weight`` part) are A's byte for byte but a scale part's values are not, the sentence naming the part,
    how many values differ and the first; None otherwise (codes differ too: a re-quantization, judged by the
    tolerance row)."""
    if not quantized_alike(ca, cb, name):
        return None
    ma, mb = ca.quantized(name), cb.quantized(name)
    if ma.scheme.name not in ROW_SCHEMES or "weight" not in ma.parts:
        return None
    ra, rb = Mapped(ca.stored), Mapped(cb.stored)
    try:
        if not _equal_bytes(ra[ma.parts["weight"]], rb[mb.parts["weight"]]):
            return None
        for p, n in ma.parts.items():
            if p == "weight" or (found := scale_differs(ra[n], rb[mb.parts[p]])) is None:
                continue
            off, first, had, got = found
            return (f"{name}: B's codes are A's byte for byte but its scale {mb.parts[p]} is not A's at "
                    f"{int(off.sum())} of {off.numel()} values, first {first}: A {had:.9g}, B {got:.9g}; a "
                    "re-quantization that changes a scale changes its codes, so this is a defect, not rounding")
        return None
    finally:
        for m in (ra, rb):
            m.release()
            m.close()


def _memcmp():
    """libc's ``memcmp`` (ctypes releases the GIL around it), or None where there is no C library to call."""
    import ctypes

    try:
        f = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return f


MEMCMP = _memcmp()


def _equal_bytes(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    """Byte equality: ``memcmp`` on the two contiguous buffers (3x ``torch.equal``'s speed on 44 MB, and nothing
    allocated: ``torch.equal`` left ~4 MB of the heap behind per FFN compared), else ``torch.equal``."""
    import torch

    a, b = _as_bytes(a), _as_bytes(b)
    if a.numel() != b.numel():
        return False
    if a.numel() == 0:
        return True
    if MEMCMP is not None:
        return MEMCMP(a.data_ptr(), b.data_ptr(), a.numel()) == 0
    return torch.equal(a, b)


def _as_bytes(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def finite_part(t: "torch.Tensor") -> bool:
    """No value of a stored part is non-finite: float8 codes by their bit patterns (one pass over the bytes, in
    cache-sized chunks), other floating parts (weights, scales) by their min and max; integer codes always are."""
    from .functional import all_finite

    mask = NONFINITE_MASKS.get(str(t.dtype).removeprefix("torch."))
    if mask is not None:
        return not _has_pattern(_as_bytes(t), mask)
    return not t.dtype.is_floating_point or all_finite([t])


def _has_pattern(b: "torch.Tensor", mask: int) -> bool:
    """Whether any byte of ``b`` has every bit of ``mask`` set: the largest ``byte & mask`` is ``mask``."""
    import torch

    buf = torch.empty(min(CHUNK, b.numel()), dtype=torch.uint8)
    for start in range(0, b.numel(), CHUNK):
        chunk = b[start:start + CHUNK]
        out = buf[:chunk.numel()]
        torch.bitwise_and(chunk, mask, out=out)
        if int(out.max()) == mask:
            return True
    return False
