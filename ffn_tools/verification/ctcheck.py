"""Is one side's quantized module (compressed-tensors pack-quantized, GPTQ, AWQ, NVFP4) the other side's
weight quantized with its own scales and zero points?

compressed-tensors' round-to-nearest (``forward._quantize``: ``round(clamp(w / s + z))``) is deterministic, so
where one side is the unquantized source of the other, the source's weight quantized with the scale and zero
point the quantized side stores gives its codes, every one (``ctdecode.quantize``; measured on tiny Llama and
Qwen2-MoE twins: 0 of all codes differ); GPTQ's and AWQ's round-to-nearest is ``clamp(round(w / s) + z)``,
NVFP4's compressed-tensors' ``cast_to_fp4`` of ``w / (scale / global_scale)`` (codes compared as signed places
on the E2M1 grid, so one step is one representable value). FP8 is compared by its tolerance row only. That binds the stored scales and zero points to the source's values,
which the output tolerance cannot: a scale row shifted by one (cosine 0.955 on a tiny model, inside the 4-bit
row's 0.95) moves codes by 2 or more steps in most of the row's groups. Either side may be the quantized one
(B quantized from A, or A quantized and B its dequantized or original twin).

A quantizer that compensates errors (GPTQ) moves codes too, by a step: a row whose codes differ by at most one
step is within that (noted, never silent); a row with a code two or more steps away is not the source quantized
with these parameters (a wrong scale or zero point, a row from elsewhere, gate for up), and fails, naming the
tensor, the counts and the worst row.
"""

from __future__ import annotations

from ..ctdecode import codes, quantize
from ..ctview import CompressedView

CODED = ("pack-quantized", "gptq", "awq", "nvfp4-pack-quantized", "modelopt NVFP4")  # codes a replay reproduces


def check_codes(role: str, a, view: CompressedView, name: str, src: str = "A", q: str = "B") -> tuple[str, str | None]:
    """Side ``src``'s weight ``a`` (arranged as ``q`` stores it) against side ``q``'s module ``name``.

    Returns:
        ("identical", None), ("within", note) or ("differs", sentence).
    """
    import torch

    m = view.modules[name]
    if tuple(a.shape) != m.shape:
        return "differs", f"{role} ({name}): {src}'s {list(a.shape)} against {q}'s {list(m.shape)}"
    parts = view.parts(name)
    d = (quantize(m, a, parts).to(torch.int16) - codes(m, parts).to(torch.int16)).abs()
    if not bool(d.any()):
        return "identical", None
    far = (d > 1).sum(1)
    rows, n = m.shape[0], int((d > 0).sum())
    bad = int((far > 0).sum())
    zp = " and zero points" if "weight_zero_point" in parts or "qzeros" in parts else ""
    what = f"{n} of {d.numel()} codes differ from {src}'s quantized with {q}'s scales{zp}"
    if not bad:
        return "within", (f"{role} ({name}): {what}, each by one step (an error-compensating quantizer such as "
                          "GPTQ); values compared within the tolerance row")
    worst = int(far.argmax())
    return "differs", (f"{role} ({name}): {q}'s codes are not {src}'s weight quantized with {q}'s {m.scheme.name} "
                       f"parameters: {what}, by two or more steps in {bad} of {rows} rows (worst row {worst}: "
                       f"{int(far[worst])} codes); a wrong scale or zero point, or rows from elsewhere")


def check_ffn(res, ca, cb, x, y, wa, wb, as_stored) -> None:
    """The quantized side's compressed-tensors modules of FFN ``y`` (B) or ``x`` (A) against the other side's
    canonical weights (``as_stored`` arranges a role as the quantized side stores it); sets ``res.exact``
    ("identical" only when every code of every module is the source's) and adds problems or notes. Nothing
    where neither side has such a module, or both sides are quantized."""
    if isinstance(cb, CompressedView) and not any(ca.quant_params(n) for n in x.names.values()):
        view, f, w, src, q = cb, y, wa, "A", "B"
    elif isinstance(ca, CompressedView) and not any(cb.quant_params(n) for n in y.names.values()):
        view, f, w, src, q = ca, x, wb, "B", "A"
    else:
        return
    roles = [r for r in ("gate_up", "gate", "up", "down") if f.names.get(r) in view.modules and f.index is None
             and view.modules[f.names[r]].scheme.format in CODED]  # int codes; NVFP4, FP8: the tolerance row
    outcomes = {}
    for r in roles:
        a = as_stored(w, r, f)
        if a is not None:
            outcomes[r] = check_codes(r, a, view, f.names[r], src, q)
    if not outcomes:
        return
    differs = [why for o, why in outcomes.values() if o == "differs" and why]
    if differs:
        res.exact = "differs"
        for r, other in (("gate", "up"), ("up", "gate")):
            if r in outcomes and outcomes[r][0] == "differs" and (o := as_stored(w, other, f)) is not None \
                    and check_codes(r, o, view, f.names[r], src, q)[0] == "identical":
                differs.append(f"{q}'s {r} is {src}'s {other} quantized")
        res.problems.append("; ".join(differs))
    elif all(o == "identical" for o, _ in outcomes.values()):
        res.exact = "identical"
        res.notes.append(f"re-quantized: {src}'s {', '.join(outcomes)} quantized with {q}'s stored scales and zero "
                         f"points give {q}'s codes, every one")
    else:
        res.notes += [why for o, why in outcomes.values() if why]
