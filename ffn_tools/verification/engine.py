"""``verify A B``: are two checkpoints' FFNs the same, bit for bit and as functions?

FFNs are paired by ``FFNRef`` (layer, kind, expert); one present on one side only is a failure. For each
pair (``pairs``, in the order ``steps`` plans): shapes and biases must match; the canonical gate/up/down (and
biases) are compared bit for bit when both sides should be lossless copies (same dtype, neither quantized;
``exact``), naming the first differing element and, when recognisable, the defect (swapped gate/up, transposed
down, a fused layout misread, another layer's or expert's weights); and the FFN runs on seeded inputs: A's on
the float64 reference, B's on every requested backend (``functional``), within the tolerance table of
``tolerances``, with finite outputs (else B's inf/nan weights are named). The tensors outside the FFNs are
compared too (``outside``). What is not weights, B's client compares (``model``: config, side files,
tokenization); A is paired with B as B's client loads it (``Client.pairing``), and ``logits`` adds a
whole-model check through both real clients.

``verify`` runs in phases, each a function here: open both sides (``_open``; refusals and what the whole-model
checks will have, ``_before_work``), B's client's load check, pair the FFNs (``_pair``, which also starts the
model checks), decide A's MTP heads B lacks (``heads.Heads.decide``: left out before any comparison, said once),
derive what B should hold given A as B's client will hold it (``expected.Expected.derive``),
compare (``_compare``: the FFN pairs, ``pairrun``, and the tensors outside them but those a transform derives),
compare those each transform derives, once (``Expected.compare_derived``), say the heads B holds and their drafts
(``Heads.report``), then the whole models (``_whole_models``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .. import progress, quant
from ..checks.agreement import AgreementResult
from ..checks.outside import OutsideResult
from ..checks.prompts import load_prompts
from ..clients import Client, runtime
from ..detect import FFNSet
from ..errors import FFNToolsError
from ..specs import parse_spec
from . import expert_map, partial
from .backends import ALL, resolve_backends
from .expected import Expected, Sides
from .functional import reference_backend
from .heads import Heads
from .model import model_checks, run_logits
from .options import DEFAULT_TOKENS, Models, VerifyOptions  # noqa: F401  (DEFAULT_TOKENS: verify's, as before)
from .outside import compare_outside, in_blocks
from .pairrun import check_pairs
from .report import VerifyReport
from .sides import describe_side, extract_selection, extracts, find
from .steps import PairOptions
from .stored import quantized_alike
from .stream import Streamed, TensorStream

log = logging.getLogger(__name__)

OUTSIDE_READ_AHEAD = 256 << 20  # the outside comparison holds the pair it compares while it reads the next
Opener = Callable[..., tuple]
T = TypeVar("T")


@contextmanager
def background() -> Iterator[ThreadPoolExecutor]:
    """One thread for what needs no tensors (importing the kernel frameworks, the config comparison), beside the
    checks (one thread: two imports at once could each see the other's half-initialised modules). Leaving waits
    for what was given (an import is seconds), so no thread of ours outlives ``verify`` to be running when its
    caller forks, whether it returns or raises (a bad input found after the checks began); on an interrupt it
    does not wait."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="ffn-tools-background")
    interrupted = failed = False
    try:
        yield pool
    except (KeyboardInterrupt, SystemExit):
        interrupted = True
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    except BaseException:
        failed = True  # what was given and not begun is not needed any more
        raise
    finally:
        if not interrupted:
            threads = list(getattr(pool, "_threads", ()))
            pool.shutdown(wait=True, cancel_futures=failed)
            for t in threads:
                gone(t)


def gone(thread, timeout: float = 2.0) -> None:
    """Wait, the GIL released, until ``thread`` has left the OS, not only Python: ``join`` returns before its
    thread-local destructors run, and mlx's (on a thread that ran mlx_lm's load check) takes the GIL; a process
    that finalizes meanwhile kills that thread inside a C++ destructor, and the process aborts ("terminate
    called without an active exception", exit 134, after a report that passed). Linux says it in /proc."""
    task = f"/proc/self/task/{thread.native_id}"
    if thread.native_id is None or not os.path.isdir("/proc/self/task"):
        time.sleep(0.05)  # elsewhere: a moment for the destructors
        return
    end = time.monotonic() + timeout
    while os.path.exists(task) and time.monotonic() < end:
        time.sleep(0.002)


def done(value: T) -> "Future[T]":
    """A future already holding ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


def verify(a, b, *, opener: Opener, converter: Callable[..., object] | None = None, **options) -> VerifyReport:
    """Verify that checkpoint ``b`` holds the same FFNs as checkpoint ``a``.

    Args:
        a, b: paths of checkpoints ``opener`` opens.
        options: the fields of ``VerifyOptions`` (which documents each).
        opener: ``(path, side, absent_shards, like=A's checkpoint or None) -> (checkpoint, None)`` or
            ``(None, problem)`` where the files are there but cannot be read as their format (raising where there
            is no checkpoint at all): the format registry's (``converters.open_sides``), which the API passes.
        converter: the format registry's conversion (``converters.convert``, which the API passes): re-derives
            B's form from A for --generate's noise floor (None: that floor is not measured, and the report says so).

    Returns:
        The report; ``report.passed`` is the verdict.

    Raises:
        FFNToolsError: unreadable checkpoints, no FFNs, an unknown or unavailable backend, an empty
            selection or one naming layers or experts neither checkpoint has, an activation the kernels
            do not have, a load check whose client is not installed. (--logits a client cannot run here
            leaves the report ``incomplete``, saying why beside the other results.)
    """
    o = VerifyOptions(**options)
    o.refuse_bad()
    prompt_texts = load_prompts(o.prompts) if o.generate else []  # a bad file: before any work
    selection = (parse_spec(o.layers) if o.layers else None, parse_spec(o.experts) if o.experts else None)
    with ExitStack() as stack:
        # Backends the user named resolve now, so that one that cannot run here is refused before any work;
        # every available one (the default) is found in the background, beside the weight checks (importing
        # jax, mlx and triton takes seconds), after the load check's own imports.
        worker = stack.enter_context(background())
        kernels = done(resolve_backends(o.backends)) if o.backends else None  # (a typo or one not here: now)
        (ca, ea), (cb, eb) = _open(a, b, opener, selection[0] is not None, stack)
        if ea or eb:
            return _unreadable(a, b, ca, cb, (ea, eb), kernels, o)
        run = Run(a, b, o, ca, cb, runtime(cb.format, o.client), selection, converter)  # B's runtime: what it loads
        _before_work(run)
        # first, before any work: a missing client of B's format says so (transformers': its load check not run)
        with progress.doing(f"verify: the load check (would B load in {run.client.name}?)"):  # seconds: its imports
            load = run.client.load_check(cb.stored) if o.load_check else None
        if kernels is None:  # the reference and B's runtime's kernels
            reference_backend()  # imported here, not beside the background's imports
            kernels = worker.submit(resolve_backends, None, run.client.kernels, run.client.name)
        report, fa, fb, model = _pair(run, load, worker)
        heads = Heads.decide(ca, cb, fa, fb)  # A's MTP heads B lacks whole: left out before any comparison
        heads.said(report)
        run.selection = heads.selected(run.selection)  # --layers naming an absent head's: not compared
        ffns = (fa.tensors, fb.tensors) if fa and fb else (frozenset(), frozenset())
        expected = Expected.derive(run.client, ca, cb, bool(fa and fb), ffns, (heads,))  # B from A via B's client
        if fa and fb:
            _compare(run, report, (heads.without(fa), fb), kernels, expected, stack)
        report.config, report.side_files, report.tokenization = model.result()
        if o.unbounded and report.config is not None:
            report.config.unbind()
        recipe = cb.format.recipe(cb, report.b.get("dtype"), bool(report.b.get("quantization"))) if o.generate else None
        mods, report.skipped_backends = kernels.result()
        report.backends = list(mods)
        ties = report.config.ties if report.config is not None else (None, None)
        report.notes += expected.compare_derived(report.outside, Sides(ca, cb, o.atol, o.rtol, ties))
        heads.report(report, ca, cb, fa)  # the heads B holds: in part, differing, their drafts against the floor
    _whole_models(run, report, fa, recipe, prompt_texts)
    return report


@dataclass
class Run:
    """One verify as it runs: its paths and options, both sides open, B's client, the FFNs selected, and what the
    checks of whole models (``--logits``, ``--generate``) will have: both clients, or why they cannot run."""

    a: object
    b: object
    o: VerifyOptions
    ca: Any
    cb: Any
    client: Client
    selection: tuple
    converter: Callable[..., object] | None = None
    partial: list = field(default_factory=list)
    clients: tuple[Client, Client] | None = None
    no_logits: str | None = None  # shards absent: the clients load every shard
    blocked: str | None = None  # why a client cannot run a side here, known before any work

    def models(self) -> Models:
        """Both sides as whole models, run by ``clients`` (which are there)."""
        assert self.clients is not None
        return Models((self.a, self.b), (self.ca, self.cb), self.clients, self.converter)


def _open(a, b, opener: Opener, some_layers: bool, stack: ExitStack) -> list[tuple]:
    """Both sides opened, each ``(checkpoint, None)`` or ``(None, problem)``; quantized ones decoded (FP8 blocks
    too), held until ``stack`` closes. ``some_layers``: under --layers a sharded side may hold only some shards."""
    opened: list[tuple] = []
    for path, side in ((a, "A"), (b, "B")):
        c, e = opener(path, side, some_layers, like=opened[0][0] if opened else None)
        opened.append((c and stack.enter_context(quant.decoded(c, every=True)), e))
    return opened


def _unreadable(a, b, ca, cb, problems: tuple, kernels: Future | None, o: VerifyOptions) -> VerifyReport:
    """The report where a side's files are there but cannot be read as their format."""
    side_a, side_b = (describe_side(c, None) if c else {"path": str(p)} for c, p in ((ca, a), (cb, b)))
    mods, skipped = kernels.result() if kernels else resolve_backends()
    return VerifyReport(side_a, side_b, list(mods), skipped, o.tokens, o.seed, None,
                        problems=[e for e in problems if e])


def _before_work(run: Run) -> None:
    """Refusals and what is known before any work: a selected FFN's tensor in a shard not here (raised), and
    whether the clients can run the whole models (``run.clients``, or why not)."""
    o = run.o
    run.partial = [(side, c) for side, c in (("A", run.ca), ("B", run.cb)) if c.stored.absent]
    if run.partial and (needs := partial.refusal(run.partial, o.layers or "", o.experts, o.scheme)):
        raise needs  # a selected FFN's tensor lies in a shard not here: before any work
    if o.whole_models and run.partial:
        run.no_logits = (f"{' and '.join(s for s, _ in run.partial)} {'have' if len(run.partial) > 1 else 'has'} "
                         "shards absent: the clients load every shard")
    elif o.whole_models:
        from .logits import client_for

        try:
            run.clients = (client_for(run.ca, "A"), client_for(run.cb, "B", o.client))
        except FFNToolsError as e:
            run.blocked = str(e) if o.logits else str(e).replace("--logits:", "--generate:", 1)


def _pair(run: Run, load, worker) -> tuple[VerifyReport, FFNSet | None, FFNSet | None, Future]:
    """Each side's FFNs found and the report begun (what each side is, FFN-like tensors of no FFN); the model
    checks (config, side files, tokenization: ``model_checks``) started on ``worker``; the selection made
    explicit where an extract output holds part of the FFNs (``extract_selection``)."""
    o, ca, cb = run.o, run.ca, run.cb
    (fa, pa), (fb, pb) = (find(ca, "A", o.scheme, o.layout, run.selection),
                          find(cb, "B", o.scheme, o.b_layout or o.layout, run.selection))
    report = VerifyReport(describe_side(ca, fa), describe_side(cb, fb), [], {}, o.tokens, o.seed, None, load=load)
    report.notes += [f"{side}: {c.absent_line()}: only the FFNs of --layers {o.layers} are read from it; "
                     "what needs every shard (the load check, logits) does not run" for side, c in run.partial]
    report.problems += [p for p in (pa, pb) if p]
    extract = extracts(fa, fb)  # an FFN-only output has no model around its FFNs to compare
    # beside the FFNs
    allow = (*o.allow_config, *expert_map.explained(ca, cb))  # an expert count B's recorded mapping explains
    model: Future = worker.submit(model_checks, run.client, ca, cb, extract, allow, o.side_files)
    for side, found in (("A", fa), ("B", fb)):
        if found and (w := found.unmatched_warning()):
            (report.notes if o.allow_unmatched else report.problems).append(
                f"{side}: {w}" + ("" if o.allow_unmatched else "; --allow-unmatched accepts them unchecked"))
    if fa and fb:  # B pruned or reordered (prune-experts, reorder-experts): its experts paired through its mapping
        fa, fb = expert_map.paired(report, ca, cb, fa, fb)
    if fa and fb and run.selection == (None, None):
        run.selection = extract_selection(report, ca, cb, fa, fb)
    return report, fa, fb, model


def _compare(run: Run, report: VerifyReport, ffns: tuple[FFNSet, FFNSet], kernels: Future, expected: Expected,
             stack: ExitStack) -> None:
    """B against A as derived (``expected``): the FFN pairs, the tensors outside them but those a transform
    settles, then the kernel backends on the first FFN of each kind."""
    o, (fa, fb) = run.o, ffns
    on_reference = not o.backends or "reference" in o.backends or list(o.backends) == [ALL]
    pairs = check_pairs(report, (run.ca, run.cb), ffns, kernels, expected, stack,
                        PairOptions.of(o, run.selection, on_reference))
    report.outside = _outside(run.ca, run.cb, fa, fb, o.ffn_only or bool(any(run.selection)), o.atol, o.rtol,
                              expected.left_out())
    pairs.run_kernels()  # after the outside comparison: its tensors and theirs are not held at once


def _whole_models(run: Run, report: VerifyReport, fa: FFNSet | None, recipe, prompts: list[str]) -> None:
    """``--logits`` and ``--generate`` (the checkpoints are closed: the clients load the whole models), or why
    they did not run."""
    o = run.o
    refused = report.load is not None and report.load.refused
    if run.blocked:
        report.incomplete.append(run.blocked)
        report.logits_skipped = "no client here runs a side as a whole model (see above)"
    elif run.no_logits:
        report.logits_skipped = run.no_logits
    elif o.logits and refused:
        report.logits_skipped = "B's client cannot build B (the load check's failure)"
    elif o.logits and run.clients is not None:
        run_logits(report, run.models(), fa.activation.function if fa else None, o)
    else:
        report.logits_skipped = "--logits runs both whole models through their clients"
    skip = None if o.generate else "--generate runs both models on prompts through their clients"
    why = skip or run.blocked or run.no_logits or ("B's client cannot build B (the load check's failure)"
                                                  if refused else None)
    report.generation = _generation(report, run, recipe, prompts, why)
    bound = report.config.tokens if report.config is not None else None
    if bound is not None and report.generation is not None and report.generation.decided:
        report.notes.append(f"generation: on sequences past {bound} tokens A's and B's clients compute otherwise (the "
                            "config line's bound); there its floor, A converted to B's form and run by B's client, "
                            "computes as B's client does, so the statistics judge B's weights, not that difference")


def _generation(report: VerifyReport, run: Run, recipe, prompts: list[str], why: str | None) -> AgreementResult:
    """``verify --generate`` (``generate.run_generation``), or ``why`` it did not run; a client that cannot run its
    model here leaves the report incomplete, saying why."""
    if why or run.clients is None:
        return AgreementResult(skipped=why or "no client here runs a side as a whole model")
    from .generate import run_generation

    try:
        res = run_generation(run.models(), recipe, report.a.get("dtype"), prompts, run.o)
        if res.not_judged:  # the statistics are reported; with no floor they are no verdict
            report.incomplete.append(f"--generate: not judged: {res.not_judged}")
        return res
    except FFNToolsError as e:  # said where the check's line is: a FAIL's verdict names another failure
        report.incomplete.append(str(e))
        return AgreementResult(skipped=str(e))


def _outside(ca, cb, fa: FFNSet, fb: FFNSet, ffn_only: bool, atol, rtol, elsewhere) -> OutsideResult:
    """The tensors outside the FFNs, compared by name; or why not (--ffn-only or a selection, an extract output).
    ``elsewhere`` are left to the transforms that derive them from A (``Expected.left_out``), compared there once."""
    if ffn_only:
        return OutsideResult(skipped="--ffn-only, or --layers/--experts select part of the FFNs")
    extract = extracts(fa, fb)
    if extract:
        return OutsideResult(skipped=extract)
    log.info("comparing the tensors outside the FFNs")
    if not (ca.preads and cb.preads):
        return compare_outside(ca, cb, fa, fb, atol=atol, rtol=rtol, elsewhere=elsewhere)
    b_names = {n for n in cb if n not in fb.tensors and n not in elsewhere}
    steps = [[(0, n), (1, n)] for n in sorted(n for n in ca if n not in fa.tensors and n in b_names)
             if tuple(ca.info(n).shape) == tuple(cb.info(n).shape)  # the order compare_outside reads them in,
             and not in_blocks(ca.info(n), cb.info(n))  # but those it reads from the files a block at a time
             and not quantized_alike(ca, cb, n)]  # and those it compares as stored bytes first
    with TensorStream((ca, cb), steps, budget=OUTSIDE_READ_AHEAD, advance=True) as stream:
        return compare_outside(Streamed(ca, stream.side(0)), Streamed(cb, stream.side(1)), fa, fb, atol=atol,
                               rtol=rtol, elsewhere=elsewhere)
