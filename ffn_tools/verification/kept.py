"""Codes kept, in ``verify``: where one side says a tensor holds the other side's stored codes (a checkpoint
written from codes: ``Checkpoint.kept_codes``, which its reader declares from the ``ffn_tools.codes.kept``
metadata its writer recorded), its values must be the other side's as its codes define them (``QuantScheme.exact_values``: ``s * (c - z)``, NVFP4's ``e2m1 * scale * scale_2``)
exactly, in float32, every one: not within a tolerance row, which a scale block shifted by one, a zero point off
by one or an inverted global scale's small model would pass. A side that says so of a tensor the other side does
not store as integer codes fails too: the claim cannot be true.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from ..checks.diagnose import first_difference
from ..quant.base import KEPT_KEY

if TYPE_CHECKING:
    import torch


def kept_names(c) -> frozenset[str]:
    """The tensors checkpoint ``c`` says hold another checkpoint's stored codes: its reader's ``kept_codes`` (a
    GGUF's, from its metadata), and the names its stored safetensors metadata records under ``KEPT_KEY`` (a JSON
    list: an MLX output's, whose view reads those tensors by the same names)."""
    raw = c.stored.metadata.get(KEPT_KEY)
    return frozenset(c.kept_codes) | (_recorded(raw) if isinstance(raw, str) else frozenset())


@lru_cache(maxsize=8)
def _recorded(raw: str) -> frozenset[str]:
    """``KEPT_KEY``'s JSON list, parsed once per distinct value (it is asked of every FFN role)."""
    import json

    try:
        names = json.loads(raw) if raw else []
    except ValueError:
        return frozenset()
    return frozenset(n for n in names if isinstance(n, str)) if isinstance(names, list) else frozenset()


def kept_side(ca, cb, name_a: str, name_b: str) -> tuple[str, str] | None:
    """("B", "A") where B says its ``name_b`` holds A's codes, ("A", "B") the other way round, else None."""
    if name_b in kept_names(cb):
        return "B", "A"
    if name_a in kept_names(ca):
        return "A", "B"
    return None


def difference(label: str, source, name: str, kept: "torch.Tensor", k: str = "B",
               q: str = "A") -> tuple[bool | None, str | None]:
    """Is ``kept`` (side ``k``'s values of the tensor, read back) side ``q``'s ``name`` of ``source`` as its codes
    define it, exactly? (True, None); (False, the sentence that says how not); or (None, why it cannot be told):
    ``q`` does not store that tensor as codes a block format holds (unquantized, another scheme), so ``k`` is not a
    conversion of ``q``'s codes and the tolerance row compares them."""
    import torch

    m = source.quantized(name)
    values = m.scheme.exact_values(m, source.quantized_parts(name)) if m is not None else None
    if values is None:
        what = m.scheme.what(m) if m is not None else "stored unquantized"
        return None, (f"{label}: {k} holds codes kept from a quantized source ({KEPT_KEY}); {q}'s is {what}: "
                      "compared within the tolerance row")
    # -0 as +0 (adding 0 does that, and nothing else): E2M1's code 8 is -0, which llama.cpp's table reads as 0
    values, kept = values + 0.0, kept.to(torch.float32) + 0.0
    d = first_difference(label, values, kept) if k == "B" else first_difference(label, kept, values)  # A's first
    if d is None:
        return True, None
    return False, f"{k} says {label} holds {q}'s codes ({KEPT_KEY}), but its values are not the ones {q}'s codes define: {d}"
