"""Codes kept, in ``verify``: where one side says a tensor holds the other side's stored codes (a GGUF written from
codes: ``Checkpoint.kept_codes``, from its ``ffn_tools.codes.kept`` metadata), its values must be the other side's
``s * (c - z)`` (``IntCodes.values``) exactly, in float32, every one: not within a tolerance row, which a scale
block shifted by one, or a zero point off by one, would pass. A side that says so of a tensor the other side does
not store as integer codes fails too: the claim cannot be true.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..checks.diagnose import first_difference

if TYPE_CHECKING:
    import torch

KEPT_KEY = "ffn_tools.codes.kept"  # where a GGUF says so (converters/gguf/kept.py writes it)


def kept_side(ca, cb, name_a: str, name_b: str) -> tuple[str, str] | None:
    """("B", "A") where B says its ``name_b`` holds A's codes, ("A", "B") the other way round, else None."""
    if name_b in getattr(cb, "kept_codes", ()):
        return "B", "A"
    if name_a in getattr(ca, "kept_codes", ()):
        return "A", "B"
    return None


def difference(label: str, source, name: str, kept: "torch.Tensor", k: str = "B", q: str = "A") -> str | None:
    """None where ``kept`` (side ``k``'s values of the tensor, read back) is side ``q``'s ``name`` of ``source``
    as its integer codes define it, exactly; else the sentence that says how not."""
    import torch

    m = source.quantized(name)
    codes = m.scheme.int_codes(m, source.quantized_parts(name)) if m is not None else None
    if codes is None:
        what = m.scheme.what(m) if m is not None else "stored unquantized"
        return (f"{label}: {k} says it holds {q}'s codes ({KEPT_KEY}), but {q}'s {name} is not integer codes "
                f"({what})")
    values, kept = codes.values(), kept.to(torch.float32)
    d = first_difference(label, values, kept) if k == "B" else first_difference(label, kept, values)  # A's first
    if d is None:
        return None
    return f"{k} says {label} holds {q}'s codes ({KEPT_KEY}), but its values are not {q}'s scale * (code - zero): {d}"
