"""The functional check of one FFN: seeded inputs, A's FFN on the float64 reference, B's on each backend.

Inputs are standard normal (seeded), scaled so that A's gate pre-activations have a median RMS of
``PREACT_RMS`` (about 2, as in trained models where the input is a normalised hidden state), and rounded
to values every involved dtype holds exactly, so A and B see the same numbers. The scale matters: for
small pre-activations ``silu(g)*u ~ g*u/2`` is symmetric in gate and up, and a swap would go unnoticed.

B's FFN runs the way an inference engine runs its checkpoint: a fused gate_up (concat or interleaved,
either order) as one GEMM whose output goes through the backend's ``silu_mul_fused`` with the declared
layout, so the kernel itself reads gate and up out of the fused activation; separate weights, and
layouts the kernels do not take (tp, column-axis kernels), through the backend's ``ffn()``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..io.dtypes import short_name
from ..layouts import GateUpLayout
from ..tolerances import Tolerance
from .report import NOT_COMPUTED, SAME_AS_A, BackendResult

if TYPE_CHECKING:
    from ..kernels import GLU

PREACT_RMS = 2.0
SCALE_ROWS = 1024
REF_BLOCK_BYTES = 32 << 20  # float64 weights the reference converts at once (``run_reference``; 3x faster than whole)
KERNEL_BLOCK_BYTES = 64 << 20  # B's weights a whole-FFN kernel backend runs at once (``run_backend``)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Operands:
    """One side's FFN, ready to run: canonical (out, in) weights, biases by kernel key, maybe the fused form.

    ``fused`` is (gate_up weight (2I, H), gate_up bias or None, layout) when the checkpoint stores gate
    and up in one tensor in a layout ``silu_mul_fused`` can read. ``activation`` is what every backend takes
    as ``activation=``: a ``kernels.GLU`` (``Activation.kernel``: the function with the model's clamp limit,
    silu slope and up offset, e.g. GPT-OSS's) or a plain activation name.
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    biases: dict[str, torch.Tensor]
    activation: GLU | str
    fused: tuple[torch.Tensor, torch.Tensor | None, GateUpLayout] | None = None
    release: Callable[[], None] | None = None  # weights that are views of mapped files: their pages let go

    @property
    def dtype(self) -> torch.dtype:
        return self.down.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))

    def uniform(self, dtype: torch.dtype | None = None) -> "Operands":
        """The same FFN with every tensor in one kernel dtype (``dtype``, else the weights' own when they
        share one, else float32, which holds float16 and bfloat16 exactly)."""
        ts = [self.gate, self.up, self.down, *self.biases.values()]
        if dtype is None:
            dtypes = {t.dtype for t in ts}
            dtype = dtypes.pop() if len(dtypes) == 1 and self.dtype in KERNEL_DTYPES else torch.float32
        if all(t.dtype == dtype for t in ts):
            return self
        fused = None
        if self.fused:
            w, b, layout = self.fused
            fused = (w.to(dtype), None if b is None else b.to(dtype), layout)
        return Operands(self.gate.to(dtype), self.up.to(dtype), self.down.to(dtype),
                        {k: v.to(dtype) for k, v in self.biases.items()}, self.activation, fused, self.release)


def input_scale(gate: torch.Tensor) -> float:
    """The factor that gives N(0, 1) inputs gate pre-activations of RMS ``PREACT_RMS`` (median over rows).

    The median ignores outlier rows (a huge weight would otherwise shrink every other pre-activation).
    """
    step = max(1, gate.shape[0] // SCALE_ROWS)  # a strided sample of rows is plenty for a median
    norms = torch.linalg.vector_norm(gate[::step].float(), dim=1)  # RMS of gate_i . x, x ~ N(0, 1)
    med = float(norms.median()) if norms.numel() else 0.0
    return PREACT_RMS / med if math.isfinite(med) and med > 0 else 1.0


def make_inputs(tokens: int, d_model: int, seed: int, scale: float, dtypes) -> torch.Tensor:
    """(tokens, d_model) float32 inputs, seeded per d_model, that every dtype in ``dtypes`` holds exactly."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + d_model)
    return held_by_all(torch.randn(tokens, d_model, generator=gen) * scale, dtypes)


def held_by_all(x: torch.Tensor, dtypes) -> torch.Tensor:
    """float32 ``x`` rounded until every kernel dtype in ``dtypes`` holds it exactly."""
    kinds = [d for d in dict.fromkeys(dtypes) if d in KERNEL_DTYPES and d != torch.float32]
    for _ in range(4):  # bf16 -> fp16 -> bf16 -> fp16 settles: each rounding only drops bits
        before = x
        for d in kinds:
            x = x.to(d).to(torch.float32)
        if torch.equal(x, before):
            break
    return x


def run_reference(ref_backend, x: torch.Tensor, ops: Operands) -> torch.Tensor:
    """A's (or B's) FFN in float64 on the reference backend, ``REF_BLOCK_BYTES`` of float64 weights at a time.

    The reference converts its weights to float64 (four times bfloat16's bytes): run whole, a Phi-3-medium FFN
    would hold 2.2 GB of copies. Rows of gate and up (with their columns of down) are independent up to the
    down projection's sum, so blocks of them run one after the other and their outputs add up (down's bias
    once): the same float64 products, summed in blocks, not one rounding more than float64's. Where the weights
    are views of mapped files (``ops.release``), each block's pages are let go after it, so the FFN is never
    held whole.
    """
    ops = ops.uniform()
    xin = x.to(ops.dtype)
    inter, hidden = ops.gate.shape  # (I, H); down (H, I)
    rows = max(1, REF_BLOCK_BYTES // (8 * 3 * max(1, hidden)))
    if rows >= inter:
        return ref_backend.ffn(xin, ops.gate, ops.up, ops.down, ops.biases or None, activation=ops.activation)
    out = torch.zeros((*x.shape[:-1], hidden), dtype=torch.float64)
    for start in range(0, inter, rows):
        blk = slice(start, min(start + rows, inter))
        biases = {k: v[blk] for k, v in ops.biases.items() if k != "down"}
        if start == 0 and "down" in ops.biases:
            biases["down"] = ops.biases["down"]
        out += ref_backend.ffn(xin, ops.gate[blk], ops.up[blk], ops.down[:, blk], biases or None,
                               activation=ops.activation)
        if ops.release is not None:
            ops.release()
    return out


def run_backend(backend, x: torch.Tensor, ops: Operands) -> tuple[torch.Tensor, str]:
    """B's FFN on a non-reference backend in B's dtype. Returns (output, path).

    A whole-FFN kernel (``backend.ffn``: JAX's jit'd function, MLX's) copies its weights into its framework and
    holds its own intermediates, two to three times the FFN's bytes: an FFN larger than ``KERNEL_BLOCK_BYTES``
    runs in blocks of rows of gate and up (with down's columns), each a whole kernel call, their outputs summed
    in float32 (the path says so; each block's output is rounded to B's dtype once, as the whole one is).
    """
    ops = ops.uniform(ops.dtype if ops.dtype in KERNEL_DTYPES else torch.float32)
    xb = x.to(ops.dtype)
    if ops.fused is not None:
        w, b, layout = ops.fused
        gu = F.linear(xb, w, b)  # (T, 2I) in the checkpoint's own arrangement
        h = backend.silu_mul_fused(gu, order=layout.order, interleaved=layout.arrangement == "interleaved",
                                   activation=ops.activation)
        return F.linear(h, ops.down, ops.biases.get("down")), f"fused {layout.describe()}"
    inter = ops.gate.shape[0]
    rows = max(1, inter * KERNEL_BLOCK_BYTES // max(1, ops.nbytes))
    if rows >= inter:
        return backend.ffn(xb, ops.gate, ops.up, ops.down, ops.biases or None, activation=ops.activation), "ffn"
    out = torch.zeros((*x.shape[:-1], ops.down.shape[0]), dtype=torch.float32)
    for start in range(0, inter, rows):
        blk = slice(start, min(start + rows, inter))
        biases = {k: v[blk] for k, v in ops.biases.items() if k != "down"}
        if start == 0 and "down" in ops.biases:
            biases["down"] = ops.biases["down"]
        out += backend.ffn(xb, ops.gate[blk].contiguous(), ops.up[blk].contiguous(), ops.down[:, blk].contiguous(),
                           biases or None, activation=ops.activation).float()
    return out, f"ffn, {-(-inter // rows)} blocks of {rows} rows"


def compare(name: str, path: str, out: torch.Tensor, ref: torch.Tensor, tol: Tolerance,
            seconds: float = 0.0) -> BackendResult:
    """Metrics of ``out`` against the float64 ``ref`` and the pass/fail verdict under ``tol``."""
    o = out.detach().to(torch.float64).reshape(-1)
    r = ref.detach().to(torch.float64).reshape(-1)
    if o.shape != r.shape:
        raise ValueError(f"{name}: output {tuple(out.shape)} does not match the reference {tuple(ref.shape)}")
    nonfinite = 0 if bool(torch.isfinite(o).all()) else int((~torch.isfinite(o)).sum())
    diff = (o - r).abs()
    rms = float(r.pow(2).mean().sqrt()) if r.numel() else 0.0
    bound = (tol.atol * rms + tol.rtol * r.abs()).clamp_min(torch.finfo(torch.float64).tiny)
    ratio = float((diff / bound).max()) if o.numel() else 0.0
    max_abs = float(diff.max()) if o.numel() else 0.0
    peak = float(r.abs().max()) if r.numel() else 0.0
    max_rel = max_abs / peak if peak > 0 else (0.0 if max_abs == 0 else math.inf)
    on, rn = float(o.norm()), float(r.norm())
    cosine = float(o @ r) / (on * rn) if on > 0 and rn > 0 else (1.0 if on == rn == 0 else 0.0)
    if nonfinite:
        ratio, cosine = math.nan, math.nan
    passed = nonfinite == 0 and ratio <= 1.0 and cosine >= tol.min_cosine
    return BackendResult(name, path, max_abs, max_rel, cosine, ratio, nonfinite, passed, seconds)


def nonfinite_values(t: torch.Tensor) -> str:
    """What non-finite values ``t`` holds, each kind by its name: "2 NaN", "1 inf (overflow in a cast to
    float16?)", "2 NaN and 1 inf (...)", or "" when every value is finite. Only an inf can come from an
    overflowing cast; a NaN never does, so it is not given that cause.
    """
    if not t.is_floating_point():
        return ""
    nan, inf = int(t.isnan().sum()), int(t.isinf().sum())
    parts = [f"{nan} NaN"] if nan else []
    parts += [f"{inf} inf (overflow in a cast to {short_name(t.dtype)}?)"] if inf else []
    return " and ".join(parts)




def all_finite(tensors, let_go: Callable[[], None] | None = None) -> bool:
    """Every value of every floating-point tensor is finite (min and max are: NaN propagates through both;
    a pass over the bytes, ~20x faster than ``isfinite`` on bfloat16); ``let_go`` runs after each tensor (views
    of mapped pages: their pages let go)."""
    for t in tensors:
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t)
            if let_go is not None:
                let_go()
            if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
                return False
    return True


def not_computed() -> BackendResult:
    """B on the reference where its weights are A's, bit for bit, and all finite: the same bits through the same
    float64 computation give A's output, so it agrees with it exactly (max error 0, cosine 1) and is finite
    (finite weights and inputs give a finite float64 output at any checkpoint's scale) without being run."""
    return BackendResult("reference", NOT_COMPUTED, 0.0, 0.0, 1.0, 0.0, 0, True, 0.0)


def check_ffn(backends: dict, x: torch.Tensor, r: torch.Tensor, ops_b: Operands | None, tol: Tolerance,
              same_as_a: bool = False) -> list[BackendResult]:
    """B on every backend in ``backends`` (name -> module; "reference" first) against ``r``, A's output on the
    float64 reference (``run_reference``).

    With ``same_as_a`` (B's canonical weights are bit-identical to A's, and the activation kernel is the same on
    both sides) B on the reference is A's output, not recomputed: the same float64 computation on the same bits
    gives the same result. With different activations B's output is computed, and differs. ``ops_b`` may be None
    only where nothing reads it (the reference alone, ``same_as_a``).
    """
    results = []
    for name, mod in backends.items():
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # inf/nan weights: reported below as non-finite outputs
            warnings.simplefilter("ignore", RuntimeWarning)
            if name == "reference" and same_as_a:
                out, path = r, SAME_AS_A
            elif ops_b is None:
                raise ValueError("internal error: B's operands are needed to run it")
            elif name == "reference":
                out, path = run_reference(mod, x, ops_b), "ffn (float64)"
            else:
                out, path = run_backend(mod, x, ops_b)
        results.append(compare(name, path, out, r, tol, time.perf_counter() - t0))
    return results


def reference_backend():
    """``kernels.reference``, the float64 ground truth."""
    from ffn_tools.kernels import reference

    return reference
