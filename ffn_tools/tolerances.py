"""How close B's FFN output must be to A's float64 reference output: a table per dtype and quantization.

Criterion (llm.c's ``validate_result``, made scale-free): for every output element ``b`` and reference
element ``r`` of one FFN,

    |b - r| <= atol * rms(r) + rtol * |r|          and   cosine(b, r) >= min_cosine

where ``rms(r)`` is the root mean square of that FFN's whole reference output, so ``atol`` is in units of
the output's typical size and one table fits every model. The reference is A's FFN evaluated in float64
(``kernels.reference``); B's FFN runs in B's dtype on each backend, so the table bounds the rounding of a
computation in that dtype (plus the weights' own rounding when A and B differ in dtype, or their
quantization error). Any non-finite output fails.

The row is chosen by the coarsest dtype among A and B (float32 < float16 < bfloat16) and, when either
side is quantized, by the bits of the quantization; with both, the looser of the two rows applies. Bits are
per FFN: the coarsest among its gate/up/down modules on either side, as the quantization block resolves
them per module (mixed recipes such as mlx_lm's ``mixed_3_6`` give layers different bits and may leave
some unquantized: those FFNs get their dtype's row).

    row         atol    rtol    min cosine   measured (max |b-r|/rms, 1-cos; d_model 64..2048)
    float32     2e-4    2e-4    0.9999999    1e-6..3e-6, 2e-13
    float16     1e-2    1e-2    0.99999      2e-3..3e-3, 2e-7
    bfloat16    6e-2    6e-2    0.9999       1e-2..2e-2, 1e-5
    8-bit       0.2     0.2     0.999        3e-2..5e-2, 6e-5
    6-bit       0.6     0.6     0.99
    5-bit       1.2     1.2     0.98
    4-bit       2.5     2.5     0.95         0.5..0.7, 1.3e-2
    3-bit       5       5       0.8
    2-bit       10      10      0.5

(Measured: Gaussian weights of std 0.02, inputs scaled so the gate pre-activations have RMS 2; MLX affine
quantization with group sizes 32 and 64.) Planted defects are far outside every row: gate and up swapped
gives 1-cos of 0.35-0.5 and max |b-r|/rms of 3-4. ``--atol``/``--rtol`` replace the row's values (the
minimum cosine stays). Whole-model logits (``--logits``) use the same row widened ``LOGITS_WIDEN`` times:
errors accumulate over layers, and both sides run in their own dtype (there is no float64 reference).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Coarsest last: the row of a pair of dtypes is the later one. Names, not torch dtypes: the CLI's
# --help shows this table without importing torch.
DTYPE_ORDER = ("float32", "float16", "bfloat16")
LOGITS_WIDEN = 4.0


@dataclass(frozen=True)
class Tolerance:
    """One row of the table. ``atol`` is in units of the reference output's RMS."""

    atol: float
    rtol: float
    min_cosine: float
    row: str

    def describe(self) -> str:
        return f"{self.row}: atol {self.atol:g}·rms, rtol {self.rtol:g}, cosine >= {self.min_cosine}"

    def as_dict(self) -> dict:
        return {"row": self.row, "atol": self.atol, "rtol": self.rtol, "min_cosine": self.min_cosine}


DTYPE_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(2e-4, 2e-4, 0.9999999, "float32"),
    "float16": Tolerance(1e-2, 1e-2, 0.99999, "float16"),
    "bfloat16": Tolerance(6e-2, 6e-2, 0.9999, "bfloat16"),
}

QUANT_TOLERANCES: dict[int, Tolerance] = {
    8: Tolerance(0.2, 0.2, 0.999, "8-bit"),
    6: Tolerance(0.6, 0.6, 0.99, "6-bit"),
    5: Tolerance(1.2, 1.2, 0.98, "5-bit"),
    4: Tolerance(2.5, 2.5, 0.95, "4-bit"),
    3: Tolerance(5.0, 5.0, 0.8, "3-bit"),
    2: Tolerance(10.0, 10.0, 0.5, "2-bit"),
}

# FP8 (E4M3) weights with block scales: 3 mantissa bits, errors like 6-bit affine groups (a DeepSeek-style
# 32x32-block quantization of a tiny model measures cosine 0.9988, outside the 8-bit row): verify uses the 6-bit row.
FP8_ROW_BITS = 6

HELP = "\n".join([
    "\b",  # click: keep these lines as they are
    "Tolerances, per the coarser dtype of A and B and per quantization (the looser row when both apply):",
    "element |b - r| <= atol * rms(r) + rtol * |r|, and cosine(b, r) >= min cosine.",
    f"  {'row':<10} {'atol':>6} {'rtol':>6}  min cosine",
    *(f"  {t.row:<10} {t.atol:>6g} {t.rtol:>6g}  {t.min_cosine}"
      for t in (*DTYPE_TOLERANCES.values(), *QUANT_TOLERANCES.values())),
    f"FP8 (E4M3) block-scaled weights, dequantized: the {FP8_ROW_BITS}-bit row.",
    f"Whole-model logits (--logits): the row widened {LOGITS_WIDEN:g} times.",
])


def coarsest(dtypes) -> str:
    """The name of the coarsest of some dtypes (torch dtypes or names), by ``DTYPE_ORDER``; float32 when
    none is a 16- or 32-bit float (float64 weights are compared as float32)."""
    known = [n for n in (str(d).removeprefix("torch.") for d in dtypes) if n in DTYPE_ORDER]
    return max(known, key=DTYPE_ORDER.index) if known else "float32"


def tolerance_for(dtypes, quant_bits: int | None = None, *, atol: float | None = None,
                  rtol: float | None = None) -> Tolerance:
    """The row for a comparison between weights of ``dtypes`` (and quantization), with overrides.

    Args:
        dtypes: the weight dtypes of A and B.
        quant_bits: the smallest quantization width of A or B, None when neither is quantized.
        atol, rtol: user overrides (``--atol``/``--rtol``); the row's minimum cosine is kept.

    Returns:
        The tolerance; ``row`` names where it came from ("(overridden)" appended after --atol/--rtol).
    """
    tol = DTYPE_TOLERANCES[coarsest(dtypes)]
    if quant_bits is not None:
        nearest = min(QUANT_TOLERANCES, key=lambda b: (abs(b - quant_bits), b))  # e.g. 7 bits: the 6-bit row
        q = QUANT_TOLERANCES[nearest]
        tol = Tolerance(max(tol.atol, q.atol), max(tol.rtol, q.rtol), min(tol.min_cosine, q.min_cosine),
                        f"{tol.row} {q.row}")
    if atol is not None or rtol is not None:
        tol = replace(tol, atol=tol.atol if atol is None else atol, rtol=tol.rtol if rtol is None else rtol,
                      row=tol.row + " (overridden)")
    return tol


def widened(tol: Tolerance, factor: float = LOGITS_WIDEN) -> Tolerance:
    """A row widened for whole-model logits: atol and rtol times ``factor``, 1-cosine times ``factor``."""
    return Tolerance(tol.atol * factor, tol.rtol * factor, 1 - (1 - tol.min_cosine) * factor, tol.row + " (logits)")
