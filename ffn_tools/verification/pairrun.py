"""The FFN pairs of ``verify`` run: paired (``check_pairs``), planned as steps (``steps``), run here with the
weights read ahead (or, under --ray, the driver's part here and the rest as Ray tasks; under --resume those a killed
run finished reused), then every result and what is said of them into the report, and the kernel backends last
(``PairRun.run_kernels``)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any

from .. import cluster, progress
from ..detect import FFNSet
from ..errors import FFNToolsError
from ..ffn import ACTIVATIONS, FFN
from ..io.mapped import Mapped
from . import distributed, ledger, steps as planned
from .expected import Expected
from .experts import check_batch
from .functional import NOT_COMPUTED, reference_backend
from .pairs import PairChecker
from .report import VerifyReport
from .sides import check_selection, select
from .steps import PairOptions, Step, _as_stored, _reads, _rows, coarsest, plan_steps
from .stored import candidates
from .stream import TensorStream

log = logging.getLogger(__name__)


def check_pairs(report: VerifyReport, sides: tuple, ffns: tuple[FFNSet, FFNSet], kernels: Future,
                expected: Expected, later: ExitStack, opts: PairOptions) -> "PairRun | NoPairs":
    """Every FFN pair's checks (``PairChecker``), the weights streamed (``TensorStream``); ``expected``: B as
    derived from A through B's client (A's FFN tensors as it computes them, ``Expected.a_as_loaded``); ``later``: verify's stack, which lets go of what the run holds where
    verify fails before it ends. Returns the run, whose ``run_kernels`` (``kernels``: the future resolving them)
    ``verify`` calls after the outside comparison."""
    pairs, rb = _paired(report, ffns, opts)
    if not pairs:
        return NoPairs()
    run = PairRun(report, sides, ffns, pairs, rb, kernels, expected, opts)
    run.start(later)
    return run


def _paired(report: VerifyReport, ffns: tuple[FFNSet, FFNSet], opts: PairOptions) -> tuple[list, dict]:
    """The selected FFNs of both sides paired by ``FFNRef`` (those of one side only into the report), and B's
    selected FFNs by ref."""
    fa, fb = ffns
    for f, side in ((fa, "A"), (fb, "B")):
        if f.activation.unit == "unknown":
            raise FFNToolsError(f"activation {f.activation.config_name!r} ({side}) is not one the kernels have "
                                f"({', '.join(dict.fromkeys(k for _, k in ACTIVATIONS.values()))}); verify cannot run it")
    if (fa.activation.kernel, fa.activation.unit) != (fb.activation.kernel, fb.activation.unit):
        report.problems.append(f"activation differs: A {fa.activation.describe()}, B {fb.activation.describe()}")
    check_selection(fa, fb, opts.sel_layers, opts.sel_experts)
    ra, rb = select(fa, opts.sel_layers, opts.sel_experts), select(fb, opts.sel_layers, opts.sel_experts)
    if not ra and not rb:
        raise FFNToolsError(f"--layers/--experts selects no FFN (A has layers {fa.ffns[0].ref.layer}-"
                            f"{fa.ffns[-1].ref.layer}, B {fb.ffns[0].ref.layer}-{fb.ffns[-1].ref.layer})")
    report.only_a = [str(r) for r in sorted(set(ra) - set(rb))]
    report.only_b = [str(r) for r in sorted(set(rb) - set(ra))]
    pairs = [(r, ra[r], rb[r]) for r in sorted(set(ra) & set(rb))]
    if not pairs:
        report.problems.append(f"A and B have no FFN in common (A: {len(ra)} FFNs under scheme {fa.scheme.name}, "
                               f"B: {len(rb)} under {fb.scheme.name}): different models?")
    return pairs, rb


class NoPairs:
    """No FFN in common: nothing to run on the kernel backends."""

    def run_kernels(self) -> None:
        pass


class PairRun:
    """The FFN pairs' checks as they run (``check_pairs``): planned as steps, run here (or, under --ray, the
    driver's part here and the rest as tasks), their results and what is said of them into the report."""

    def __init__(self, report: VerifyReport, sides: tuple, ffns: tuple[FFNSet, FFNSet], pairs: list, rb: dict,
                 kernels: Future, expected: Expected, opts: PairOptions):
        self.report, (self.ca, self.cb), self.pairs, self.rb, self.kernels = report, sides, pairs, rb, kernels
        self.bits, self.rows = _rows(report, self.ca, self.cb, pairs, opts)
        self.exact, self.opts = opts.exact, opts
        self.reference = {"reference": reference_backend()} if opts.on_reference else {}
        names = [n for _, x, _ in pairs for n in x.names.values()]
        self.computed, view, note = expected.a_as_loaded(names)  # A's FFN tensors B's client computes: read so
        if note is not None:
            report.notes.append(note)
        self.checker = PairChecker(self.ca, self.cb, *ffns, self.reference, opts.exact, opts.seed, opts.tokens,
                                   bytes_first=self.as_bytes, from_pages=self.from_pages, a_view=view)
        log.info("verifying %d FFN pairs, %d tokens, tolerance %s", len(pairs), opts.tokens,
                 report.tolerance.describe() if report.tolerance else "")
        self.steps = plan_steps(self.checker, pairs, self.bits, self.rows, opts.every_backend)
        self.ran: dict = {}  # the first FFN of each kind: its inputs and A's float64 output, for the kernel backends
        self.done: dict[int, list] = {}  # step -> its results
        self.book: ledger.StepLedger | None = None  # the steps' ledger (``--resume``)
        self.ray: Any = None
        self.pending: dict = {}
        self.parts: list[list[int]] = []
        self.bar = progress.Progress(sum(self.nbytes(x, y) for _, x, y in pairs), "verifying FFNs")

    def nbytes(self, x: FFN, y: FFN) -> int:
        """The bytes of a pair's weights, A's and B's (what the progress bar counts)."""
        ca, cb = self.ca, self.cb
        return x.d_model * x.d_ffn * 3 * (ca.info(x.names["down"]).nbytes // (x.d_model * x.d_ffn)
                                          + cb.info(y.names["down"]).nbytes // (y.d_model * y.d_ffn))

    def as_bytes(self, x: FFN, y: FFN) -> bool:
        """A pair compared as stored bytes first (``stored``: from the files' mapped pages, not the stream)."""
        return bool(self.exact is not False and not any(n in self.computed for n in x.names.values())
                    and candidates(self.ca, self.cb, x, y))

    def from_pages(self, x: FFN, y: FFN) -> bool:
        """A pair larger than ``PAGED_PAIR_BYTES`` whose tensors all lie as plain bytes in safetensors files, under
        the names and in the dtypes and shapes the checkpoint presents them (no view renames, casts or computes
        them): read as views of the files' mapped pages, a role or a block of rows at a time, not both FFNs whole."""
        if self.nbytes(x, y) <= planned.PAGED_PAIR_BYTES:  # (read here: a test sets it)
            return False
        return all(_as_stored(c, n) and n not in self.computed
                   for c, f in ((self.ca, x), (self.cb, y)) for n in f.names.values())

    def unstreamed(self, x: FFN, y: FFN) -> bool:
        return self.as_bytes(x, y) or self.from_pages(x, y)

    def start(self, later: ExitStack) -> None:
        """Run this process's steps (all but those a killed run finished, or under --ray the driver's), then, unless
        Ray tasks still run the others, ``finish``. What is held until the tasks' results are in (the ledger, the
        connection to Ray) is held on ``later``, verify's own stack, which lets go of it where verify fails before."""
        mine = list(range(len(self.steps)))  # the steps this process runs
        if self.opts.ledger is not None:
            mine = self._resume(self.opts.ledger, mine)
        self.held = later.enter_context(ExitStack())
        if self.book is not None:
            self.held.push(self.book.leave)  # removed at the end, kept for --resume where an interruption ended it
        if self.opts.ray is not None:
            mine = self._send_away()
        self._run(mine)
        self.at = len(self.report.notes), len(self.report.problems)  # where what is said of the results goes
        if not self.pending:
            self.finish()

    def _resume(self, run, mine: list[int]) -> list[int]:
        """The ledger of this run's steps (``--resume``): the steps a killed run finished reused; the rest."""
        steps = self.steps
        book = self.book = ledger.StepLedger(run, [f"{s.on_all}:{s.batched}:" + ",".join(str(r) for r, _, _ in s.items)
                                                   for s in steps])
        for k, s in enumerate(steps):  # the first FFN of each kind runs again: the kernel backends run what it computed
            if not s.on_all and (results := book.done(k)) is not None:
                self.done[k] = results
                self.bar.update(sum(self.nbytes(x, y) for _, x, y in s.items))
        if book.reused:
            progress.say(f"verify --resume: {book.reused} of {len(steps)} FFN steps a killed run had finished, reused")
        return [k for k in mine if k not in self.done]

    def _send_away(self) -> list[int]:
        """--ray: the steps but the first FFN of each kind started as Ray tasks; the driver's steps."""
        steps = self.steps
        self.ray = self.held.enter_context(cluster.connected(self.opts.ray))
        away = [k for k, s in enumerate(steps) if not s.on_all and k not in self.done]
        work = sum(self.nbytes(x, y) * (1 if self.as_bytes(x, y) else distributed.COMPUTED) for k in away
                   for _, x, y in steps[k].items)
        self.pending, self.parts = distributed.start(self.ray, self, away, work)
        return [k for k, s in enumerate(steps) if s.on_all]

    def __getstate__(self) -> dict:
        """What a --ray task runs its range of steps with (``in_task``): the checks, the planned steps and both
        sides (each checkpoint pickled as how to open it again), not what this process holds while they run (the
        report, the kernels' future, the progress bar, the ledger, Ray, the results so far)."""
        state = dict(self.__dict__)
        for held in ("report", "kernels", "bar", "held", "ray", "pending", "parts", "book", "at"):
            state.pop(held, None)
        return {**state, "done": {}, "ran": {}, "opts": None}

    def in_task(self, indices: list[int]) -> dict[int, list]:
        """In a --ray task (``distributed``): the steps ``indices`` of the driver's plan run here; {step: results}."""
        self.bar, self.book = progress.Progress(0, "verifying FFNs"), None
        try:
            self._run(indices)
        finally:
            self.bar.close()
        return self.done

    def _run(self, mine: list[int]) -> None:
        """The steps ``mine``, their tensors read ahead (a batch: its own equality per role)."""
        checker, steps, mapped = self.checker, self.steps, (Mapped(self.ca.stored), Mapped(self.cb.stored))
        reads = [_reads(steps[k].items, self.computed, None if steps[k].batched else self.unstreamed) for k in mine]
        try:
            with TensorStream((self.ca, self.cb), reads) as stream, \
                    checker.reading((stream.side(0), stream.side(1)), mapped):
                for j, k in enumerate(mine):
                    self.done[k] = results = self._step(steps[k])
                    if self.book is not None and not steps[k].on_all:
                        self.book.finished(k, results)
                    stream.done(j)
                    for m in mapped:
                        m.release()
        finally:
            for m in mapped:
                m.close()

    def _step(self, step: Step) -> list:
        """One step's results: a batch of routed experts, or one pair."""
        if step.batched:
            results = check_batch(self.checker, step.items, self.rows[step.items[0][0]], self.reference)
        else:
            ref, x, y = step.items[0]
            results = [self.checker.check(ref, x, y, self.rows[ref], coarsest(*self.bits[ref]) is not None,
                                          self.reference, compute_identical=step.on_all,
                                          ran=self.ran if step.on_all else None)]
        for (ref, x, y), res in zip(step.items, results):
            res.bits_a, res.bits_b = self.bits[ref]
            self.bar.update(self.nbytes(x, y))
        return results

    def finish(self) -> None:
        """The tasks' ranges as they finish (--ray), then every FFN's results in step order, and what is said of
        them, in the report where a one-process run says it."""
        report, at = self.report, self.at
        with self.held:
            for c, value in cluster.results(self.ray, self.pending,
                                            lambda c: f"verifying steps {self.parts[c][0]}-{self.parts[c][-1]}"):
                self.done.update(value)  # {step: [FFNResult]}, from the task
                self.bar.update(sum(self.nbytes(x, y) for k in self.parts[c] for _, x, y in self.steps[k].items))
                for k in self.parts[c]:
                    if self.book is not None:
                        self.book.finished(k, value[k])
            self.bar.close()
        self.pending = {}
        report.results += [res for k in range(len(self.steps)) for res in self.done[k]]
        later_notes, later_problems = report.notes[at[0]:], report.problems[at[1]:]
        del report.notes[at[0]:], report.problems[at[1]:]
        report.notes += results_notes(report.results, self.bits, len(self.pairs))
        differing = [r.ref for r in report.results if r.exact == "differs"]
        if differing:
            self.checker.name_owners(report, differing, self.rb)
        report.notes += later_notes
        report.problems += later_problems

    def run_kernels(self) -> None:
        """The first FFN of each kind on the kernel backends, read again: run last, their frameworks imported
        meanwhile, and with nothing else held (they copy the weights they run)."""
        if self.pending:
            self.finish()
        mods, _ = self.kernels.result()
        others = {n: m for n, m in mods.items() if n != "reference"}
        by_ref = {r.ref: r for r in self.report.results}
        for ref, x, y in self.pairs:
            if others and ref in self.ran:
                self.checker.run_kernels(by_ref[ref], x, y, self.rows[ref], self.ran[ref], others)


def results_notes(results: list, bits: dict, pairs: int) -> list[str]:
    """What is said of the FFNs' results: those whose float64 reference was not computed, and how quantized ones
    were compared."""
    notes = []
    skipped = sum(any(b.path == NOT_COMPUTED for b in r.backends) for r in results)
    if skipped:
        notes.append(
            f"{skipped} of {pairs} FFNs are bit-identical to A's, finite, and on no kernel backend: their "
            "float64 reference was not computed (the same bits through the same computation give A's output, so "
            "it could only agree); their weights were checked finite instead, the one thing that run could add "
            "(--all-ffns-on-every-backend computes it)")
    quantized = [r for r in results if coarsest(*bits[r.ref]) is not None]
    if quantized:
        sides = " and ".join(s for s, i in (("A", 0), ("B", 1)) if any(bits[r][i] is not None for r in bits))
        which = "" if len(quantized) == pairs else f" ({len(quantized)} of {pairs} FFNs)"
        requantized = sum(r.exact == "requantized" for r in quantized)
        codes = sum(r.exact == "codes" for r in quantized)
        same = sum(r.exact == "identical" for r in quantized)
        notes.append(f"{sides} quantized{which}: " + (
            f"{requantized} FFNs are A's weights re-quantized with B's parameters, bit for bit; run dequantized"
            if requantized else f"{codes} FFNs hold the other side's stored codes, their values exactly; run "
            "dequantized" if codes else f"{same} FFNs store A's quantized parts (codes and scales) byte for byte: "
            "compared as stored bytes, dequantized only to run the first FFN of each kind"
            + (f"; the other {len(quantized) - same} compared after dequantization"
               if same < len(quantized) else "")
            if same else "weights compared after dequantization; no bit-exact check"))
    return notes
