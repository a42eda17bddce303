"""The checks of one FFN present in both checkpoints: shapes, biases, bit-exactness, the functional run.

``PairChecker`` holds what every pair shares (the two checkpoints and their FFN sets, the backends, the
exact-check mode, the input seed) and ``check(ref, a_ffn, b_ffn, tol, quantized)`` returns its
``FFNResult`` (the tolerance row is per FFN: mixed quantization recipes give layers different bits).
It reads tensors through ``read_a`` / ``read_b``: the checkpoints themselves, or the ``stream`` that reads the
next pairs ahead and holds each tensor only while a pair needs it (``reading``). A pair ``from_pages``
says is too large to hold whole is read instead through ``raw_a`` / ``raw_b`` (views of the files' mapped pages,
``io.mapped``): its roles compared one pair at a time and its float64 runs block by block, the pages let go after
each (``_let_go``).
``name_owners`` runs after all pairs, only when some differed, to say which of A's FFNs a differing B FFN
actually holds.

Where B's FFN is A's bit for bit and no kernel backend runs it (``compute_identical=False``: all but the first
FFN of each kind), its float64 reference is not computed: the same bits through the same float64 computation
give A's output, so the comparison could only find B equal to A. What that run could still show, a non-finite
output, comes only from a non-finite weight, so the weights are checked finite instead (a pass over their
bytes, not the four GEMM-sized conversions and products of the reference); a non-finite one runs the reference
as before, which reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..detect import FFNSet
from ..io.dtypes import short_name
from ..ffn import FFN, FFNRef, canonical_weights
from ..layouts import fuse
from ..io.store import Checkpoint
from ..registry import CANONICAL_ROLES
from ..tolerances import Tolerance
from .kept import difference, kept_side
from ..checks.diagnose import Fingerprints, explain, first_difference
from .functional import (Operands, all_finite, check_ffn, input_scale, make_inputs, nonfinite_values,
                         not_computed, reference_backend, run_reference)
from ..quant import DIFFERS, IDENTICAL
from .quant import ffn_bits, quantization
from .report import FFNResult, VerifyReport
from .stored import candidates, same_bytes

STORED_NOTE = ("stored bytes identical: B stores A's quantized parts (codes and scales), byte for byte; compared "
               "as bytes, nothing dequantized for the comparison")
PLAIN_NOTE = "stored bytes identical: compared as views of the files' pages, nothing copied"

KERNEL_LAYOUTS = ("concat", "interleaved")  # what silu_mul_fused reads directly (either order, row axis)
ROLES = CANONICAL_ROLES  # gate, up, down and their biases
STORED = ("gate", "up", "gate_up", "down")  # weight roles as an FFN stores them


@dataclass
class PairChecker:
    """Checks pairs of FFNs, A's against B's (see the module docstring)."""

    ca: Checkpoint
    cb: Checkpoint
    fa: FFNSet
    fb: FFNSet
    backends: dict  # name -> kernels module, "reference" first
    exact: bool | None  # True demand, False skip, None where lossless
    seed: int
    tokens: int
    bytes_first: Callable[[FFN, FFN], bool] | None = None  # pairs compared as stored bytes first (``candidates``)
    from_pages: Callable[[FFN, FFN], bool] = lambda x, y: False  # read from raw_a/raw_b's mapped pages, by parts
    a_view: Callable[[Mapping], Mapping] = lambda m: m  # A's tensors as B's client holds them, read through a mapping

    def __post_init__(self) -> None:
        self.read_a: Mapping = self.a_view(self.ca)  # what tensors are read through (``reading``: a read-ahead stream)
        self.read_b: Mapping = self.cb
        self.raw_a: Mapping = self.ca.stored  # the stored tensors, for comparing stored bytes (``stored``)
        self.raw_b: Mapping = self.cb.stored
        self.as_bytes: Callable[[FFN, FFN], bool] = (self.bytes_first if self.bytes_first is not None
                                                     else lambda x, y: candidates(self.ca, self.cb, x, y))
        self._bits = tuple((quantization(c) or {}).get("bits") for c in (self.ca, self.cb))  # global, as the engine

    @contextmanager
    def reading(self, read: tuple[Mapping, Mapping], raw: tuple[Mapping, Mapping]) -> Iterator[None]:
        """Tensors read through ``read`` (A's through ``a_view``) and stored bytes through ``raw`` meanwhile; the
        checkpoints themselves again after."""
        self.read_a, self.read_b = self.a_view(read[0]), read[1]
        self.raw_a, self.raw_b = raw
        try:
            yield
        finally:
            self.read_a, self.read_b = self.a_view(self.ca), self.cb
            self.raw_a, self.raw_b = self.ca.stored, self.cb.stored

    def check(self, ref: FFNRef, x: FFN, y: FFN, tol: Tolerance, quantized: bool,
              backends: dict | None = None, compute_identical: bool = True,
              ran: dict[FFNRef, tuple[torch.Tensor, torch.Tensor]] | None = None) -> FFNResult:
        """Every check of A's FFN ``x`` against B's FFN ``y``, within ``tol`` (this FFN's row); ``quantized``:
        A's or B's is, so it cannot be bit-exact; ``backends``: the ones this FFN runs on (default: all);
        ``compute_identical``: run the float64 reference even where B's weights are A's bit for bit (False:
        not, when they are all finite; see the module docstring); ``ran``: where to keep the inputs and A's
        float64 output (``ran[ref]``) for ``run_kernels``."""
        res = FFNResult(ref, (x.d_model, x.d_ffn), (y.d_model, y.d_ffn),
                        short_name(self.ca.info(x.names["down"]).st_dtype),
                        short_name(self.cb.info(y.names["down"]).st_dtype), tolerance=tol)
        if res.shape_a != res.shape_b:
            res.problems.append(f"shapes differ: A has d_model {x.d_model}, d_ffn {x.d_ffn}; B has d_model "
                                f"{y.d_model}, d_ffn {y.d_ffn} (different models?)")
            return res
        backends = self.backends if backends is None else backends
        same_stored, defect = None, None
        if self.exact is not False and self.as_bytes(x, y):
            same_stored, why, finite, defect = same_bytes(self.ca, self.cb, self.raw_a, self.raw_b, x, y)
            if same_stored:
                res.exact = "identical"
                res.notes.append(STORED_NOTE if quantized else PLAIN_NOTE)
                same_activation = self.fa.activation.kernel == self.fb.activation.kernel
                if not compute_identical and same_activation and finite:
                    res.backends = [not_computed()] if "reference" in backends else []
                    return res
                if set(backends) <= {"reference"} and same_activation:
                    return self._run_as_a(res, ref, x, y, tol, backends, ran)
            elif defect:  # a scale changed under A's codes: no rounding (stored.scale_defect)
                res.problems.append(defect)
            elif same_stored is False and quantized:  # (unquantized: the bit-exact check below says how)
                res.notes.append(f"stored bytes differ ({why}): compared dequantized, within the tolerance row")
        paged = self.from_pages(x, y)
        read_a, read_b = (self.raw_a, self.raw_b) if paged else (self.read_a, self.read_b)
        let_go = self._let_go if paged else None
        wa, wb = canonical_weights(read_a, x), canonical_weights(read_b, y)
        _biases(res, wa, wb)
        ops_b = _operands(read_b, y, wb, self.fb.activation.kernel)
        ops_b.release = let_go
        stored = None
        stored_a: Callable[[], tuple] | None = None
        if y.form.fused:  # B's gate_up as stored, for naming a misread layout
            stored = (self._raw(read_b, y, "gate_up"), y.layout)
            if not ops_b.fused and y.layout.axis == "rows":
                res.notes.append(f"B's fused layout {y.layout.describe()} ran through ffn() on split weights")
        elif x.form.fused:  # A's, read only to name B's gate and up split in another layout
            stored_a = lambda: (self._raw(read_a, x, "gate_up"), x.layout)  # noqa: E731
        kept = quantized and self.exact is None and not same_stored and self._kept(res, x, y)
        requantized = kept or (quantized and self.exact is None and not same_stored
                               and self._requantized(res, wa, wb, x, y))
        if not requantized and not same_stored:
            self._exact(res, wa, wb, stored, quantized, let_go, stored_a)
        if defect:
            res.exact = "differs"
        same_as_a = res.exact == "identical" and not requantized and self.fa.activation.kernel == ops_b.activation
        if same_as_a and not compute_identical and all_finite(wa.values(), let_go):
            res.backends = [not_computed()] if "reference" in backends else []
            return res
        if not backends and ran is None:  # nothing runs it (--backend names no reference, not its kind's first)
            return res
        inputs, r = self._run_a(ref, x, wa, [t.dtype for t in (*wa.values(), *wb.values())], backends, ran,
                                read_a, let_go)
        res.backends = check_ffn(backends, inputs, r, ops_b, tol, same_as_a=same_as_a)
        if any(b.nonfinite for b in res.backends):
            _nonfinite(res, wa, wb)
        return res

    def _run_as_a(self, res: FFNResult, ref: FFNRef, x: FFN, y: FFN, tol: Tolerance, backends: dict,
                  ran: dict | None) -> FFNResult:
        """B's FFN stores A's bytes and only the reference runs it now (the first FFN of its kind: the kernel
        backends run it later, ``run_kernels``): A's output is computed, B's on the reference is A's by construction,
        so B's weights are not read at all; one FFN's weights held, not the pair (a Llama-70B FFN is 1.4 GB a side
        in bf16). B's are read only to name a non-finite weight."""
        paged = self.from_pages(x, y)
        read_a = self.raw_a if paged else self.read_a
        wa = canonical_weights(read_a, x)
        if not backends and ran is None:
            return res
        dtypes = [t.dtype for t in wa.values()]
        inputs, r = self._run_a(ref, x, wa, dtypes + dtypes, backends, ran,  # B's dtypes are A's: the same bytes
                                read_a, self._let_go if paged else None)
        res.backends = check_ffn(backends, inputs, r, None, tol, same_as_a=True)
        if any(b.nonfinite for b in res.backends):
            _nonfinite(res, wa, canonical_weights(self.read_b, y))
        return res

    def _run_a(self, ref: FFNRef, x: FFN, wa: dict, dtypes: list, backends: dict, ran: dict | None,
               read_a: Mapping | None = None,
               let_go: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A's FFN ``x`` (weights ``wa``, read through ``read_a``: ``self.read_a`` unless given) on the float64
        reference, on seeded inputs made for ``dtypes``: (the inputs, A's output), kept in ``ran[ref]`` for the
        kernel backends where given; ``let_go``: the weights are views of mapped pages, let go block by block."""
        inputs = make_inputs(self.tokens, x.d_model, self.seed, input_scale(wa["gate"]), dtypes)
        ops = _operands(self.read_a if read_a is None else read_a, x, wa, self.fa.activation.kernel)
        ops.release = let_go
        r = run_reference(backends.get("reference") or reference_backend(), inputs, ops)
        if ran is not None:
            ran[ref] = (inputs, r)
        return inputs, r

    def run_kernels(self, res: FFNResult, x: FFN, y: FFN, tol: Tolerance, ran: tuple[torch.Tensor, torch.Tensor],
                    backends: dict) -> None:
        """B's FFN ``y`` on the kernel ``backends`` against A's float64 output, on the inputs ``check`` kept
        (``ran``), within ``tol``, appended to ``res``. ``verify`` runs them after every pair's weights are checked: their
        frameworks copy the weights, so nothing else is held then, and their imports overlap the checks."""
        inputs, r = ran
        wb = canonical_weights(self.read_b, y)
        ops_b = _operands(self.read_b, y, wb, self.fb.activation.kernel)
        flagged = any(b.nonfinite for b in res.backends)  # the reference's run has named B's non-finite weights
        res.backends += check_ffn(backends, inputs, r, ops_b, tol)
        if not flagged and any(b.nonfinite for b in res.backends):
            _nonfinite(res, canonical_weights(self.read_a, x), wb)

    @staticmethod
    def _raw(cached, ffn: FFN, role: str) -> torch.Tensor:
        t = cached[ffn.names[role]]
        return t[ffn.index] if ffn.index is not None else t

    def _let_go(self) -> None:
        """The pages the mapped views (``raw_a``, ``raw_b``) touched so far, let go; the views stay usable."""
        for read in (self.raw_a, self.raw_b):
            if hasattr(read, "release"):
                read.release(done=False)

    def _exact(self, res: FFNResult, wa: dict, wb: dict, stored, quantized: bool,
               let_go: Callable[[], None] | None = None, stored_a: Callable[[], tuple] | None = None) -> None:
        """Bit-for-bit comparison of the canonical tensors, per ``self.exact``; ``let_go``: run after each role
        (the weights are views of mapped pages: one role pair held at a time); ``stored_a``: A's fused gate_up and
        its layout, read where they differ (``explain``)."""
        if self.exact is False:
            return
        common = [r for r in ROLES if r in wa and r in wb]
        mixed = [r for r in common if wa[r].dtype != wb[r].dtype]
        why = "A or B is quantized" if quantized else (
            f"dtypes differ ({mixed[0]}: A {short_name(wa[mixed[0]].dtype)}, B {short_name(wb[mixed[0]].dtype)})"
            if mixed else None)
        if why:
            res.exact = "impossible" if self.exact else "skipped"
            if self.exact:
                res.problems.append(f"--exact: cannot be bit-identical: {why}")
            return
        diffs = []
        for r in common:
            if d := first_difference(r, wa[r], wb[r]):
                diffs.append(d)
            if let_go is not None:
                let_go()
        res.exact = "differs" if diffs else "identical"
        if diffs:
            more = len(diffs) - 1
            res.problems.append(f"not bit-identical: {diffs[0]}"
                                + (f" ({more} more tensor{'s' * (more > 1)} differ{'s' * (more == 1)})" if more else "")
                                + "".join(f"; {h}" for h in explain(wa, wb, stored, stored_a and stored_a())))

    def _kept(self, res: FFNResult, x: FFN, y: FFN) -> bool:
        """Where one side says its FFN's tensors hold the other side's stored codes (``kept``): their values
        against the codes', exactly (``exact`` "codes", or "differs" with the first difference). False where
        neither side says so of this FFN."""
        sides = {r: s for r in STORED if r in x.names and r in y.names
                 and (s := kept_side(self.ca, self.cb, x.names[r], y.names[r])) is not None}
        if not sides:
            return False
        diffs, unsure = [], []
        for r, (k, q) in sides.items():
            (kc, kf), (qc, qf) = ((self.read_b, y), (self.ca, x)) if k == "B" else ((self.read_a, x), (self.cb, y))
            if kf.index is not None or qf.index is not None:  # one expert of a stack: its parts are not one module
                unsure.append(f"{r}: codes kept, of one expert of a stacked tensor: compared within the tolerance row")
                continue
            same, why = difference(f"{r} ({kf.names[r]})", qc, qf.names[r], kc[kf.names[r]], k, q)
            if same is None:
                unsure.append(why or "")
            elif not same:
                diffs.append(why or "")
        if diffs:
            res.exact = "differs"
            more = f" ({len(diffs) - 1} more tensors differ)" if len(diffs) > 1 else ""
            res.problems.append(diffs[0] + more)
        elif unsure:
            res.notes += unsure
            return False
        else:
            k, q = next(iter(sides.values()))
            res.exact = "codes"
            res.notes.append(f"codes kept: {k}'s {', '.join(sides)} hold {q}'s stored codes, scales and zero points: "
                             f"their values are the ones {q}'s codes define, every one, exactly")
        return True

    def _requantized(self, res: FFNResult, wa: dict, wb: dict, x: FFN, y: FFN) -> bool:
        """Where one side's FFN is quantized and the other's is not: each tensor the quantized side stores against
        the other side's re-quantized with the stored parameters, where its scheme can re-derive its codes
        (``QuantScheme.requantized``), or cast (bits compared where that side left it unquantized). ``exact`` is
        "requantized" only when every one is. False where this does not apply (both or neither quantized, or no
        stored part to compare)."""
        qa, qb = (ffn_bits(c, f, bits) is not None for c, f, bits in ((self.ca, x, self._bits[0]),
                                                                        (self.cb, y, self._bits[1])))
        if qa == qb:
            return False
        side, f, w, src, q = (self.cb, y, wa, "A", "B") if qb else (self.ca, x, wb, "B", "A")
        roles = [r for r in (*STORED, *(r for r in f.names if r.endswith("_bias"))) if r in f.names]
        mods = {r: side.quantized(f.names[r]) for r in roles}
        parts = {r: self._parts(side, f, r, mods[r]) for r in roles}
        if not any(parts.values()):
            return False
        scheme = next(m.scheme for m in mods.values() if m is not None)
        diffs: list[str] = []
        unsure: list[str] = []
        which: list[str] = []
        for r in roles:
            a = _as_stored(w, r, f)
            if a is None:  # a bias the other side lacks: _biases says so
                continue
            if parts[r] is None and mods[r] is not None:  # read back from quantized tensors its client computed
                unsure.append(f"{r} ({f.names[r]}): read back from quantized tensors {q}'s client computed; "
                              "compared within the quantized tolerance, not bit for bit")
                continue
            if parts[r] is None:
                b = self._raw(self.read_b if qb else self.read_a, f, r)
                d = first_difference(r, a, b) if a.dtype == b.dtype else scheme.recast_difference(r, a, b)
                diffs += [f"not bit-identical: {d}"] if d else []
                which += [r] if d else []
                continue
            m = mods[r]
            if m is None:  # unreachable: parts are read only where a module is
                continue
            outcome, why = m.scheme.requantized(f"{r} ({f.names[r]})", a, m, parts[r], src, q)
            (diffs if outcome == DIFFERS else unsure).extend([why] if why else [])
            which += [r] if outcome == DIFFERS else []
        swapped = [f"{q}'s {r} is {src}'s {other} re-quantized" for r, other in (("gate", "up"), ("up", "gate"))
                   if diffs and parts.get(r) and (o := _as_stored(w, other, f)) is not None
                   and (m := mods[r]) is not None and m.scheme.requantized(r, o, m, parts[r], src, q)[0] == IDENTICAL]
        if diffs:
            res.exact = "differs"
            also = f" ({', '.join(which[1:])} differ{'s' * (len(which) == 2)} too)" if len(which) > 1 else ""
            res.problems.append(diffs[0] + also + "".join(f"; {h}" for h in swapped))
        elif unsure:
            res.notes += unsure
        else:
            res.exact = "requantized"  # the stored codes are the other side's weight quantized: not the same bits
            p = next(m for r in roles if parts[r] is not None and (m := mods[r]) is not None)
            res.notes.append(p.scheme.requantized_note(p, [r for r in roles if parts[r]], src, q))
        return True

    @staticmethod
    def _parts(side, f: FFN, role: str, m):
        """``side``'s stored parts of ``role`` as its scheme reads them (this expert's slice of a stack); None:
        stored unquantized, or not as one module."""
        parts = side.quantized_parts(f.names[role]) if m is not None else None
        if parts is None or f.index is None:
            return parts
        return m.scheme.slice_parts(parts, f.index)

    def name_owners(self, report: VerifyReport, differing: list[FFNRef], rb: dict[FFNRef, FFN]) -> None:
        """For each differing B FFN that holds another A FFN's weights, say whose (layers shifted, experts
        permuted). Reads A's FFNs once more: it runs only when something differed."""
        prints = Fingerprints()
        for ref, f in self.fa.by_ref().items():
            prints.add(ref, canonical_weights(self.ca, f))
        by_ref = {r.ref: r for r in report.results}
        for ref in differing:
            owner = prints.whose(canonical_weights(self.cb, rb[ref]))
            if owner is not None and owner != ref:
                by_ref[ref].problems.append(f"B's {ref} holds A's {owner} weights")


def _as_stored(w: dict, role: str, ffn: FFN):
    """A's canonical weights ``w`` arranged as ``ffn`` stores ``role`` (fused, transposed: the inverse of
    ``canonical_weights``, exact); None where A lacks them (a bias)."""
    bias = role.endswith("_bias")
    names = ("gate" + role[7:], "up" + role[7:]) if role.startswith("gate_up") else (role,)
    if any(n not in w for n in names):
        return None
    ts = [w[n].T if ffn.form.transposed and not bias else w[n] for n in names]
    return (fuse(ts[0], ts[1], ffn.layout, is_bias=bias) if len(ts) == 2 else ts[0]).contiguous()


def _operands(cached, ffn: FFN, w: dict[str, torch.Tensor], activation: str) -> Operands:
    biases = {r.removesuffix("_bias"): t for r, t in w.items() if r.endswith("_bias")}
    fused = None
    lay = ffn.layout
    if ffn.form.fused and lay.arrangement in KERNEL_LAYOUTS and lay.axis == "rows" and "gate_bias" not in ffn.names:
        bias = PairChecker._raw(cached, ffn, "gate_up_bias") if "gate_up_bias" in ffn.names else None
        fused = (PairChecker._raw(cached, ffn, "gate_up"), bias, lay)
    return Operands(w["gate"], w["up"], w["down"], biases, activation, fused)


def _biases(res: FFNResult, wa: dict, wb: dict) -> None:
    """Bias presence: a failure whatever the dtypes."""
    ba, bb = sorted(r for r in wa if r.endswith("_bias")), sorted(r for r in wb if r.endswith("_bias"))
    if ba != bb:
        lacks, extra = [r for r in ba if r not in bb], [r for r in bb if r not in ba]
        parts = [f"B lacks {', '.join(lacks)}"] if lacks else []
        parts += [f"B has extra {', '.join(extra)}"] if extra else []
        res.problems.append("biases differ: " + "; ".join(parts))


def _nonfinite(res: FFNResult, wa: dict, wb: dict) -> None:
    """Which of B's weights hold inf/nan where A's are finite. Run only when B's outputs are non-finite
    (a scan of every weight costs as much as the reference's GEMMs; any inf/nan weight shows in the output)."""
    for role, t in wb.items():
        if t.is_floating_point() and (bad := nonfinite_values(t)) and (role not in wa or torch.isfinite(wa[role]).all()):
            res.problems.append(f"B's {role} has {bad} where A's are finite")
