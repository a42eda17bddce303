"""B paired with A as B's client loads it: A through the transforms B's client applies to its own checkpoints.

An MLX model is what ``mlx_lm``'s ``sanitize`` makes of a Hugging Face checkpoint: names prefixed
(``language_model.``), tensors computed (DeepSeek's ``embed_q``/``unembed_out`` from ``kv_b_proj``, Qwen3-Next's
norms +1, conv weights transposed), buffers dropped. Reading B back cannot undo every one of those, so the plain
pairing by name lists them as differences although the export is exactly what ``mlx_lm.convert`` writes. Where
that pairing fails, the failing tensors are compared again against A exported by the same plan the MLX export
runs (``converters.mlx.exporter.mlx_entries``: mlx_lm's own model class and sanitize): a B tensor equal to what
sanitize makes of A passes, exactly where B stores it unquantized in the same dtype; A's tensors that sanitize
consumed or dropped are then not missing from B. What still differs stays a failure.
"""

from __future__ import annotations

import logging

from ..errors import FFNToolsError, listing
from ..io.store import Format
from .diagnose import first_difference
from .quant import row_bits
from .requant import check_requantized

log = logging.getLogger(__name__)


def _name(line: str) -> str:
    """The tensor a failure line of ``OutsideResult.differ`` names (the text before ``[`` or ``:``)."""
    return line.split(":", 1)[0].split("[", 1)[0]


def reconcile(outside, ca, cb, compare) -> list[str]:
    """Settle ``outside``'s failures for an MLX B through A's MLX export; returns notes.

    Args:
        outside: the ``OutsideResult`` of the plain pairing (its lists are updated in place).
        ca, cb: the checkpoints (B an MLX model, A of another format).
        compare: ``(name, a_tensor, b_tensor, bits_b) -> str | None``, the outside check's own comparison (None:
            within tolerance or identical).
    """
    if cb.format is not Format.MLX or ca.format is Format.MLX or outside.skipped or outside.passed:
        return []
    from ffn_tools.converters.mlx.exporter import mlx_entries
    from ffn_tools.converters.mlx.quant import RawTensor

    try:
        source, entries, dropped = mlx_entries(ca)
    except FFNToolsError as e:
        log.info("A is not exported to MLX here (%s): B's tensors are paired by name only", e)
        return []
    bad = {_name(d): d for d in outside.differ}
    settled: list[str] = []
    consumed: set[str] = set()
    exact = 0
    for name in [*outside.only_b, *bad]:
        stored = cb.made_from(name) if name in cb else ()  # B's MLX tensors it is read from, as mlx_lm names them
        if not stored or any(m not in entries for m in stored):
            continue
        whys: list[str] = []
        same, used = True, set[str]()
        for m in stored:  # as B stores them: the view may have undone sanitize (taken 1.0 off a norm, rounding)
            entry = entries[m]
            made = entry.compute([source[n] for n in entry.inputs])
            a = made.to_torch() if isinstance(made, RawTensor) else made
            b, parts = cb.read_stored(m).to_torch(), cb.stored_parts(m)
            outcome, why = check_requantized(m, a, parts) if parts is not None else ("within", None)
            if outcome == "within":  # not quantized, or its bits cannot be reproduced: bits or the tolerance row
                params = parts[3] if parts is not None else None
                lossless = params is None and a.dtype == b.dtype
                why = first_difference(m, a, b) if lossless else compare(m, a, b, row_bits(params) if params else None)
                outcome = "identical" if lossless else "within"
            if why:
                whys.append(why)
            same &= outcome == "identical"
            used.update(entry.inputs)
        if whys:
            bad[name] = "; ".join(whys)  # the failure against what sanitize makes of A is the one that counts
            continue
        exact += same
        settled.append(name)
        consumed |= used
    outside.only_b[:] = [n for n in outside.only_b if n not in settled]
    outside.differ[:] = [why for n, why in bad.items() if n not in settled]
    gone = [n for n in outside.only_a if n in consumed or n in dropped]
    outside.only_a[:] = [n for n in outside.only_a if n not in gone]
    outside.identical += exact
    outside.within += len(settled) - exact
    notes = []
    if settled:
        notes.append(f"{len(settled)} of B's tensors are what mlx_lm's sanitize makes of A's ({exact} bit for "
                     f"bit, re-quantized where B is quantized): {listing(settled, 4)}; compared so, as mlx_lm "
                     "loads B")
    if gone:
        notes.append(f"A's {listing(gone, 4)}: renamed, used or dropped by mlx_lm's sanitize, so B's client has "
                     "no tensor of that name")
    return notes
