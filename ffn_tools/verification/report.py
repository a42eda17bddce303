"""What ``verify`` found: per-FFN results, and their rendering as a table (worst first) or JSON."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..checks import as_json
from ..errors import listing
from ..ffn import FFNRef
from ..tolerances import Tolerance

if TYPE_CHECKING:
    from ..checks.agreement import AgreementResult
    from ..checks.config import ConfigResult
    from ..checks.load import LoadCheck
    from ..checks.outside import OutsideResult
    from ..checks.side_files import SideFilesResult
    from ..checks.tokens import TokenizationResult

MAX_ROWS = 40  # passing rows beyond this are summarised in one line (--json has them all)
# The paths of B's float64 reference result where it was not run (``functional``): its weights are A's bit for bit
SAME_AS_A = "ffn (float64) = A's output: bit-identical weights"
NOT_COMPUTED = "not computed: bit-identical, finite weights, so B's float64 output is A's"


@dataclass
class BackendResult:
    """B's FFN on one backend against A's float64 reference.

    Attributes:
        backend: the kernels backend name.
        path: how B's FFN ran: "ffn" (separate weights through ``ffn()``) or "fused <layout>" (one GEMM
            into ``silu_mul_fused`` reading gate and up out of the fused activation).
        max_abs: max |b - r|.
        max_rel: max |b - r| / max |r|.
        cosine: cosine similarity of the flattened outputs.
        ratio: max of |b - r| / (atol·rms(r) + rtol·|r|): at most 1 passes.
        nonfinite: count of inf/nan outputs.
        passed: within tolerance, cosine high enough, all finite.
        seconds: wall time of the backend call.
    """

    backend: str
    path: str
    max_abs: float
    max_rel: float
    cosine: float
    ratio: float
    nonfinite: int
    passed: bool
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in vars(self).items()}


@dataclass
class FFNResult:
    """Everything checked for one FFN present in both checkpoints."""

    ref: FFNRef
    shape_a: tuple[int, int]  # (d_model, d_ffn)
    shape_b: tuple[int, int]
    dtype_a: str
    dtype_b: str
    exact: str = "skipped"  # "identical" | "requantized" (the stored codes: the other's re-quantized) | "codes" (the
    # other's stored codes kept: values equal exactly) | "differs"
    # | "skipped" | "impossible"
    problems: list[str] = field(default_factory=list)  # failures, one sentence each
    notes: list[str] = field(default_factory=list)  # facts that are not failures
    backends: list[BackendResult] = field(default_factory=list)
    tolerance: Tolerance | None = None  # this FFN's row (per FFN: mixed quantization recipes)
    bits_a: int | None = None  # quantization bits of A's FFN (its coarsest module), None: not quantized
    bits_b: int | None = None

    @property
    def passed(self) -> bool:
        return not self.problems and all(b.passed for b in self.backends)

    @property
    def worst(self) -> BackendResult | None:
        """The worst backend's result, of those that computed B's output (a reference not computed where B's
        weights are A's only where no backend computed it)."""
        measured = [b for b in self.backends if not _not_computed(b)] or self.backends
        return max(measured, key=lambda b: _order(b.ratio, b.cosine), default=None)

    def sort_key(self) -> tuple:
        w = self.worst
        return (self.passed, -(_order(w.ratio, w.cosine)[0] if w else math.inf), self.ref)

    def as_dict(self) -> dict:
        return {"ffn": str(self.ref), "layer": self.ref.layer, "kind": self.ref.kind,
                "expert": self.ref.expert if self.ref.kind == "expert" else None,
                "d_model": self.shape_a[0], "d_ffn": self.shape_a[1], "shape_b": list(self.shape_b),
                "dtype_a": self.dtype_a, "dtype_b": self.dtype_b, "bits_a": self.bits_a, "bits_b": self.bits_b,
                "tolerance": self.tolerance.as_dict() if self.tolerance else None, "exact": self.exact,
                "passed": self.passed,
                "problems": self.problems, "notes": self.notes, "backends": [b.as_dict() for b in self.backends]}


def _order(ratio: float, cosine: float) -> tuple[float, float]:
    """Badness of a backend result: nan (non-finite output) is the worst."""
    r = math.inf if math.isnan(ratio) else ratio
    return (r, -cosine if math.isfinite(cosine) else math.inf)


@dataclass
class VerifyReport:
    """The outcome of ``verify``. ``passed`` is the verdict; ``lines()`` and ``as_dict()`` render it."""

    a: dict
    b: dict
    backends: list[str]
    skipped_backends: dict[str, str]
    tokens: int
    seed: int
    tolerance: Tolerance | None
    results: list[FFNResult] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # checkpoint-level failures
    notes: list[str] = field(default_factory=list)
    logits: dict | None = None
    expert_map: dict | None = None  # a pruned B's routing mass dropped, per layer (information: run_logits)
    outside: "OutsideResult | None" = None  # the tensors outside the FFNs (None: not reached)
    load: "LoadCheck | None" = None  # would B load in its client (a failure is listed last: the weights first)
    config: "ConfigResult | None" = None  # the configs as their clients read them
    side_files: "SideFilesResult | None" = None  # tokenizer, generation_config, ...
    tokenization: "TokenizationResult | None" = None  # texts through both tokenizers (a GGUF B only)
    logits_skipped: str | None = None  # why whole-model logits did not run
    generation: "AgreementResult | None" = None  # the models as they generate, against the noise floor
    incomplete: list[str] = field(default_factory=list)  # checks asked for that could not run here, and why

    @property
    def passed(self) -> bool:
        """Every check passed and every check asked for ran (``unrun``: exit status 2, not 1)."""
        return not self.unrun and self.agrees

    @property
    def unrun(self) -> list[str]:
        """Checks that did not run, so no PASS: those asked for that could not run here (``incomplete``), then
        those B's runtime has no answer to (flagged ``not_applicable``: "config not compared (...)")."""
        return [*self.incomplete, *(f"{c.name} not compared ({c.skipped})" for c in self._model_checks
                                    if c is not None and c.not_applicable)]

    @property
    def agrees(self) -> bool:
        """Every check that ran passed."""
        return (not self.problems and not self.only_a and not self.only_b and all(r.passed for r in self.results)
                and (self.logits is None or self.logits["passed"]) and (self.outside is None or self.outside.passed)
                and not self._load_fails and all(c is None or c.passed for c in self._model_checks))

    @property
    def _model_checks(self) -> tuple:
        """The checks of what is not weights: the configs, the side files, the tokenization, the generation (each
        None where it does not apply)."""
        return (*self._cause_checks, self.generation)

    @property
    def _cause_checks(self) -> tuple:
        """The model checks that name a cause (the configs, the side files, the tokenization), where the
        generation's statistics are symptoms of whatever differs."""
        return (self.config, self.side_files, self.tokenization)

    @property
    def _load_fails(self) -> bool:
        return self.load is not None and not self.load.skipped and not self.load.ok

    def failures(self) -> list[str]:
        """Every failure as one line naming where: causes first (checkpoint-level, the configs, side files and
        tokenization, the tensors, worst FFN first, whether B loads), the end-to-end symptoms last (logits,
        generation: whatever differs shows in them)."""
        out = list(self.problems)
        for check in self._cause_checks:
            out += check.failures() if check is not None else []
        if self.only_a:
            out.append(f"only in A ({len(self.only_a)}): {listing(self.only_a)}")
        if self.only_b:
            out.append(f"only in B ({len(self.only_b)}): {listing(self.only_b)}")
        for r in sorted(self.results, key=FFNResult.sort_key):
            if r.passed:
                break
            out += [f"{r.ref}: {p}" for p in r.problems]
            bad = [b for b in r.backends if not b.passed]
            if bad:
                worst = max(bad, key=lambda b: _order(b.ratio, b.cosine))
                out.append(f"{r.ref}: fails on {', '.join(b.backend for b in bad)}: "
                           f"{_why(worst, r.tolerance or self.tolerance)}")
        if self.outside is not None:
            out += self.outside.failures()
        if self.load is not None and self._load_fails:
            out.append(f"B {self.load.summary()}")
        if self.logits is not None and not self.logits["passed"]:
            out += [f"logits: {p}" for p in self.logits["problems"]]
        if self.generation is not None:
            out += self.generation.failures()
        return out

    def coverage(self) -> dict[str, int]:
        """How many FFNs each backend ran on."""
        counts = dict.fromkeys(self.backends, 0)
        for r in self.results:
            for b in r.backends:
                counts[b.backend] = counts.get(b.backend, 0) + 1
        return counts

    def coverage_line(self) -> str | None:
        """What ran where, when not every backend ran every FFN; None when they all did."""
        n, counts = len(self.results), self.coverage()
        partial = {b: k for b, k in counts.items() if k < n}
        if not n or not partial:
            return None
        full = [b for b in counts if b not in partial]
        return (f"ran: {', '.join(full) or 'no backend'} on all {n} FFNs; "
                + "; ".join(f"{b} on {k}" for b, k in partial.items())
                + " (the first FFN of each kind: shape, form, layout, dtype, quantization; "
                  "--all-ffns-on-every-backend runs every one)")

    def not_run(self) -> list[str]:
        """The checks that did not run, each saying why (a PASS names them: nothing reads as checked that
        was not)."""
        out = []
        if self.load is not None and self.load.skipped:
            out.append(f"load check not run ({self.load.skipped})")
        for check in self._model_checks:
            if check is not None and check.skipped:
                out.append(f"{check.name} not compared ({check.skipped})")
        if self.logits is None and self.logits_skipped:
            out.append(f"logits not run ({self.logits_skipped})")
        return out

    def rows(self) -> list:
        """The distinct tolerance rows the FFNs were checked with, loosest first (one unless quantization
        differs between FFNs)."""
        rows = {r.tolerance for r in self.results if r.tolerance}
        return sorted(rows, key=lambda t: (-t.atol, t.row))

    @property
    def exit_status(self) -> int:
        """0 all pass, 1 something differs, 2 a check asked for could not run here (everything else agrees)."""
        return 0 if self.passed else 1 if not self.agrees else 2

    @property
    def verdict(self) -> str:
        n = len(self.results)
        if self.agrees and (unrun := self.unrun):
            return (f"INCOMPLETE: {'; '.join(unrun)}; everything that ran agrees ({n} FFN{'s' * (n != 1)} "
                    f"on {', '.join(self.backends)})" + self.bound()
                    + "".join(f"; {s}" for s in self.not_run() if not any(i in s for i in unrun)))
        if self.passed:
            exact = sum(r.exact == "identical" for r in self.results)
            requantized = sum(r.exact == "requantized" for r in self.results)
            codes = sum(r.exact == "codes" for r in self.results)
            bits = (f", {exact} bit-identical" if exact else "") + (
                f", {requantized} re-quantized bit for bit" if requantized else "") + (
                f", {codes} holding the other's codes exactly" if codes else "")
            logits = ", logits agree" if self.logits else ""
            if self.generation is not None and not self.generation.skipped:
                logits += ", generation within its noise floor"
            return (f"PASS: {n} FFN{'s' * (n != 1)} of A and B agree on {', '.join(self.backends)}{bits}{logits}"
                    + self.bound() + "".join(f"; {s}" for s in self.not_run()))
        bad = sum(not r.passed for r in self.results)
        unpaired = len(self.only_a) + len(self.only_b)
        counts = [f"{bad} of {n} FFNs differ"] if n and bad else []
        if self.outside is not None and not self.outside.passed:
            o = self.outside
            counts.append(f"{len(o.differ) + len(o.only_a) + len(o.only_b)} tensors outside the FFNs differ or are "
                          "unpaired")
        counts += [f"{unpaired} unpaired"] if unpaired else []
        counts += [f"{c.name} {'differ' if c.name == 'side files' else 'differs'}" for c in self._model_checks
                   if c is not None and not c.passed]
        return f"FAIL: {', '.join(counts) + '; ' if counts else ''}first: {self.failures()[0]}"

    def bound(self) -> str:
        """``; equivalent up to N tokens (...)`` where the clients run a setting otherwise past N tokens, or ""."""
        config = self.config
        if config is None or config.tokens is None:
            return ""
        keys = ", ".join(dict.fromkeys(b["key"] for b in config.bounded))
        return (f"; equivalent up to {config.tokens} tokens ({keys} differs past that, see the config line; "
                "--unbounded fails it)")

    def as_dict(self) -> dict:
        """What ``ffn-tools verify --json`` prints: the keys every command's JSON starts with, then the report."""
        return {"command": "verify", "input": [self.a.get("path"), self.b.get("path")], "output": None,
                "summary": self.verdict, "warnings": [], "passed": self.passed, "verdict": self.verdict,
                "equivalent_up_to": self.config.tokens if self.config else None, "a": self.a, "b": self.b,
                "backends": self.backends, "skipped_backends": self.skipped_backends, "tokens": self.tokens,
                "seed": self.seed, "tolerance": self.tolerance.as_dict() if self.tolerance else None,
                "problems": self.problems, "notes": self.notes, "only_a": self.only_a, "only_b": self.only_b,
                "failures": self.failures(),
                "ffns": [r.as_dict() for r in sorted(self.results, key=FFNResult.sort_key)],
                "logits": self.logits, "expert_map": self.expert_map,
                "outside": self.outside.as_dict() if self.outside else None,
                "load_check": self.load.as_dict() if self.load else None,
                "config": as_json(self.config), "side_files": as_json(self.side_files),
                "tokenization": as_json(self.tokenization),  # each flagged where B's runtime has no answer
                "generation": self.generation.as_dict() if self.generation else None,
                "logits_skipped": self.logits_skipped, "incomplete": self.unrun, "not_run": self.not_run(),
                "coverage": self.coverage()}

    def lines(self, max_rows: int = MAX_ROWS) -> list[str]:
        """The text report: the two sides, the check, a table worst first, failures, the verdict."""
        out = [f"A: {_side(self.a)}", f"B: {_side(self.b)}"]
        skipped = "".join(f"; {k} skipped ({v})" for k, v in self.skipped_backends.items())
        rows = self.rows()
        per_ffn = len(rows) > 1
        tol = ("per FFN, by its quantization: " + "; ".join(t.describe() for t in rows) if per_ffn
               else self.tolerance.describe() if self.tolerance else "none")
        out.append(f"check: {self.tokens} tokens, seed {self.seed}, backends {', '.join(self.backends) or 'none'}"
                   f"{skipped}; tolerance {tol}")
        out += [f"note: {n}" for n in self.notes]
        if (ran := self.coverage_line()):
            out.append(ran)
        if self.results:
            out.append("")
            head = (f"{'FFN':<24} {'worst backend':<14} {'max abs':>9} {'max rel':>9} {'cosine':>12} "
                    f"{'tol x':>7}  {'exact':<11} result")
            out.append(head + ("  tolerance row" if per_ffn else ""))
            rows = sorted(self.results, key=FFNResult.sort_key)
            for i, r in enumerate(rows):
                if i >= max_rows and r.passed:
                    out.append(f"... {len(rows) - i} more FFNs, all pass (--json lists every one)")
                    break
                out.append(f"{_row(r):<{len(head)}}  {r.tolerance.row}" if per_ffn and r.tolerance else _row(r))
            if any(r.worst is not None and _not_computed(r.worst) for r in rows):
                out.append("—: B's output on the reference not computed: its weights are A's bit for bit, so it is "
                           "A's output (error 0, cosine 1 by construction, not measured)")
        if self.outside is not None:
            out += ["", self.outside.line()]
        out += [c.line() for c in self._model_checks if c is not None]
        if self.load is not None and self.load.ok:  # a failure is listed with the others below
            out.append(f"load check: {self.load.summary()}")
        out += ["", *[f"  - {f}" for f in self.failures()]] if not self.passed else []
        if not self.agrees:  # a FAIL's verdict names the first failure: what did not run is said here
            out += [f"  not run: {i}" for i in self.unrun]
        if self.logits is not None:
            lg = self.logits
            out.append(f"logits ({lg['client_a']} vs {lg['client_b']}, {lg['shape']}): max abs diff "
                       f"{_num(lg['max_abs'])}, cosine {_cos(lg['cosine'])}, top-1 agreement "
                       f"{lg['top1_agreement']:.1%}, tolerance {lg['tolerance']['row']} -> "
                       f"{'ok' if lg['passed'] else 'FAIL'}")
        out.append(self.verdict)
        return out


def _not_computed(b: BackendResult) -> bool:
    """``b`` is B on the float64 reference taken as A's output, not run, B's weights A's bit for bit (``SAME_AS_A``,
    ``functional.not_computed``): its figures (error 0, cosine 1) hold by construction, nothing measured them."""
    return b.path in (NOT_COMPUTED, SAME_AS_A)


def _row(r: FFNResult) -> str:
    w = r.worst
    if w is not None and _not_computed(w):  # nothing was measured: its figures are not numbers
        cells = f"{w.backend:<14} {'—':>9} {'—':>9} {'—':>12} {'—':>7}"
    else:
        cells = (f"{w.backend:<14} {_num(w.max_abs):>9} {_num(w.max_rel):>9} {_cos(w.cosine):>12} "
                 f"{_num(w.ratio, 2):>7}" if w else f"{'-':<14} {'':>9} {'':>9} {'':>12} {'':>7}")
    return f"{str(r.ref):<24} {cells}  {r.exact:<11} {'ok' if r.passed else 'FAIL'}"


def _why(b: BackendResult, tol: Tolerance | None) -> str:
    if b.nonfinite:
        return f"{b.nonfinite} output values are inf/nan"
    parts = []
    if b.ratio > 1:
        parts.append(f"max abs error {_num(b.max_abs)} is {_num(b.ratio, 2)}x the tolerance")
    if tol and not b.cosine >= tol.min_cosine:
        parts.append(f"cosine {_cos(b.cosine)} < {tol.min_cosine}")
    return "; ".join(parts) or "failed"


def _side(s: dict) -> str:
    bits = [s.get("format"), s.get("scheme"), s.get("dtype"), s.get("activation"), s.get("quantization")]
    return f"{s['path']}  ({', '.join(str(b) for b in bits if b)})"


def _num(x: float, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    if math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}" if digits == 2 else f"{x:.{digits}e}"


def _cos(x: float) -> str:
    return "nan" if x is None or math.isnan(x) else f"{x:.9f}"[:11]


def without_times(report: dict):
    """A report's JSON (``as_dict``, or ``verify --json``'s) without the wall times of its backend calls: what two runs
    of the same verify share (one process and ``--ray``, today and tomorrow)."""
    if isinstance(report, dict):
        return {k: without_times(v) for k, v in report.items() if k != "seconds"}
    if isinstance(report, list):
        return [without_times(v) for v in report]
    return report
