"""Are a quantized module's stored codes the other side's weight quantized with the module's own scales and
zero points? The comparison every scheme with reproducible codes shares (``QuantScheme.requantized``).

compressed-tensors' round-to-nearest (``forward._quantize``: ``round(clamp(w / s + z))``) is deterministic, so
where one side is the unquantized source of the other, the source's weight quantized with the scale and zero
point the quantized side stores gives its codes, every one (``ctdecode.quantize``; measured on tiny Llama and
Qwen2-MoE twins: 0 of all codes differ); GPTQ's and AWQ's round-to-nearest is ``clamp(round(w / s) + z)``,
NVFP4's compressed-tensors' ``cast_to_fp4`` of ``w / (scale / global_scale)`` (codes compared as signed places
on the E2M1 grid, so one step is one representable value). FP8 is compared by its tolerance row only. That
binds the stored scales and zero points to the source's values, which the output tolerance cannot: a scale row
shifted by one (cosine 0.955 on a tiny model, inside the 4-bit row's 0.95) moves codes by 2 or more steps in
most of the row's groups. Either side may be the quantized one (B quantized from A, or A quantized and B its
dequantized or original twin).

A quantizer that compensates errors (GPTQ) moves codes too, by a step: a row whose codes differ by at most one
step is within that (noted, never silent); a row with a code two or more steps away is not the source quantized
with these parameters (a wrong scale or zero point, a row from elsewhere, gate for up), and fails, naming the
tensor, the counts and the worst row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import DIFFERS, IDENTICAL, WITHIN

if TYPE_CHECKING:
    import torch

    from .base import Module


def compare_codes(label: str, m: "Module", mine: "torch.Tensor", stored: "torch.Tensor", zero_points: bool,
                  src: str = "A", q: str = "B") -> tuple[str, str | None]:
    """Side ``src``'s weight quantized with side ``q``'s parameters (``mine``) against ``q``'s stored codes of
    module ``m`` (both (rows, cols), as integer steps).

    Returns:
        (IDENTICAL, None), (WITHIN, note: every code within one step) or (DIFFERS, sentence).
    """
    import torch

    d = (mine.to(torch.int16) - stored.to(torch.int16)).abs()
    if not bool(d.any()):
        return IDENTICAL, None
    far = (d > 1).sum(1)
    rows, n = m.shape[0], int((d > 0).sum())
    bad = int((far > 0).sum())
    zp = " and zero points" if zero_points else ""
    what = f"{n} of {d.numel()} codes differ from {src}'s quantized with {q}'s scales{zp}"
    if not bad:
        return WITHIN, (f"{label}: {what}, each by one step (an error-compensating quantizer such as "
                        "GPTQ); values compared within the tolerance row")
    worst = int(far.argmax())
    return DIFFERS, (f"{label}: {q}'s codes are not {src}'s weight quantized with {q}'s {m.args.name} "
                     f"parameters: {what}, by two or more steps in {bad} of {rows} rows (worst row {worst}: "
                     f"{int(far[worst])} codes); a wrong scale or zero point, or rows from elsewhere")


def shape_differs(label: str, m: "Module", a, src: str = "A", q: str = "B") -> tuple[str, str | None] | None:
    """(DIFFERS, sentence) when ``a`` is not of ``m``'s shape, else None."""
    if tuple(a.shape) != tuple(m.shape):
        return DIFFERS, f"{label}: {src}'s {list(a.shape)} against {q}'s {list(m.shape)}"
    return None
