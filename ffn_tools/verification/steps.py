"""The FFN pairs of ``verify`` as steps: each pair's checks (``pairs.PairChecker``) in order, the weights read
ahead (``stream``), routed experts in batches (``experts``), and the kernel backends run afterwards on the first
FFN of each kind."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

from .. import cluster, progress
from ..clients import Pairing
from ..detect import FFNSet
from ..errors import FFNToolsError
from ..ffn import ACTIVATIONS, FFN
from ..io.dtypes import short_name
from ..tolerances import tolerance_for
from . import distributed, ledger
from .experts import BATCH_BYTES, batch_key, check_batch, pair_bytes
from .functional import KERNEL_DTYPES, NOT_COMPUTED, reference_backend
from .pairs import PairChecker
from .quant import ffn_bits, quantization
from .report import VerifyReport
from .sides import check_selection, select
from ..io.mapped import Mapped
from .stored import candidates
from .stream import TensorStream

log = logging.getLogger(__name__)
PAGED_PAIR_BYTES = 1 << 30  # a pair above this (A's FFN + B's) is read from mapped pages by parts, not held whole


class AsLoaded(Mapping):
    """A's tensors read through ``through`` (its checkpoint, or the read-ahead stream), except ``computed``
    (``Pairing.computed``): those as B's client computes them (``pairing.read``)."""

    def __init__(self, through: Mapping, pairing: Pairing, computed: set[str]):
        self.through, self.pairing, self.computed = through, pairing, computed

    def __getitem__(self, name: str):
        return self.pairing.read(name) if name in self.computed else self.through[name]

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.through

    def __iter__(self):
        return iter(self.through)

    def __len__(self) -> int:
        return len(self.through)


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


def _nothing() -> None:
    pass


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


def check_pairs(report: VerifyReport, ca, cb, fa: FFNSet, fb: FFNSet, kernels: Future, on_reference: bool, sel_layers,
                sel_experts, atol, rtol, exact, seed, tokens, pairing: Pairing | None, later: ExitStack,
                every_backend: bool = False) -> Callable[[], None]:
    """Every FFN pair's checks (``PairChecker``), the weights streamed (``TensorStream``); ``on_reference``: the
    reference is one of the backends asked for; ``pairing``: A as B's client loads it (``Client.pairing``).
    Returns what runs the kernel backends (``kernels``: the future resolving them) on the first FFN of each
    kind, which ``verify`` calls after the outside comparison."""
    for f, side in ((fa, "A"), (fb, "B")):
        if f.activation.unit == "unknown":
            raise FFNToolsError(f"activation {f.activation.config_name!r} ({side}) is not one the kernels have "
                                f"({', '.join(dict.fromkeys(k for _, k in ACTIVATIONS.values()))}); verify cannot run it")
    if (fa.activation.kernel, fa.activation.unit) != (fb.activation.kernel, fb.activation.unit):
        report.problems.append(f"activation differs: A {fa.activation.describe()}, B {fb.activation.describe()}")
    check_selection(fa, fb, sel_layers, sel_experts)
    ra, rb = select(fa, sel_layers, sel_experts), select(fb, sel_layers, sel_experts)
    if not ra and not rb:
        raise FFNToolsError(f"--layers/--experts selects no FFN (A has layers {fa.ffns[0].ref.layer}-"
                            f"{fa.ffns[-1].ref.layer}, B {fb.ffns[0].ref.layer}-{fb.ffns[-1].ref.layer})")
    report.only_a = [str(r) for r in sorted(set(ra) - set(rb))]
    report.only_b = [str(r) for r in sorted(set(rb) - set(ra))]
    pairs = [(r, ra[r], rb[r]) for r in sorted(set(ra) & set(rb))]
    if not pairs:
        report.problems.append(f"A and B have no FFN in common (A: {len(ra)} FFNs under scheme {fa.scheme.name}, "
                               f"B: {len(rb)} under {fb.scheme.name}): different models?")
        return _nothing
    ga, gb = ((q or {}).get("bits") for q in (quantization(ca), quantization(cb)))
    bits = {r: (ffn_bits(ca, x, ga), ffn_bits(cb, y, gb)) for r, x, y in pairs}  # per FFN: mixed recipes
    dtypes = {ca.info(x.names["down"]).dtype for _, x, _ in pairs} | {cb.info(y.names["down"]).dtype for *_, y in pairs}
    odd = sorted(short_name(d) for d in dtypes if d not in KERNEL_DTYPES)
    if odd:
        report.notes.append(f"{', '.join(odd)} weights run as float32 (the kernels take float32, float16, bfloat16)")

    def coarsest(qa, qb):
        return min((q for q in (qa, qb) if q is not None), default=None)

    rows = {r: tolerance_for(dtypes, coarsest(*bits[r]), atol=atol, rtol=rtol) for r, *_ in pairs}
    every = [q for pair in bits.values() for q in pair if q is not None]
    tol = report.tolerance = tolerance_for(dtypes, min(every, default=None), atol=atol, rtol=rtol)  # the loosest
    if len({t.row for t in rows.values()}) > 1:
        report.notes.append("quantization differs between FFNs (a mixed recipe): each FFN has the row of its own "
                            "coarsest bits")
    reference = {"reference": reference_backend()} if on_reference else {}
    checker = PairChecker(ca, cb, fa, fb, reference, exact, seed, tokens)
    names = [n for _, x, _ in pairs for n in x.names.values()]
    computed = pairing.computed(names) if pairing is not None else set()
    loads = pairing if computed else None  # A's FFN tensors B's client computes: read so

    def as_loaded(through: Mapping) -> Mapping:
        return AsLoaded(through, loads, computed) if loads is not None else through

    checker.read_a = as_loaded(ca)
    if loads is not None:
        report.notes.append(loads.describe(sorted(computed)))
    log.info("verifying %d FFN pairs, %d tokens, tolerance %s", len(pairs), tokens, tol.describe())

    def nbytes(x, y):
        return x.d_model * x.d_ffn * 3 * (ca.info(x.names["down"]).nbytes // (x.d_model * x.d_ffn)
                                          + cb.info(y.names["down"]).nbytes // (y.d_model * y.d_ffn))

    def as_bytes(x: FFN, y: FFN) -> bool:
        """A pair compared as stored bytes first (``stored``: from the files' mapped pages, not the stream)."""
        return bool(exact is not False and not any(n in computed for n in x.names.values())
                    and candidates(ca, cb, x, y))

    checker.as_bytes = as_bytes

    def from_pages(x: FFN, y: FFN) -> bool:
        """A pair larger than ``PAGED_PAIR_BYTES`` whose tensors all lie as plain bytes in safetensors files, under
        the names and in the dtypes and shapes the checkpoint presents them (no view renames, casts or computes
        them): read as views of the files' mapped pages, a role or a block of rows at a time, not both FFNs whole."""
        if nbytes(x, y) <= PAGED_PAIR_BYTES:
            return False
        return all(_as_stored(c, n) and n not in computed for c, f in ((ca, x), (cb, y)) for n in f.names.values())

    checker.from_pages = from_pages

    def unstreamed(x: FFN, y: FFN) -> bool:
        return as_bytes(x, y) or from_pages(x, y)

    steps = plan_steps(checker, pairs, bits, rows, every_backend)
    ran: dict = {}  # the first FFN of each kind: its inputs and A's float64 output, for the kernel backends
    done: dict[int, list] = {}  # step -> its results
    mine = list(range(len(steps)))  # the steps this process runs
    job = cluster.task("steps")
    if job is not None:  # a --ray task (verification.distributed): its range of the driver's steps
        if job["count"] != len(steps):
            raise FFNToolsError(f"--ray: this node plans {len(steps)} verify steps, the driver {job['count']}: the "
                                "nodes must run the same ffn-tools and libraries on the same checkpoints")
        mine = job["indices"]
    bar = progress.Progress(sum(nbytes(x, y) for _, x, y in pairs), "verifying FFNs")
    book = None  # the steps' ledger (``--resume``): the driver's, or a one-process run's
    if job is None and (run := ledger.RUN.get()) is not None:
        book = ledger.StepLedger(run, [f"{s.on_all}:{s.batched}:" + ",".join(str(r) for r, _, _ in s.items)
                                       for s in steps])
        for k, s in enumerate(steps):  # the first FFN of each kind runs again: the kernel backends run what it computed
            if not s.on_all and (results := book.done(k)) is not None:
                done[k] = results
                bar.update(sum(nbytes(x, y) for _, x, y in s.items))
        mine = [k for k in mine if k not in done]
        if book.reused:
            progress.say(f"verify --resume: {book.reused} of {len(steps)} FFN steps a killed run had finished, reused")
    mapped = Mapped(ca.stored), Mapped(cb.stored)
    # The ledger and, under --ray, the connection to Ray are held until the tasks' results are in (``finish``,
    # which verify calls after the outside comparison: the driver compares those tensors while the tasks run);
    # ``later``, verify's own stack, lets go of them where verify fails before.
    held = later.enter_context(ExitStack())
    ray, parts, pending = None, [], {}  # type: Any, list[list[int]], dict
    if book is not None:
        held.push(book.leave)  # removed at the end, kept for --resume where an interruption ended it
    if job is None and cluster.ADDRESS.get() is not None:  # --ray: the driver keeps the first FFN of each kind
        ray = held.enter_context(cluster.connected())
        away = [k for k, s in enumerate(steps) if not s.on_all and k not in done]
        work = sum(nbytes(x, y) * (1 if as_bytes(x, y) else distributed.COMPUTED) for k in away
                   for _, x, y in steps[k].items)
        pending, parts = distributed.start(ray, ca, cb, steps, away, work)
        mine = [k for k, s in enumerate(steps) if s.on_all]
    try:
        with TensorStream((ca, cb), [_reads(steps[k].items, computed, None if steps[k].batched else unstreamed)
                                     for k in mine]) as stream:  # a batch: its own equality per role
            checker.read_a, checker.read_b = stream.side(0), stream.side(1)
            checker.raw_a, checker.raw_b = mapped
            checker.read_a = as_loaded(checker.read_a)
            for j, k in enumerate(mine):
                step = steps[k]
                if step.batched:
                    results = check_batch(checker, step.items, rows[step.items[0][0]], reference)
                else:
                    ref, x, y = step.items[0]
                    results = [checker.check(ref, x, y, rows[ref], coarsest(*bits[ref]) is not None, reference,
                                             compute_identical=step.on_all, ran=ran if step.on_all else None)]
                for (ref, x, y), res in zip(step.items, results):
                    res.bits_a, res.bits_b = bits[ref]
                    bar.update(nbytes(x, y))
                done[k] = results
                if book is not None and not step.on_all:
                    book.finished(k, results)
                stream.done(j)
                for m in mapped:
                    m.release()
    finally:
        checker.read_a, checker.read_b = as_loaded(ca), cb
        checker.raw_a, checker.raw_b = ca.stored, cb.stored
        for m in mapped:
            m.close()
    if job is not None:
        bar.close()
        held.close()
        raise cluster.Done(done)
    at = len(report.notes), len(report.problems)  # where what is said of the results goes, whenever it is said

    def finish() -> None:
        """The tasks' ranges as they finish (--ray), then every FFN's results in step order, and what is said of
        them, in the report where a one-process run says it."""
        with held:
            for c, value in cluster.results(ray, pending, lambda c: f"verifying steps {parts[c][0]}-{parts[c][-1]}"):
                done.update(value)  # {step: [FFNResult]}, from the task
                bar.update(sum(nbytes(x, y) for k in parts[c] for _, x, y in steps[k].items))
                for k in parts[c]:
                    if book is not None:
                        book.finished(k, value[k])
            bar.close()
        report.results += [res for k in range(len(steps)) for res in done[k]]
        later_notes, later_problems = report.notes[at[0]:], report.problems[at[1]:]
        del report.notes[at[0]:], report.problems[at[1]:]
        skipped = sum(any(b.path == NOT_COMPUTED for b in r.backends) for r in report.results)
        if skipped:
            report.notes.append(
                f"{skipped} of {len(pairs)} FFNs are bit-identical to A's, finite, and on no kernel backend: their "
                "float64 reference was not computed (the same bits through the same computation give A's output, so "
                "it could only agree); their weights were checked finite instead, the one thing that run could add "
                "(--all-ffns-on-every-backend computes it)")
        quantized = [r for r in report.results if coarsest(*bits[r.ref]) is not None]
        if quantized:
            sides = " and ".join(s for s, i in (("A", 0), ("B", 1)) if any(bits[r][i] is not None for r in bits))
            which = "" if len(quantized) == len(pairs) else f" ({len(quantized)} of {len(pairs)} FFNs)"
            requantized = sum(r.exact == "requantized" for r in quantized)
            codes = sum(r.exact == "codes" for r in quantized)
            same = sum(r.exact == "identical" for r in quantized)
            report.notes.append(f"{sides} quantized{which}: " + (
                f"{requantized} FFNs are A's weights re-quantized with B's parameters, bit for bit; run dequantized"
                if requantized else f"{codes} FFNs hold the other side's stored codes, their values exactly; run "
                "dequantized" if codes else f"{same} FFNs store A's quantized parts (codes and scales) byte for byte: "
                "compared as stored bytes, dequantized only to run the first FFN of each kind"
                + (f"; the other {len(quantized) - same} compared after dequantization"
                   if same < len(quantized) else "")
                if same else "weights compared after dequantization; no bit-exact check"))
        differing = [r.ref for r in report.results if r.exact == "differs"]
        if differing:
            checker.name_owners(report, differing, rb)
        report.notes += later_notes
        report.problems += later_problems

    if not pending:
        finish()

    def run_kernels() -> None:
        """The first FFN of each kind on the kernel backends, read again: run last, their frameworks imported
        meanwhile, and with nothing else held (they copy the weights they run)."""
        if pending:
            finish()
        mods, _ = kernels.result()
        others = {n: m for n, m in mods.items() if n != "reference"}
        by_ref = {r.ref: r for r in report.results}
        for ref, x, y in pairs:
            if others and ref in ran:
                checker.run_kernels(by_ref[ref], x, y, rows[ref], ran[ref], others)

    return run_kernels
