"""The FFN pairs of ``verify`` as steps: each pair's checks (``pairs.PairChecker``) in order, routed experts in
batches (``experts``), the first FFN of each kind alone (the kernel backends run it afterwards); each pair's
tolerance row; what a step reads ahead (``stream``). ``pairrun`` runs them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..ffn import FFN
from ..io.dtypes import short_name
from ..tolerances import tolerance_for
from .expected import AsLoaded  # noqa: F401  (where it was: A's tensors as B's client computes them)
from .experts import BATCH_BYTES, batch_key, pair_bytes
from .functional import KERNEL_DTYPES
from .pairs import PairChecker
from .quant import ffn_bits, quantization
from .report import VerifyReport

log = logging.getLogger(__name__)
PAGED_PAIR_BYTES = 1 << 30  # a pair above this (A's FFN + B's) is read from mapped pages by parts, not held whole


def _kernel_kind(cb, y: FFN, bits) -> tuple:
    """What a kernel backend can get wrong for B's FFN ``y``: its shape, form, fused layout, dtype and
    quantization. Every FFN runs on the float64 reference (that is what proves the weights); the other
    backends prove the kernels, on the first FFN of each kind (all with --all-ffns-on-every-backend)."""
    return (y.d_model, y.d_ffn, y.form_name, y.layout.describe() if y.form.fused else None,
            cb.info(y.names["down"]).st_dtype, bits, any(n.endswith("_bias") for n in y.names))


class Step(NamedTuple):
    """One unit of the weight checks: a pair, or a batch of routed experts (``batched``). ``on_all``: the first
    FFN of its kind (or --all-ffns-on-every-backend): its float64 reference is computed even where B is A's
    bit for bit, and the kernel backends run it afterwards."""

    items: list
    on_all: bool
    batched: bool = False


def plan_steps(checker: PairChecker, pairs: list, bits: dict, rows: dict, every_backend: bool) -> list[Step]:
    """The pairs as steps, in order: the first FFN of each kind (``_kernel_kind``) alone on every backend; the
    other routed experts of a layer in batches (``experts.batch_key``, at most ``BATCH_BYTES`` each); the rest
    one by one on the reference."""
    steps: list[Step] = []
    batch: list = []
    key, size = None, 0
    kernel_runs: set[tuple] = set()

    def flush() -> None:
        if batch:
            steps.append(Step(list(batch), False, batched=len(batch) > 1))
            batch.clear()

    for ref, x, y in pairs:
        kind = _kernel_kind(checker.cb, y, bits[ref])
        if every_backend or kind not in kernel_runs:
            kernel_runs.add(kind)
            flush()
            steps.append(Step([(ref, x, y)], True))
            continue
        bk = batch_key(checker, x, y, any(q is not None for q in bits[ref]))
        if bk is None:
            flush()
            steps.append(Step([(ref, x, y)], False))
            continue
        pb = pair_bytes(checker, x, y)
        if (bk, rows[ref]) != key or size + pb > BATCH_BYTES:
            flush()
            key, size = (bk, rows[ref]), 0
        batch.append((ref, x, y))
        size += pb
    flush()
    return steps


def _as_stored(c, name: str) -> bool:
    """Whether checkpoint ``c`` presents ``name`` as its safetensors file stores it: the same name, dtype and shape,
    unquantized floating point, at a known place in the file (``io.mapped`` can view it)."""
    if name not in c.stored or c.quantized(name) is not None:
        return False
    info, kept = c.info(name), c.stored.info(name)
    return (kept.start is not None and Path(kept.file).suffix == ".safetensors" and kept.dtype.is_floating_point
            and (info.dtype, tuple(info.shape)) == (kept.dtype, tuple(kept.shape)))


def _reads(items: list, computed=(), unstreamed=None) -> list[tuple[int, str]]:
    """The (side, name) of every tensor a step's pairs read, A's first, in the order they read them; not A's
    ``computed`` (``Pairing.computed``: read as B's client computes them, not as stored), nor those of a pair
    ``unstreamed(x, y)`` says is read from the files' mapped pages (``io.mapped``): compared as stored bytes
    (dequantized, it is read only if its bytes differ, or to run it on a backend), or too large to hold whole."""
    streamed = [(x, y) for _, x, y in items if unstreamed is None or not unstreamed(x, y)]
    keys = [(0, n) for x, _ in streamed for n in x.names.values() if n not in computed]
    keys += [(1, n) for _, y in streamed for n in y.names.values()]
    return list(dict.fromkeys(keys))


@dataclass(frozen=True)
class PairOptions:
    """What the FFN pairs' checks were asked (``engine.verify`` documents each): ``on_reference``, the float64
    reference is one of the backends asked for; ``every_backend``, --all-ffns-on-every-backend."""

    on_reference: bool
    sel_layers: Any
    sel_experts: Any
    atol: float | None
    rtol: float | None
    exact: bool | None
    seed: int
    tokens: int
    every_backend: bool
    ray: Any = None  # --ray's connection (``cluster.Link``), or None: every step here
    ledger: tuple[str, bool] | None = None  # the steps' ledger: (this verify's key, --resume asked), or None

    @classmethod
    def of(cls, o, selection: tuple, on_reference: bool) -> "PairOptions":
        """From verify's options ``o`` (``VerifyOptions``) and the selection it settled on."""
        layers, experts = selection
        return cls(on_reference, layers, experts, o.atol, o.rtol, o.exact, o.seed, o.tokens,
                   o.all_ffns_on_every_backend, o.ray, o.ledger)


def coarsest(qa, qb):
    """The fewer bits of a pair's two sides (None: neither quantized)."""
    return min((q for q in (qa, qb) if q is not None), default=None)


def _rows(report: VerifyReport, ca, cb, pairs: list, opts: PairOptions) -> tuple[dict, dict]:
    """Each pair's quantization bits (per FFN: mixed recipes) and tolerance row; the loosest row into the report."""
    ga, gb = ((q or {}).get("bits") for q in (quantization(ca), quantization(cb)))
    bits = {r: (ffn_bits(ca, x, ga), ffn_bits(cb, y, gb)) for r, x, y in pairs}
    dtypes = {ca.info(x.names["down"]).dtype for _, x, _ in pairs} | {cb.info(y.names["down"]).dtype for *_, y in pairs}
    odd = sorted(short_name(d) for d in dtypes if d not in KERNEL_DTYPES)
    if odd:
        report.notes.append(f"{', '.join(odd)} weights run as float32 (the kernels take float32, float16, bfloat16)")
    rows = {r: tolerance_for(dtypes, coarsest(*bits[r]), atol=opts.atol, rtol=opts.rtol) for r, *_ in pairs}
    every = [q for pair in bits.values() for q in pair if q is not None]
    report.tolerance = tolerance_for(dtypes, min(every, default=None), atol=opts.atol, rtol=opts.rtol)  # the loosest
    if len({t.row for t in rows.values()}) > 1:
        report.notes.append("quantization differs between FFNs (a mixed recipe): each FFN has the row of its own "
                            "coarsest bits")
    return bits, rows
