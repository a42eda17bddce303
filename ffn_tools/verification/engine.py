"""``verify A B``: are two checkpoints' FFNs the same, bit for bit and as functions?

FFNs are paired by ``FFNRef`` (layer, kind, expert); one present on one side only is a failure. For each
pair (``pairs``): shapes and biases must match; the canonical gate/up/down (and biases) are compared
bit for bit when both sides should be lossless copies (same dtype, neither quantized; ``exact``), naming
the first differing element and, when recognisable, the defect (swapped gate/up, transposed down, a fused
layout misread, another layer's or expert's weights); and the FFN runs on seeded inputs: A's on the
float64 reference, B's on every requested backend (``functional``), within the tolerance table of
``tolerances``, with finite outputs (else B's inf/nan weights are named). ``logits`` adds a whole-model
check through the real clients (``logits``). Where B is MLX and A is not, A's FFN tensors that mlx_lm's
sanitize computes (Falcon-H1's folded multipliers) are read as the MLX plan computes them (``consumer``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple
from contextlib import ExitStack
from pathlib import Path

from .. import progress
from ..detect import FFNSet, choose_scheme, find_ffns
from ..io.dtypes import short_name
from ..errors import CheckpointError, FFNToolsError, SchemeError, listing
from ..ffn import ACTIVATIONS, FFN, FFNRef
from ..layouts import GateUpLayout
from ..registry import Scheme, compile_template
from ..specs import parse_spec
from ..io.store import Format, open_checkpoint
from ..scales import Dequantized, is_companion
from ..tolerances import Tolerance, tolerance_for, widened
from .experts import BATCH_BYTES, batch_key, check_batch, pair_bytes
from .functional import KERNEL_DTYPES, NOT_COMPUTED, reference_backend
from . import consumer, partial, tied
from ..converters.gguf.record import compare_recorded, recorded_shifts  # GGUF -> torch/MLX exports: Gemma's norms
from .gguf_checks import compare_metadata, compare_plus_one, compare_tokenizer
from .model_config import ConfigResult, compare_configs
from .side_files import SideFilesResult, compare_side_files
from .tokenization import TokenizationResult, compare_tokenization
from .pairs import PairChecker
from .stream import BACKGROUND_FORMATS, Job, Streamed, TensorStream, Worker
from .outside import OutsideResult, compare_outside, in_blocks, outside_tolerance
from .quant import describe_quantization, ffn_bits, quantization
from .report import VerifyReport

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 32


class BackendError(FFNToolsError):
    """A requested kernel backend is unknown or cannot run on this machine."""


def resolve_backends(names: Sequence[str] | None = None) -> tuple[dict, dict[str, str]]:
    """The kernel backends to run: ``names``, or every one available here.

    Returns:
        (name -> module, reference first; name -> why it was skipped, for the unavailable defaults).

    Raises:
        BackendError: a name is unknown, or explicitly requested but unavailable (saying why).
    """
    from ffn_tools import kernels

    skipped: dict[str, str] = {}
    if names:
        unknown = [n for n in names if n not in kernels.BACKENDS]
        if unknown:
            raise BackendError(f"unknown backend {', '.join(map(repr, unknown))}; "
                               f"use one of {', '.join(kernels.BACKENDS)}")
        chosen = list(dict.fromkeys(names))
        for n in chosen:
            mod = kernels.get_backend(n)
            if not mod.available():
                raise BackendError(f"backend {n!r} is not available here: {mod.why_unavailable()}")
    else:
        chosen = []
        for n in kernels.BACKENDS:
            mod = kernels.get_backend(n)
            if mod.available():
                chosen.append(n)
            else:
                skipped[n] = mod.why_unavailable()
    chosen.sort(key=lambda n: n != "reference")
    return {n: kernels.get_backend(n) for n in chosen}, skipped


def _open(path, side: str, absent_shards: bool = False):
    """(checkpoint, None), or (None, problem) when the files are there but their content cannot be read
    (a failed conversion: say an MLX config whose group size does not fit its scales). ``absent_shards``
    (--layers): an index may name shards that are not here (``partial``).

    Raises:
        FFNToolsError: there is no checkpoint at ``path`` at all.
    """
    from ffn_tools.converters import open_any

    try:
        ckpt = open_any(path, absent_shards=absent_shards)
        return (Dequantized(ckpt) if any(is_companion(n, ckpt) for n in ckpt) else ckpt), None
    except CheckpointError as e:
        try:
            open_checkpoint(path, absent_shards).close()  # plain weight files are there: what they hold is wrong
        except FFNToolsError:
            raise e from None
        return None, f"{side} cannot be read: {e}"


def _find(ckpt, side: str, scheme: Scheme | None, layout: GateUpLayout | None,
          selection: tuple[set | None, set | None] = (None, None)) -> tuple[FFNSet | None, str | None]:
    """A's (or B's) FFNs, or (None, problem) when its FFN tensors exist but are inconsistent.

    A given ``scheme`` applies where it matches: a checkpoint none of whose tensor names fit it (say an
    extract output compared with a custom-named original) is detected as usual. On a checkpoint with shards
    absent only the ``selection``'s (layers, experts) FFN tensors are searched (``partial.search_names``).

    Raises:
        SchemeError: no FFN tensors at all (nothing to verify: a usage problem, not a difference).
    """
    names = list(ckpt)
    if scheme is not None and not any(compile_template(t).fullmatch(n) for g in scheme.groups
                                      for f in g.forms.values() for t in f.templates().values() for n in names):
        log.info("%s: no tensor matches scheme %r; detecting its scheme", side, scheme.name)
        scheme = None
    try:
        scheme = scheme or choose_scheme(names, ckpt.config)
    except SchemeError as e:
        raise SchemeError(f"{side}: {e}") from None
    search = partial.search_names(ckpt, scheme, *selection) if ckpt.stored.absent else None
    try:
        return find_ffns(ckpt, scheme, layout, search), None
    except SchemeError as e:
        return None, f"{side}'s FFN tensors are inconsistent: {e}"


def _side(ckpt, ffns: FFNSet | None) -> dict:
    q = quantization(ckpt)
    dtype = short_name(ckpt.info(ffns.ffns[0].names["down"]).dtype) if ffns and ffns.ffns else None
    return {"path": str(ckpt.path), "format": ckpt.label, "scheme": ffns.scheme.name if ffns else None,
            "dtype": dtype, "activation": ffns.activation.describe() if ffns else None,
            "quantization": describe_quantization(q) if q else None,
            "ffns": len(ffns.ffns) if ffns else 0, "absent_shards": list(ckpt.stored.absent)}


def _select(ffns: FFNSet, layers: set[int] | None, experts: set[int] | None) -> dict[FFNRef, FFN]:
    return {r: f for r, f in ffns.by_ref().items() if (layers is None or r.layer in layers)
            and (experts is None or r.kind != "expert" or r.expert in experts)}


def verify(a, b, *, backends: Sequence[str] | None = None, tokens: int = DEFAULT_TOKENS, seed: int = 0,
           layers: str | None = None, experts: str | None = None, atol: float | None = None,
           rtol: float | None = None, exact: bool | None = None, logits: bool = False,
           scheme: Scheme | None = None, layout: GateUpLayout | None = None,
           b_layout: GateUpLayout | None = None, allow_unmatched: bool = False, ffn_only: bool = False,
           load_check: bool = True, allow_config: Sequence[str] = (), side_files: bool = True,
           all_ffns_on_every_backend: bool = False) -> VerifyReport:
    """Verify that checkpoint ``b`` holds the same FFNs as checkpoint ``a``.

    Args:
        a, b: paths of any format ``converters.open_any`` reads.
        backends: kernel backends for B's FFN (default: every one available here).
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
        side_files: compare tokenizer, generation_config and the other side files (``side_files``).
        all_ffns_on_every_backend: run every FFN on every backend; by default every FFN runs on the float64
            reference and the other backends run the first FFN of each kind (shape, form, layout, dtype,
            quantization, biases): what proves the kernels, at a fraction of the time on a large model.

    Returns:
        The report; ``report.passed`` is the verdict.

    Raises:
        FFNToolsError: unreadable checkpoints, no FFNs, an unknown or unavailable backend, an empty
            selection or one naming layers or experts neither checkpoint has, an activation the kernels
            do not have, --logits on a checkpoint without a client, a load check whose client is not
            installed.
    """
    if tokens < 1:
        raise FFNToolsError(f"--tokens {tokens}: need at least 1 token")
    sel_layers = parse_spec(layers) if layers else None
    sel_experts = parse_spec(experts) if experts else None
    on_reference = not backends or "reference" in backends
    with ExitStack() as stack:
        # Backends the user named resolve now, so that one that cannot run here is refused before any work;
        # every available one (the default) is found in the background, beside the weight checks (importing
        # jax, mlx and triton takes seconds), after the load check's own imports.
        worker = stack.enter_context(Worker())
        kernels = worker.submit(resolve_backends, backends, now=True) if backends else None
        if kernels:
            kernels.result()
        opened = []
        for path, side in ((a, "A"), (b, "B")):  # under --layers a sharded side may hold only some shards
            c, e = _open(path, side, absent_shards=sel_layers is not None)
            opened.append((c and stack.enter_context(c), e))
        (ca, ea), (cb, eb) = opened
        if ea or eb:
            side_a, side_b = (_side(c, None) if c else {"path": str(p)} for c, p in ((ca, a), (cb, b)))
            mods, skipped = kernels.result() if kernels else resolve_backends()
            return VerifyReport(side_a, side_b, list(mods), skipped, tokens, seed, None,
                                problems=[e for e in (ea, eb) if e])
        partial_sides = [(side, c) for side, c in (("A", ca), ("B", cb)) if c.stored.absent]
        if partial_sides and (needs := partial.refusal(partial_sides, layers or "", experts, scheme)):
            raise needs  # a selected FFN's tensor lies in a shard not here: before any work
        clients = None
        no_logits = (f"{' and '.join(s for s, _ in partial_sides)} {'have' if len(partial_sides) > 1 else 'has'} "
                     "shards absent: the clients load every shard") if logits and partial_sides else None
        if logits and not no_logits:
            from .logits import client_for

            clients = (client_for(ca, "A"), client_for(cb, "B"))
        load = None
        if load_check:
            from ..loadable import check

            load = check(cb.stored)  # first: a missing client is could-not-run (exit 2) before any work
        if kernels is None:
            reference_backend()  # imported here, not beside the background's imports
            kernels = worker.submit(resolve_backends, None)
        selection = (sel_layers, sel_experts)
        (fa, pa), (fb, pb) = (_find(ca, "A", scheme, layout, selection),
                              _find(cb, "B", scheme, b_layout or layout, selection))
        report = VerifyReport(_side(ca, fa), _side(cb, fb), [], {}, tokens, seed, None, load=load)
        report.notes += [f"{side}: {c.absent_line()}: only the FFNs of --layers {layers} are read from it; "
                         "what needs every shard (the load check, logits) does not run" for side, c in partial_sides]
        report.problems += [p for p in (pa, pb) if p]
        extract = _extracts(fa, fb)  # an FFN-only output has no model around its FFNs to compare
        model = worker.submit(_model_checks, ca, cb, extract, allow_config, side_files)  # beside the FFN checks
        for side, found in (("A", fa), ("B", fb)):
            if found and (w := found.unmatched_warning()):
                (report.notes if allow_unmatched else report.problems).append(
                    f"{side}: {w}" + ("" if allow_unmatched else "; --allow-unmatched accepts them unchecked"))
        if fa and fb and sel_layers is None and sel_experts is None:
            sel_layers, sel_experts = _extract_selection(report, ca, cb, fa, fb)
        plan = consumer.export_plan(ca, cb) if fa and fb else None  # A as mlx_lm loads it: FFNs and outside
        if fa and fb:
            run_kernels = _check_pairs(report, ca, cb, fa, fb, kernels, on_reference, sel_layers, sel_experts, atol,
                                       rtol, exact, seed, tokens, plan, all_ffns_on_every_backend)
            report.outside = _outside(ca, cb, fa, fb, ffn_only or bool(sel_layers or sel_experts), atol, rtol)
            if cb.format is Format.GGUF:  # its weights stored plus one, which _outside left out
                report.notes += compare_plus_one(report.outside, ca, cb, atol, rtol)
            elif shifts := recorded_shifts(cb.metadata):  # B read back from such a GGUF (its export records it)
                report.notes += compare_recorded(report.outside, ca, cb, shifts)
            run_kernels()  # after the outside comparison: its tensors and theirs are not held at once
        report.config, report.side_files, report.tokenization = model.result()
        mods, report.skipped_backends = kernels.result()
        report.backends = list(mods)
        if report.outside is not None and not report.outside.skipped:
            report.notes += consumer.reconcile(report.outside, cb, _tolerance_check(atol, rtol), plan)
            report.notes += tied.reconcile(report.outside, ca, cb, report.config.ties)
        vocab = [(c.config or {}).get("vocab_size") for c in (ca, cb)]
        probe = probe_length(ca.config or {}, ca.total_bytes)
    refused = report.load is not None and report.load.refused
    if no_logits:
        report.logits_skipped = no_logits
    elif logits and refused:
        report.logits_skipped = "B's client cannot build B (the load check's failure)"
    elif logits and clients is not None:
        from .logits import client_floor, compare_logits

        same = clients[0] == clients[1] and bit_identical(report)
        row, why = client_floor(report.tolerance or tolerance_for([], None, atol=atol, rtol=rtol), clients,
                                fa.activation.function if fa else None)
        if why and not same:
            report.notes.append(why)
        tol = EXACT if same else widened(row)
        report.logits = compare_logits(a, b, clients, tol, seed, vocab, probe)
    else:
        report.logits_skipped = "--logits runs both whole models through their clients"
    return report


def _model_checks(ca, cb, extract: str | None, allow_config: Sequence[str],
                  side_files: bool) -> tuple[ConfigResult, SideFilesResult, TokenizationResult | None]:
    """The configs as their clients read them, and the side files (what is not weights); for a GGUF B, the
    model llama.cpp builds: its metadata and tokenizer.ggml.* (``gguf_checks``), and the texts llama.cpp
    tokenizes with it against A's tokenizer (``tokenization``; None for other formats)."""
    gguf = cb.format is Format.GGUF
    config = (ConfigResult(skipped=extract) if extract else compare_metadata(ca, cb, allow_config) if gguf
              else compare_configs(ca, cb, allow_config))
    side = (SideFilesResult(skipped="--no-side-files") if not side_files else SideFilesResult(skipped=extract)
            if extract else compare_tokenizer(Path(ca.root), cb) if gguf
            else compare_side_files(Path(ca.root), Path(cb.root)))
    tokens = None
    if gguf:
        tokens = (TokenizationResult(skipped="--no-side-files") if not side_files else
                  TokenizationResult(skipped=extract) if extract else
                  compare_tokenization(Path(ca.root), Path(cb.stored.path), cb.fields))
    return config, side, tokens


EXACT = Tolerance(0.0, 0.0, 0.0, "exact: bit-identical weights under the same client")  # atol 0: every logit equal
PROBE_MAX = 512  # longest token batch run to reach a config's window (tiny models only)
PROBE_BYTES = 1 << 30
OUTSIDE_READ_AHEAD = 256 << 20  # the outside comparison holds the pair it compares while it reads the next


def bit_identical(report: VerifyReport) -> bool:
    """Every FFN and every other tensor of B is bit-identical to A's (and the configs agree): then the same
    client computes the same logits, exactly."""
    o = report.outside
    return (bool(report.results) and all(r.exact == "identical" for r in report.results) and o is not None
            and not o.skipped and o.passed and o.within == 0)


def probe_length(config: dict, nbytes: int) -> int | None:
    """Tokens per sequence for --logits: past the sliding window or the original context of a scaled rope
    (where the config's settings act) when the model is small enough; None: the default batch."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    reach = [v for v in (config.get("sliding_window"), config.get("attention_chunk_size"),
                         rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None)
             if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if not reach or nbytes > PROBE_BYTES:
        return None
    length = min(reach) + 16
    return length if length <= PROBE_MAX else None


def _tolerance_check(atol, rtol):
    """``(name, a, b, bits) -> why or None``: a tensor pair within its row (the outside check's criterion)."""
    def check(name, a, b, bits):
        return outside_tolerance(name, a, b, tolerance_for([a.dtype, b.dtype], bits, atol=atol, rtol=rtol))
    return check


def _extract_selection(report: VerifyReport, ca, cb, fa: FFNSet, fb: FFNSet) -> tuple[set | None, set | None]:
    """The selection an extract output's manifest records (``extract --layers 1``), applied to the other side:
    what was not extracted is not missing. None, None where neither side is a partial extract."""
    for side, ckpt, found, other in (("A", ca, fa, fb), ("B", cb, fb, fa)):
        manifest = _manifest(ckpt) if found.scheme.name == "ffn-tools" else None
        if not isinstance(manifest, dict):
            continue
        layers, experts = set(manifest.get("layers") or ()), set(manifest.get("experts") or ())
        refs = [f.ref for f in other.ffns]
        sel_layers = layers if {r.layer for r in refs} - layers else None
        sel_experts = experts if {r.expert for r in refs if r.kind == "expert"} - experts else None
        if sel_layers is None and sel_experts is None:
            return None, None
        what = "; ".join(f"{k} {_spans(v)}" for k, v in (("layers", sel_layers), ("experts", sel_experts)) if v)
        report.notes.append(f"{side} is an extract of {what} (its manifest): only those FFNs are compared")
        return sel_layers, sel_experts
    return None, None


def _manifest(ckpt) -> dict | None:
    """An extract's manifest: in its config.json (a directory), or OUT.json beside a single file."""
    if "ffn_tools_manifest" in (ckpt.config or {}):
        return ckpt.config["ffn_tools_manifest"]
    beside = Path(ckpt.path).with_suffix(".json")
    try:
        return json.loads(beside.read_text()) if Path(ckpt.path).suffix == ".safetensors" else None
    except (OSError, ValueError):
        return None


def _extracts(fa: FFNSet | None, fb: FFNSet | None) -> str | None:
    """Which side is an FFN-only extract output, said as a reason; None when neither is."""
    extracts = [s for s, f in (("A", fa), ("B", fb)) if f and f.scheme.name == "ffn-tools"]
    if not extracts:
        return None
    return f"{' and '.join(extracts)} {'is an' if len(extracts) == 1 else 'are'} FFN-only extract output"


def _outside(ca, cb, fa: FFNSet, fb: FFNSet, ffn_only: bool, atol, rtol) -> OutsideResult:
    """The tensors outside the FFNs, compared; or why not (--ffn-only or a selection, an extract output)."""
    if ffn_only:
        return OutsideResult(skipped="--ffn-only, or --layers/--experts select part of the FFNs")
    extract = _extracts(fa, fb)
    if extract:
        return OutsideResult(skipped=extract)
    log.info("comparing the tensors outside the FFNs")
    elsewhere = frozenset(cb.shifts if cb.format is Format.GGUF else recorded_shifts(cb.metadata))  # compared apart
    if not all(c.format in BACKGROUND_FORMATS for c in (ca, cb)):
        return compare_outside(ca, cb, fa, fb, atol=atol, rtol=rtol, elsewhere=elsewhere)
    b_names = {n for n in cb if n not in fb.tensors and n not in elsewhere}
    steps = [[(0, n), (1, n)] for n in sorted(n for n in ca if n not in fa.tensors and n in b_names)
             if tuple(ca.info(n).shape) == tuple(cb.info(n).shape)  # the order compare_outside reads them in,
             and not in_blocks(ca.info(n), cb.info(n))]  # but those it reads from the files a block at a time
    with TensorStream((ca, cb), steps, budget=OUTSIDE_READ_AHEAD, advance=True) as stream:
        return compare_outside(Streamed(ca, stream.side(0)), Streamed(cb, stream.side(1)), fa, fb, atol=atol,
                               rtol=rtol, elsewhere=elsewhere)


def _spans(ids) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5``."""
    out, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def _check_selection(fa: FFNSet, fb: FFNSet, sel_layers: set[int] | None, sel_experts: set[int] | None) -> None:
    """Refuse layers or experts asked for that neither checkpoint has (a typo would otherwise pass quietly,
    checking less than was asked).

    Raises:
        FFNToolsError: naming the missing ones and what A and B do have.
    """
    refs = [f.ref for f in (*fa.ffns, *fb.ffns)]
    problems = []
    for option, sel, have, what in (
            ("--layers", sel_layers, {r.layer for r in refs}, "layer"),
            ("--experts", sel_experts, {r.expert for r in refs if r.kind == "expert"}, "expert")):
        missing = sel - have if sel is not None else set()
        if missing:
            held = (f"they have {what}s {_spans(have)}" if have else f"they have no routed {what}s")
            problems.append(f"{option} {_spans(sel)}: {what}{'s' * (len(missing) > 1)} {_spans(missing)} "
                            f"in neither A nor B ({held})")
    if problems:
        raise FFNToolsError("; ".join(problems))


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


def _steps(checker: PairChecker, pairs: list, bits: dict, rows: dict, every_backend: bool) -> list[Step]:
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


def _reads(items: list, computed=()) -> list[tuple[int, str]]:
    """The (side, name) of every tensor a step's pairs read, A's first, in the order they read them; not A's
    ``computed`` (``consumer.ffn_as_loaded``: read through the MLX plan, not as stored)."""
    keys = [(0, n) for _, x, _ in items for n in x.names.values() if n not in computed]
    keys += [(1, n) for *_, y in items for n in y.names.values()]
    return list(dict.fromkeys(keys))


def _check_pairs(report: VerifyReport, ca, cb, fa: FFNSet, fb: FFNSet, kernels: Job, on_reference: bool, sel_layers,
                 sel_experts, atol, rtol, exact, seed, tokens, plan: tuple | None,
                 every_backend: bool = False) -> Callable[[], None]:
    """Every FFN pair's checks (``PairChecker``), the weights streamed (``TensorStream``); ``on_reference``: the
    reference is one of the backends asked for; ``plan``: A's MLX export plan (``consumer.export_plan``). Returns what runs the kernel backends (``kernels``: the job
    resolving them) on the first FFN of each kind, which ``verify`` calls after the outside comparison."""
    for f, side in ((fa, "A"), (fb, "B")):
        if f.activation.unit == "unknown":
            raise FFNToolsError(f"activation {f.activation.config_name!r} ({side}) is not one the kernels have "
                                f"({', '.join(dict.fromkeys(k for _, k in ACTIVATIONS.values()))}); verify cannot run it")
    if (fa.activation.kernel, fa.activation.unit) != (fb.activation.kernel, fb.activation.unit):
        report.problems.append(f"activation differs: A {fa.activation.describe()}, B {fb.activation.describe()}")
    _check_selection(fa, fb, sel_layers, sel_experts)
    ra, rb = _select(fa, sel_layers, sel_experts), _select(fb, sel_layers, sel_experts)
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
    source, computed = consumer.ffn_as_loaded(ca, cb, [n for _, x, _ in pairs for n in x.names.values()], plan)
    if computed:
        checker.read_a = consumer.AsLoaded(ca, source, computed)
        report.notes.append(f"B is MLX: {len(computed)} of A's FFN tensors compared as mlx_lm's sanitize computes "
                            "them from A (the MLX export's own computation, bit for bit), not as A stores them (A "
                            f"as mlx_lm loads it): {listing(sorted(computed), 4)}")
    log.info("verifying %d FFN pairs, %d tokens, tolerance %s", len(pairs), tokens, tol.describe())

    def nbytes(x, y):
        return x.d_model * x.d_ffn * 3 * (ca.info(x.names["down"]).nbytes // (x.d_model * x.d_ffn)
                                          + cb.info(y.names["down"]).nbytes // (y.d_model * y.d_ffn))

    steps = _steps(checker, pairs, bits, rows, every_backend)
    ran: dict = {}  # the first FFN of each kind: its inputs and A's float64 output, for the kernel backends
    bar = progress.Progress(sum(nbytes(x, y) for _, x, y in pairs), "verifying FFNs")
    try:
        with TensorStream((ca, cb), [_reads(s.items, computed) for s in steps]) as stream:
            checker.read_a, checker.read_b = stream.side(0), stream.side(1)
            if computed:
                checker.read_a = consumer.AsLoaded(checker.read_a, source, computed)
            for k, step in enumerate(steps):
                if step.batched:
                    results = check_batch(checker, step.items, rows[step.items[0][0]], reference)
                else:
                    ref, x, y = step.items[0]
                    results = [checker.check(ref, x, y, rows[ref], coarsest(*bits[ref]) is not None, reference,
                                             compute_identical=step.on_all, ran=ran if step.on_all else None)]
                for (ref, x, y), res in zip(step.items, results):
                    res.bits_a, res.bits_b = bits[ref]
                    report.results.append(res)
                    bar.update(nbytes(x, y))
                stream.done(k)
    finally:
        checker.read_a, checker.read_b = (consumer.AsLoaded(ca, source, computed) if computed else ca), cb
        bar.close()
    skipped = sum(any(b.path == NOT_COMPUTED for b in r.backends) for r in report.results)
    if skipped:
        report.notes.append(
            f"{skipped} of {len(pairs)} FFNs are bit-identical to A's, finite, and on no kernel backend: their float64 "
            "reference was not computed (the same bits through the same computation give A's output, so it "
            "could only agree); their weights were checked finite instead, the one thing that run could add "
            "(--all-ffns-on-every-backend computes it)")
    quantized = [r for r in report.results if coarsest(*bits[r.ref]) is not None]
    if quantized:
        sides = " and ".join(s for s, i in (("A", 0), ("B", 1)) if any(bits[r][i] is not None for r in bits))
        which = "" if len(quantized) == len(pairs) else f" ({len(quantized)} of {len(pairs)} FFNs)"
        requantized = sum(r.exact == "identical" for r in quantized)
        report.notes.append(f"{sides} quantized{which}: " + (
            f"{requantized} FFNs are A's weights re-quantized with B's parameters, bit for bit; run dequantized"
            if requantized else "weights compared after dequantization; no bit-exact check"))
    differing = [r.ref for r in report.results if r.exact == "differs"]
    if differing:
        checker.name_owners(report, differing, rb)

    def run_kernels() -> None:
        """The first FFN of each kind on the kernel backends, read again: run last, their frameworks imported
        meanwhile, and with nothing else held (they copy the weights they run)."""
        mods, _ = kernels.result()
        others = {n: m for n, m in mods.items() if n != "reference"}
        by_ref = {r.ref: r for r in report.results}
        for ref, x, y in pairs:
            if others and ref in ran:
                checker.run_kernels(by_ref[ref], x, y, rows[ref], ran[ref], others)

    return run_kernels
