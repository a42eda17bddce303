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
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import TypeVar

from .. import cluster, progress, quant
from ..checks.agreement import DEFAULT_PROFILE, PROFILES, AgreementResult
from ..checks.prompts import NEW_TOKENS, load_prompts
from ..checks.outside import OutsideResult, outside_tolerance
from ..checks.rounded import compare_recorded, recorded_shifts
from ..detect import FFNSet
from ..errors import FFNToolsError
from ..layouts import GateUpLayout
from ..registry import Scheme
from ..specs import parse_spec
from ..tolerances import tolerance_for
from . import partial, tied
from .backends import ALL, resolve_backends
from .functional import reference_backend
from .model import model_checks, run_logits
from .outside import compare_outside, in_blocks
from .report import VerifyReport
from .sides import describe_side, extract_selection, extracts, find
from .steps import check_pairs
from .stored import quantized_alike
from .stream import Streamed, TensorStream

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 32
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


def verify(a, b, *, opener: Opener, backends: Sequence[str] | None = None, tokens: int = DEFAULT_TOKENS, seed: int = 0,
           layers: str | None = None, experts: str | None = None, atol: float | None = None,
           rtol: float | None = None, exact: bool | None = None, logits: bool = False,
           scheme: Scheme | None = None, layout: GateUpLayout | None = None,
           b_layout: GateUpLayout | None = None, allow_unmatched: bool = False, ffn_only: bool = False,
           load_check: bool = True, allow_config: Sequence[str] = (), side_files: bool = True,
           all_ffns_on_every_backend: bool = False, generate: bool = False, prompts: str | None = None,
           new_tokens: int = NEW_TOKENS, profile: str = DEFAULT_PROFILE, unbounded: bool = False) -> VerifyReport:
    """Verify that checkpoint ``b`` holds the same FFNs as checkpoint ``a``.

    Args:
        a, b: paths of checkpoints ``opener`` opens.
        opener: ``(path, side, absent_shards, like=A's checkpoint or None) -> (checkpoint, None)`` or
            ``(None, problem)`` where the files are there but cannot be read as their format (raising where there
            is no checkpoint at all): the format registry's (``converters.open_sides``), which the API passes.
        backends: kernel backends for B's FFN (default: the reference and B's runtime's kernels that run natively
            here, ``Client.kernels``; ``["all"]``: every one available here).
        tokens: rows of the seeded random input per FFN.
        seed: seed of the inputs (and of the logits token batch).
        layers, experts: selections like ``0-3,7`` (None: all; ``experts`` keeps dense and shared FFNs).
        atol, rtol: override the tolerance table (see ``tolerances``).
        exact: True: demand bit-identical canonical tensors; False: skip; None: where both sides should
            be lossless copies (same dtype, neither quantized).
        logits: also compare whole-model logits through transformers / mlx_lm.
        scheme, layout: naming scheme and fused gate/up layout, for both checkpoints (detected / the
            scheme's by default).
        b_layout: B's fused gate/up layout, when it differs from A's: then ``layout`` applies to A only
            (None: B's is ``layout`` too).
        allow_unmatched: tensors that look like FFN projections but belong to no FFN found are a note,
            not a failure (they are never run as FFNs).
        ffn_only: compare the FFNs only; by default every tensor outside them is compared too
            (``outside``).
        load_check: check that B would load in its real client (``loadable``): every parameter provided,
            nothing left over, shapes equal.
        allow_config: config keys whose difference is accepted on purpose (``model_config``); every other
            difference in what the clients read fails.
        unbounded: fail a setting the clients run otherwise only past a sequence length (a sliding window one
            applies and the other not); by default it passes, the verdict saying up to which length.
        side_files: compare tokenizer, generation_config and the other side files (``side_files``).
        all_ffns_on_every_backend: run every FFN on every backend; by default every FFN runs on the float64
            reference and the other backends run the first FFN of each kind (shape, form, layout, dtype,
            quantization, biases): what proves the kernels, at a fraction of the time on a large model.
        generate: also run both models on prompts through their clients, token by token against a measured
            noise floor (``generate``); ``prompts``: a file of prompts (None: the built-in set), ``new_tokens``
            greedy tokens per prompt, ``profile`` how far above its floor a statistic may be
            (``checks.agreement.PROFILES``).

    Returns:
        The report; ``report.passed`` is the verdict.

    Raises:
        FFNToolsError: unreadable checkpoints, no FFNs, an unknown or unavailable backend, an empty
            selection or one naming layers or experts neither checkpoint has, an activation the kernels
            do not have, a load check whose client is not installed. (--logits a client cannot run here
            leaves the report ``incomplete``, saying why beside the other results.)
    """
    if tokens < 1:
        raise FFNToolsError(f"--tokens {tokens}: need at least 1 token")
    if profile not in PROFILES:
        raise FFNToolsError(f"--profile {profile!r}: use one of {', '.join(PROFILES)}")
    if new_tokens < 1:
        raise FFNToolsError(f"--new-tokens {new_tokens}: need at least 1 token")
    prompt_texts = load_prompts(prompts) if generate else []  # a bad file: before any work
    sel_layers = parse_spec(layers) if layers else None
    sel_experts = parse_spec(experts) if experts else None
    on_reference = not backends or "reference" in backends or list(backends) == [ALL]
    with ExitStack() as stack:
        # Backends the user named resolve now, so that one that cannot run here is refused before any work;
        # every available one (the default) is found in the background, beside the weight checks (importing
        # jax, mlx and triton takes seconds), after the load check's own imports.
        worker = stack.enter_context(background())
        kernels = done(resolve_backends(backends)) if backends else None  # (a typo or one not here: now)
        opened: list[tuple] = []
        for path, side in ((a, "A"), (b, "B")):  # under --layers a sharded side may hold only some shards
            c, e = opener(path, side, sel_layers is not None, like=opened[0][0] if opened else None)
            opened.append((c and stack.enter_context(quant.decoded(c, every=True)), e))  # FP8 blocks too
        (ca, ea), (cb, eb) = opened
        if ea or eb:
            side_a, side_b = (describe_side(c, None) if c else {"path": str(p)} for c, p in ((ca, a), (cb, b)))
            mods, skipped = kernels.result() if kernels else resolve_backends()
            return VerifyReport(side_a, side_b, list(mods), skipped, tokens, seed, None,
                                problems=[e for e in (ea, eb) if e])
        client = cb.format.client()  # B's runtime: what it loads, reads and computes
        partial_sides = [(side, c) for side, c in (("A", ca), ("B", cb)) if c.stored.absent]
        if partial_sides and (needs := partial.refusal(partial_sides, layers or "", experts, scheme)):
            raise needs  # a selected FFN's tensor lies in a shard not here: before any work
        clients = None
        no_logits = (f"{' and '.join(s for s, _ in partial_sides)} {'have' if len(partial_sides) > 1 else 'has'} "
                     "shards absent: the clients load every shard") if (logits or generate) and partial_sides else None
        blocked = None  # why --logits cannot run here, known before any work: said beside the other results
        if (logits or generate) and not no_logits:
            from .logits import client_for

            try:
                clients = (client_for(ca, "A"), client_for(cb, "B"))
            except FFNToolsError as e:
                blocked = str(e) if logits else str(e).replace("--logits:", "--generate:", 1)
        # first, before any work: a missing client of B's format says so (transformers': its load check not run)
        with progress.doing(f"verify: the load check (would B load in {client.name}?)"):  # seconds: its imports
            load = client.load_check(cb.stored) if load_check else None
        if kernels is None:  # the reference and B's runtime's kernels
            reference_backend()  # imported here, not beside the background's imports
            kernels = worker.submit(resolve_backends, None, client.kernels, client.name)
        selection = (sel_layers, sel_experts)
        (fa, pa), (fb, pb) = (find(ca, "A", scheme, layout, selection),
                              find(cb, "B", scheme, b_layout or layout, selection))
        report = VerifyReport(describe_side(ca, fa), describe_side(cb, fb), [], {}, tokens, seed, None, load=load)
        report.notes += [f"{side}: {c.absent_line()}: only the FFNs of --layers {layers} are read from it; "
                         "what needs every shard (the load check, logits) does not run" for side, c in partial_sides]
        report.problems += [p for p in (pa, pb) if p]
        extract = extracts(fa, fb)  # an FFN-only output has no model around its FFNs to compare
        # beside the FFNs; not in a --ray task, which verifies its range of FFN steps and nothing else
        model: Future = (done(None) if cluster.task("steps") is not None
                         else worker.submit(model_checks, client, ca, cb, extract, allow_config, side_files))
        for side, found in (("A", fa), ("B", fb)):
            if found and (w := found.unmatched_warning()):
                (report.notes if allow_unmatched else report.problems).append(
                    f"{side}: {w}" + ("" if allow_unmatched else "; --allow-unmatched accepts them unchecked"))
        if fa and fb and sel_layers is None and sel_experts is None:
            sel_layers, sel_experts = extract_selection(report, ca, cb, fa, fb)
        pairing = client.pairing(ca, cb) if fa and fb else None  # A as B's client loads it: FFNs and outside
        if fa and fb:
            run_kernels = check_pairs(report, ca, cb, fa, fb, kernels, on_reference, sel_layers, sel_experts, atol,
                                      rtol, exact, seed, tokens, pairing, stack, all_ffns_on_every_backend)
            elsewhere = client.stored_otherwise(cb)  # compared by B's client, below
            recorded = recorded_shifts(cb.metadata)  # B read back from a GGUF storing them plus one: its record
            report.outside = _outside(ca, cb, fa, fb, ffn_only or bool(sel_layers or sel_experts), atol, rtol,
                                      elsewhere | set(recorded))
            if elsewhere and not report.outside.skipped:
                report.notes += client.settle_otherwise(report.outside, ca, cb, atol, rtol)
            if recorded:
                report.notes += compare_recorded(report.outside, ca, cb, recorded)
            run_kernels()  # after the outside comparison: its tensors and theirs are not held at once
        report.config, report.side_files, report.tokenization = model.result()
        if unbounded and report.config is not None:
            report.config.unbind()
        recipe = cb.format.recipe(cb, report.b.get("dtype"), bool(report.b.get("quantization"))) if generate else None
        mods, report.skipped_backends = kernels.result()
        report.backends = list(mods)
        if report.outside is not None and not report.outside.skipped:
            if pairing is not None:
                report.notes += pairing.settle(report.outside, cb, _tolerance_check(atol, rtol))
            report.notes += tied.reconcile(report.outside, ca, cb, report.config.ties)
    refused = report.load is not None and report.load.refused
    if blocked:
        report.incomplete.append(blocked)
        report.logits_skipped = "no client here runs a side as a whole model (see above)"
    elif no_logits:
        report.logits_skipped = no_logits
    elif logits and refused:
        report.logits_skipped = "B's client cannot build B (the load check's failure)"
    elif logits and clients is not None:  # the checkpoints are closed: the clients load the whole models
        run_logits(report, a, b, ca, cb, clients, fa.activation.function if fa else None, atol, rtol, seed)
    else:
        report.logits_skipped = "--logits runs both whole models through their clients"
    report.generation = _generation(report, a, b, ca, cb, clients, recipe, allow_config, prompt_texts, new_tokens,
                                    profile,
                                    skip=None if generate else "--generate runs both models on prompts through "
                                    "their clients", blocked=blocked or no_logits, refused=refused)
    bound = report.config.tokens if report.config is not None else None
    if bound is not None and report.generation is not None and report.generation.decided:
        report.notes.append(f"generation: on sequences past {bound} tokens A's and B's clients compute otherwise (the "
                            "config line's bound); there its floor, A converted to B's form and run by B's client, "
                            "computes as B's client does, so the statistics judge B's weights, not that difference")
    return report


def _generation(report: VerifyReport, a, b, ca, cb, clients, recipe, allow_config, prompts, new_tokens, profile, *,
                skip, blocked, refused) -> AgreementResult:
    """``verify --generate`` (``generate.run_generation``), or why it did not run; a client that cannot run its
    model here leaves the report incomplete, saying why."""
    why = skip or blocked or ("B's client cannot build B (the load check's failure)" if refused else None)
    if why or clients is None:
        return AgreementResult(skipped=why or "no client here runs a side as a whole model")
    from .generate import run_generation

    try:
        res = run_generation(a, b, ca, cb, clients, recipe, report.a.get("dtype"), prompts, new_tokens, profile,
                             allow_config)
        if res.not_judged:  # the statistics are reported; with no floor they are no verdict
            report.incomplete.append(f"--generate: not judged: {res.not_judged}")
        return res
    except FFNToolsError as e:  # said where the check's line is: a FAIL's verdict names another failure
        report.incomplete.append(str(e))
        return AgreementResult(skipped=str(e))


def _outside(ca, cb, fa: FFNSet, fb: FFNSet, ffn_only: bool, atol, rtol, elsewhere) -> OutsideResult:
    """The tensors outside the FFNs, compared; or why not (--ffn-only or a selection, an extract output). B's
    ``elsewhere`` are left to B's client (``Client.stored_otherwise``)."""
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


def _tolerance_check(atol, rtol):
    """``(name, a, b, bits) -> why or None``: a tensor pair within its row (the outside check's criterion)."""
    def check(name, a, b, bits):
        return outside_tolerance(name, a, b, tolerance_for([a.dtype, b.dtype], bits, atol=atol, rtol=rtol))
    return check
