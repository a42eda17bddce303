"""``verify A B``: are two checkpoints' FFNs the same, bit for bit and as functions?

FFNs are paired by ``FFNRef`` (layer, kind, expert); one present on one side only is a failure. For each
pair: shapes and biases must match; B's weights must be finite where A's are; the canonical gate/up/down
(and biases) are compared bit for bit when both sides should be lossless copies (same dtype, neither
quantized; ``exact``), naming the first differing element and, when recognisable, the defect (swapped
gate/up, transposed down, a fused layout misread, another layer's or expert's weights); and the FFN
runs on seeded inputs: A's on the float64 reference, B's on every requested backend
(``verify_functional``), within the tolerance table of ``tolerances``. ``logits`` adds a whole-model
check through the real clients (``verify_logits``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import ExitStack

import torch

from . import progress
from .detect import FFNSet, choose_scheme, find_ffns
from .dtypes import short_name
from .errors import CheckpointError, FFNToolsError, SchemeError
from .ffn import FFN, FFNRef, canonical_weights
from .layouts import GateUpLayout
from .registry import Scheme, compile_template
from .specs import parse_spec
from .store import open_checkpoint, read_config
from .tolerances import Tolerance, tolerance_for, widened
from .verify_diagnose import Fingerprints, explain, first_difference
from .verify_functional import KERNEL_DTYPES, Operands, check_ffn, input_scale, make_inputs
from .verify_report import FFNResult, VerifyReport

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 32
_KERNEL_LAYOUTS = ("concat", "interleaved")  # what silu_mul_fused reads directly (either order, row axis)


class BackendError(FFNToolsError):
    """A requested kernel backend is unknown or cannot run on this machine."""


def resolve_backends(names: Sequence[str] | None = None) -> tuple[dict, dict[str, str]]:
    """The kernel backends to run: ``names``, or every one available here.

    Returns:
        (name -> module, reference first; name -> why it was skipped, for the unavailable defaults).

    Raises:
        BackendError: a name is unknown, or explicitly requested but unavailable (saying why).
    """
    import kernels

    skipped: dict[str, str] = {}
    if names:
        unknown = [n for n in names if n not in kernels.BACKENDS]
        if unknown:
            raise BackendError(f"unknown backend {', '.join(map(repr, unknown))}; use one of {', '.join(kernels.BACKENDS)}")
        chosen = list(dict.fromkeys(names))
        for n in chosen:
            mod = kernels.get_backend(n)
            if not mod.available():
                raise BackendError(f"backend {n!r} is not available here: {mod.why_unavailable()}")
    else:
        chosen = []
        for n in kernels.BACKENDS:
            mod = kernels.get_backend(n)
            (chosen.append(n) if mod.available() else skipped.__setitem__(n, mod.why_unavailable()))
    chosen.sort(key=lambda n: n != "reference")
    return {n: kernels.get_backend(n) for n in chosen}, skipped


class _Cached:
    """A checkpoint mapping that keeps the last few tensors read (stacked experts share one tensor)."""

    def __init__(self, ckpt, size: int = 4):
        self.ckpt, self.size, self._cache = ckpt, size, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            if len(self._cache) >= self.size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[name] = self.ckpt[name]
        return self._cache[name]

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt


def _open(path, side: str):
    """(checkpoint, None), or (None, problem) when the files are there but their content cannot be read
    (a failed conversion: say an MLX config whose group size does not fit its scales).

    Raises:
        FFNToolsError: there is no checkpoint at ``path`` at all.
    """
    from converters import open_any

    try:
        return open_any(path), None
    except CheckpointError as e:
        try:
            open_checkpoint(path).close()  # plain weight files are there: what they hold is wrong
        except FFNToolsError:
            raise e from None
        return None, f"{side} cannot be read: {e}"


def _find(ckpt, side: str, scheme: Scheme | None, layout: GateUpLayout | None) -> tuple[FFNSet | None, str | None]:
    """B's (or A's) FFNs, or (None, problem) when its FFN tensors exist but are inconsistent.

    Raises:
        SchemeError: no FFN tensors at all (nothing to verify: a usage problem, not a difference).
    """
    names = list(ckpt)
    if scheme is None:
        scheme = choose_scheme(names, ckpt.config)
    elif not any(compile_template(t).fullmatch(n) for g in scheme.groups for f in g.forms.values()
                 for t in f.templates().values() for n in names):
        raise SchemeError(f"{side} ({ckpt.path}): no tensor matches scheme {scheme.name!r}")
    try:
        return find_ffns(ckpt, scheme, layout), None
    except SchemeError as e:
        return None, f"{side}'s FFN tensors are inconsistent: {e}"


def quantization(ckpt) -> dict | None:
    """The MLX-style ``quantization`` (or ``quantization_config``) block of the config.json on disk.

    Read from the file, not ``ckpt.config``: readers that dequantize drop the block from the view.
    """
    try:
        config = read_config(ckpt.root) or {}
    except CheckpointError:
        config = {}
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if isinstance(q, dict) and isinstance(q.get("bits"), int):
            return q
    return None


def _side(ckpt, ffns: FFNSet | None) -> dict:
    q = quantization(ckpt)
    dtype = short_name(ckpt.info(ffns.ffns[0].names["down"]).dtype) if ffns and ffns.ffns else None
    return {"path": str(ckpt.path), "format": ckpt.format, "scheme": ffns.scheme.name if ffns else None,
            "dtype": dtype, "activation": ffns.activation.describe() if ffns else None,
            "quantization": (f"{q.get('bits')}-bit group {q.get('group_size')}" if isinstance(q, dict) else None),
            "ffns": len(ffns.ffns) if ffns else 0}


def _select(ffns: FFNSet, layers: set[int] | None, experts: set[int] | None) -> dict[FFNRef, FFN]:
    return {r: f for r, f in ffns.by_ref().items() if (layers is None or r.layer in layers)
            and (experts is None or r.kind != "expert" or r.expert in experts)}


def _operands(cached, ffn: FFN, w: dict[str, torch.Tensor], activation: str) -> Operands:
    biases = {r.removesuffix("_bias"): t for r, t in w.items() if r.endswith("_bias")}
    fused = None
    lay = ffn.layout
    if ffn.form.fused and lay.arrangement in _KERNEL_LAYOUTS and lay.axis == "rows":
        def raw(role):
            t = cached[ffn.names[role]]
            return t[ffn.index] if ffn.index is not None else t
        fused = (raw("gate_up"), raw("gate_up_bias") if "gate_up_bias" in ffn.names else None, lay)
    return Operands(w["gate"], w["up"], w["down"], biases, activation, fused)


def _biases(res: FFNResult, wa: dict, wb: dict) -> None:
    """Bias presence: a failure whatever the dtypes."""
    ba, bb = sorted(r for r in wa if r.endswith("_bias")), sorted(r for r in wb if r.endswith("_bias"))
    if ba != bb:
        lacks = [r for r in ba if r not in bb]
        extra = [r for r in bb if r not in ba]
        res.problems.append("biases differ: " + "; ".join(
            ([f"B lacks {', '.join(lacks)}"] if lacks else []) + ([f"B has extra {', '.join(extra)}"] if extra else [])))


def _nonfinite(res: FFNResult, wa: dict, wb: dict) -> None:
    """Which of B's weights hold inf/nan where A's are finite. Run only when B's outputs are non-finite
    (a scan of every weight costs as much as the reference's GEMMs; any inf/nan weight shows in the output)."""
    for role, t in wb.items():
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad and (role not in wa or torch.isfinite(wa[role]).all()):
                res.problems.append(f"B's {role} has {bad} inf/nan values where A's are finite "
                                    f"(overflow in a cast to {short_name(t.dtype)}?)")


def _exact(res: FFNResult, wa: dict, wb: dict, mode: bool | None, quantized: bool, fused_b) -> bool:
    """Bit-for-bit check per ``mode`` (None: where lossless). Returns True when the FFN differs."""
    if mode is False:
        return False
    dtypes = {t.dtype for t in (*wa.values(), *wb.values())}
    why = "B or A is quantized" if quantized else (
        f"dtypes differ (A {res.dtype_a}, B {res.dtype_b})" if len(dtypes) > 1 else None)
    if why:
        res.exact = "impossible" if mode else "skipped"
        if mode:
            res.problems.append(f"--exact: cannot be bit-identical: {why}")
        return False
    diffs = [d for r in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
             if r in wa and r in wb and (d := first_difference(r, wa[r], wb[r]))]
    res.exact = "differs" if diffs else "identical"
    if diffs:
        hints = explain(wa, wb, fused_b)
        res.problems.append(f"not bit-identical: {diffs[0]}" + (f" ({len(diffs) - 1} more tensor{'s' * (len(diffs) > 2)} differ{'s' * (len(diffs) == 2)})" if len(diffs) > 1 else "")
                            + "".join(f"; {h}" for h in hints))
    return bool(diffs)


def verify(a, b, *, backends: Sequence[str] | None = None, tokens: int = DEFAULT_TOKENS, seed: int = 0,
           layers: str | None = None, experts: str | None = None, atol: float | None = None,
           rtol: float | None = None, exact: bool | None = None, logits: bool = False,
           scheme: Scheme | None = None, layout: GateUpLayout | None = None) -> VerifyReport:
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

    Returns:
        The report; ``report.passed`` is the verdict.

    Raises:
        FFNToolsError: unreadable checkpoints, no FFNs, an unknown or unavailable backend, an empty
            selection, an activation the kernels do not have, --logits on a checkpoint without a client.
    """
    if tokens < 1:
        raise FFNToolsError(f"--tokens {tokens}: need at least 1 token")
    mods, skipped = resolve_backends(backends)
    sel_layers = parse_spec(layers) if layers else None
    sel_experts = parse_spec(experts) if experts else None
    with ExitStack() as stack:
        opened = []
        for path, side in ((a, "A"), (b, "B")):
            c, e = _open(path, side)
            opened.append((c and stack.enter_context(c), e))
        (ca, ea), (cb, eb) = opened
        if ea or eb:
            return VerifyReport({"path": str(a)}, {"path": str(b)}, list(mods), skipped, tokens, seed, None,
                                problems=[e for e in (ea, eb) if e])
        clients = None
        if logits:
            from .verify_logits import client_for

            clients = (client_for(ca, "A"), client_for(cb, "B"))
        (fa, pa), (fb, pb) = _find(ca, "A", scheme, layout), _find(cb, "B", scheme, layout)
        report = VerifyReport(_side(ca, fa), _side(cb, fb), list(mods), skipped, tokens, seed, None)
        report.problems += [p for p in (pa, pb) if p]
        if fa and fb:
            _check_pairs(report, ca, cb, fa, fb, mods, sel_layers, sel_experts, atol, rtol, exact, seed, tokens)
    if logits:
        from .verify_logits import compare_logits

        tol = widened(report.tolerance or tolerance_for([], None, atol=atol, rtol=rtol))
        report.logits = compare_logits(a, b, clients, tol, seed)
    return report


def _check_pairs(report: VerifyReport, ca, cb, fa: FFNSet, fb: FFNSet, mods, sel_layers, sel_experts,
                 atol, rtol, exact, seed, tokens) -> None:
    for f in (fa, fb):
        if f.activation.unit == "unknown":
            raise FFNToolsError(f"activation {f.activation.config_name!r} ({'A' if f is fa else 'B'}) is not one the "
                                "kernels have (silu, gelu, gelu_tanh); verify cannot run it")
    if (fa.activation.kernel, fa.activation.unit) != (fb.activation.kernel, fb.activation.unit):
        report.problems.append(f"activation differs: A {fa.activation.describe()}, B {fb.activation.describe()}")
    ra, rb = _select(fa, sel_layers, sel_experts), _select(fb, sel_layers, sel_experts)
    if not ra and not rb:
        raise FFNToolsError(f"--layers {sel_layers and sorted(sel_layers)} --experts {sel_experts and sorted(sel_experts)} "
                            f"selects no FFN (A has layers {fa.ffns[0].ref.layer}-{fa.ffns[-1].ref.layer})")
    report.only_a = [str(r) for r in sorted(set(ra) - set(rb))]
    report.only_b = [str(r) for r in sorted(set(rb) - set(ra))]
    pairs = [(r, ra[r], rb[r]) for r in sorted(set(ra) & set(rb))]
    if not pairs:
        report.problems.append(f"A and B have no FFN in common (A: {len(ra)} FFNs under scheme {fa.scheme.name}, "
                               f"B: {len(rb)} under {fb.scheme.name}): different models?")
        return
    qa, qb = ((q or {}).get("bits") for q in (quantization(ca), quantization(cb)))
    quant = min((q for q in (qa, qb) if q is not None), default=None)
    dtypes = {ca.info(x.names["down"]).dtype for _, x, _ in pairs} | {cb.info(y.names["down"]).dtype for _, _, y in pairs}
    unsupported = sorted(short_name(d) for d in dtypes if d not in KERNEL_DTYPES)
    if unsupported:
        report.notes.append(f"{', '.join(unsupported)} weights run as float32 (the kernels take float32/16, bfloat16)")
    tol = report.tolerance = tolerance_for(dtypes, quant, atol=atol, rtol=rtol)
    if quant is not None:
        report.notes.append(f"quantized ({'A' if qa else ''}{' and ' if qa and qb else ''}{'B' if qb else ''}): "
                            "weights compared after dequantization; no bit-exact check")
    cached_a, cached_b = _Cached(ca), _Cached(cb)
    total = sum(x.d_model * x.d_ffn * 3 * (ca.info(x.names["down"]).dtype.itemsize + cb.info(y.names["down"]).dtype.itemsize)
                for _, x, y in pairs)
    bar = progress.Progress(total, "verifying FFNs")
    differing: list[FFNRef] = []
    try:
        for ref, x, y in pairs:
            res = _check_one(ref, x, y, cached_a, cached_b, ca, cb, fa, fb, mods, tol, exact, quant is not None,
                             seed, tokens)
            if res.exact == "differs":
                differing.append(ref)
            report.results.append(res)
            bar.update(x.d_model * x.d_ffn * 3 * (ca.info(x.names["down"]).dtype.itemsize
                                                   + cb.info(y.names["down"]).dtype.itemsize))
    finally:
        bar.close()
    if differing:
        _cross_check(report, differing, ca, cb, fa, rb)


def _check_one(ref, x: FFN, y: FFN, cached_a, cached_b, ca, cb, fa, fb, mods, tol: Tolerance, exact, quantized,
               seed, tokens) -> FFNResult:
    res = FFNResult(ref, (x.d_model, x.d_ffn), (y.d_model, y.d_ffn), short_name(ca.info(x.names["down"]).dtype),
                    short_name(cb.info(y.names["down"]).dtype))
    if res.shape_a != res.shape_b:
        res.problems.append(f"shapes differ: A has d_model {x.d_model}, d_ffn {x.d_ffn}; B has d_model {y.d_model}, "
                            f"d_ffn {y.d_ffn} (different models?)")
        return res
    wa, wb = canonical_weights(cached_a, x), canonical_weights(cached_b, y)
    _biases(res, wa, wb)
    ops_a = _operands(cached_a, x, wa, fa.activation.kernel)
    ops_b = _operands(cached_b, y, wb, fb.activation.kernel)
    fused_b = (ops_b.fused[0], y.layout) if ops_b.fused else (
        (cached_b[y.names["gate_up"]] if y.index is None else cached_b[y.names["gate_up"]][y.index], y.layout)
        if y.form.fused else None)
    _exact(res, wa, wb, exact, quantized, fused_b)
    if fused_b is not None and y.layout.axis == "rows" and not ops_b.fused:
        res.notes.append(f"B's fused layout {y.layout.describe()} ran through ffn() on split weights")
    scale = input_scale(ops_a.gate)
    inputs = make_inputs(tokens, x.d_model, seed, scale, [t.dtype for t in (*wa.values(), *wb.values())])
    res.backends = check_ffn(mods, inputs, ops_a, ops_b, tol, identical=res.exact == "identical")
    if any(b.nonfinite for b in res.backends):
        _nonfinite(res, wa, wb)
    return res


def _cross_check(report: VerifyReport, differing: list[FFNRef], ca, cb, fa: FFNSet, rb: dict) -> None:
    """Name the A FFN whose weights a differing B FFN holds (layers shifted, experts permuted)."""
    prints = Fingerprints()
    for ref, f in fa.by_ref().items():
        prints.add(ref, canonical_weights(ca, f))
    by_ref = {r.ref: r for r in report.results}
    for ref in differing:
        owner = prints.whose(canonical_weights(cb, rb[ref]))
        if owner is not None and owner != ref:
            by_ref[ref].problems.append(f"B's {ref} holds A's {owner} weights")
