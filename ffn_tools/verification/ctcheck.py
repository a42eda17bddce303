"""Is B's compressed-tensors module A's weight quantized with B's own scales and zero points?

compressed-tensors' round-to-nearest (``forward._quantize``: ``round(clamp(w / s + z))``) is deterministic, so
where A is the unquantized source of B, A's weight quantized with the scale and zero point B stores gives
B's codes, every one (``ctdecode.quantize``; measured on tiny Llama and Qwen2-MoE twins: 0 of all codes
differ). That binds B's scales and zero points to A's values, which the output tolerance cannot: a scale row
shifted by one (cosine 0.955 on a tiny model, inside the 4-bit row's 0.95) moves codes by 2 or more steps in
most of the row's groups.

A quantizer that compensates errors (GPTQ) moves codes too, by a step: a row whose codes differ from A's by
at most one step is within that (noted, never silent); a row with a code two or more steps away is not A's
weight quantized with these parameters (a wrong scale or zero point, a row from elsewhere, gate for up), and
fails, naming the tensor, the counts and the worst row.
"""

from __future__ import annotations

from ..ctdecode import codes, quantize
from ..ctview import CompressedView


def check_codes(role: str, a, view: CompressedView, name: str) -> tuple[str, str | None]:
    """A's ``a`` (B's stored arrangement) against B's module ``name``.

    Returns:
        ("identical", None), ("within", note) or ("differs", sentence).
    """
    import torch

    m = view.modules[name]
    if tuple(a.shape) != m.shape:
        return "differs", f"{role} ({name}): A's {list(a.shape)} against B's {list(m.shape)}"
    parts = view.parts(name)
    d = (quantize(m, a, parts).to(torch.int16) - codes(m, parts).to(torch.int16)).abs()
    if not bool(d.any()):
        return "identical", None
    far = (d > 1).sum(1)
    rows, n = m.shape[0], int((d > 0).sum())
    bad = int((far > 0).sum())
    what = f"{n} of {d.numel()} codes differ from A's quantized with B's scales{' and zero points' * ('weight_zero_point' in parts)}"
    if not bad:
        return "within", (f"{role} ({name}): {what}, each by one step (an error-compensating quantizer such as "
                          "GPTQ); values compared within the tolerance row")
    worst = int(far.argmax())
    return "differs", (f"{role} ({name}): B's codes are not A's weight quantized with B's {m.scheme.name} "
                       f"parameters: {what}, by two or more steps in {bad} of {rows} rows (worst row {worst}: "
                       f"{int(far[worst])} codes); a wrong scale or zero point, or rows from elsewhere")


def check_ffn(res, ca, cb, x, y, wa, as_stored) -> None:
    """Each of B's FFN ``y``'s compressed-tensors modules against A's weights ``wa`` (``as_stored`` arranges
    a role as B stores it); sets ``res.exact`` ("identical" only when every code of every module is A's)
    and adds problems or notes. Nothing where B has no such module or A's FFN is quantized itself."""
    if not isinstance(cb, CompressedView) or any(ca.quant_params(n) for n in x.names.values()):
        return
    roles = [r for r in ("gate_up", "gate", "up", "down") if y.names.get(r) in cb.modules and y.index is None
             and cb.modules[y.names[r]].scheme.format == "pack-quantized"]  # int codes; NVFP4, FP8: the row
    if not roles:
        return
    outcomes = {}
    for r in roles:
        a = as_stored(wa, r, y)
        if a is not None:
            outcomes[r] = check_codes(r, a, cb, y.names[r])
    differs = [w for o, w in outcomes.values() if o == "differs" and w]
    if differs:
        res.exact = "differs"
        for r, other in (("gate", "up"), ("up", "gate")):
            if r in outcomes and outcomes[r][0] == "differs" and (o := as_stored(wa, other, y)) is not None \
                    and check_codes(r, o, cb, y.names[r])[0] == "identical":
                differs.append(f"B's {r} is A's {other} quantized")
        res.problems.append("; ".join(differs))
    elif all(o == "identical" for o, _ in outcomes.values()):
        res.exact = "identical"
        res.notes.append(f"re-quantized: A's {', '.join(outcomes)} quantized with B's compressed-tensors scales "
                         "and zero points give B's codes, every one")
    else:
        res.notes += [w for o, w in outcomes.values() if w]
