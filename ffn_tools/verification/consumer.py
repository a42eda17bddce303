"""B paired with A as B's client loads it: A through the transforms B's client applies to its own checkpoints.

An MLX model is what ``mlx_lm``'s ``sanitize`` makes of a Hugging Face checkpoint: names prefixed
(``language_model.``), tensors computed (DeepSeek's ``embed_q``/``unembed_out`` from ``kv_b_proj``, Qwen3-Next's
norms +1, conv weights transposed), buffers dropped. Reading B back cannot undo every one of those, so the plain
pairing by name lists them as differences although the export is exactly what ``mlx_lm.convert`` writes. Where
that pairing fails, the failing tensors are compared again against A exported by the same plan the MLX export
runs (``converters.mlx.exporter.mlx_entries``: mlx_lm's own model class and sanitize): a B tensor equal to what
sanitize makes of A passes, exactly where B stores it unquantized in the same dtype; A's tensors that sanitize
consumed or dropped are then not missing from B. What still differs stays a failure.

The FFNs are paired the same way, before their checks (``ffn_as_loaded``): where B is MLX and A is not, each
of A's FFN tensors that the plan computes through sanitize (Falcon-H1's ``mlp_multipliers`` folded into gate
and down, ``param *= m``) and that B's view reads back by plain rename is taken as the plan computes it, bit
for bit: A as mlx_lm loads it. The engine's note names them. B's FFN must then equal that (or re-quantize from
it), so a different factor, or gate and up swapped, still fails.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..errors import FFNToolsError, listing
from ..io.store import Checkpoint, Format
from .diagnose import first_difference
from .quant import row_bits
from .requant import check_requantized

log = logging.getLogger(__name__)


def _name(line: str) -> str:
    """The tensor a failure line of ``OutsideResult.differ`` names (the text before ``[`` or ``:``)."""
    return line.split(":", 1)[0].split("[", 1)[0]


def export_plan(ca, cb) -> tuple | None:
    """A's MLX export plan, ``mlx_entries(ca)``: (the checkpoint it reads, MLX name -> ``Entry``, A's names
    sanitize drops). Built once per verify, for the FFNs (``ffn_as_loaded``) and the outside tensors
    (``reconcile``). None where B is not MLX, A is, or A does not export to MLX (logged)."""
    if cb.format is not Format.MLX or ca.format is Format.MLX:
        return None
    from ffn_tools.converters.mlx.exporter import mlx_entries

    try:
        return mlx_entries(ca)
    except FFNToolsError as e:
        log.info("A is not exported to MLX here (%s): B is paired with A's tensors as stored, by name", e)
        return None


def as_exported(entry, source: Checkpoint):
    """The torch tensor the MLX plan's ``entry`` computes from A (``source``)."""
    from ffn_tools.converters.mlx.quant import RawTensor

    made = entry.compute([source[n] for n in entry.inputs])
    return made.to_torch() if isinstance(made, RawTensor) else made


def ffn_as_loaded(ca, cb, names, plan: tuple | None) -> tuple[Checkpoint, dict]:
    """A's tensors among ``names`` (its FFNs') that the MLX ``plan`` (``export_plan``) computes through mlx_lm's
    sanitize and B's view reads back by plain rename (same shape): (the checkpoint the plan reads, name -> plan
    ``Entry``). Empty where there is no plan."""
    inverse = getattr(cb, "inverse", None)  # the MLX view's trace back (``converters.mlx.inverse``)
    if plan is None or inverse is None:
        return ca, {}
    source, entries, _ = plan
    sources = inverse.sources  # what the view traced back; the rest keeps its MLX name (or an expert's slice)
    computed = {}
    for n in names:
        stored: tuple[str, ...] = cb.made_from(n) if n in cb else ()
        moved = n in sources and sources[n].kind != "rename"  # a stack's slice, or gathered back: not as stored
        entry = entries.get(stored[0]) if len(stored) == 1 and not moved else None
        # no inputs by name: computed by sanitize, not a byte copy, rename or stack of A's tensor
        if entry is not None and not entry.inputs and tuple(entry.shape) == tuple(ca.info(n).shape):
            computed[n] = entry
    return source, computed


class AsLoaded(Mapping):
    """A's tensors read through ``through`` (its checkpoint, or the read-ahead stream), except ``computed``
    (``ffn_as_loaded``): those as the MLX plan computes them from ``source``."""

    def __init__(self, through: Mapping, source: Checkpoint, computed: dict):
        self.through, self.source, self.computed = through, source, computed

    def __getitem__(self, name: str):
        entry = self.computed.get(name)
        return self.through[name] if entry is None else as_exported(entry, self.source)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.through

    def __iter__(self):
        return iter(self.through)

    def __len__(self) -> int:
        return len(self.through)


def reconcile(outside, cb, compare, plan: tuple | None) -> list[str]:
    """Settle ``outside``'s failures for an MLX B through A's MLX export; returns notes.

    Args:
        outside: the ``OutsideResult`` of the plain pairing (its lists are updated in place).
        cb: B's checkpoint (an MLX model).
        compare: ``(name, a_tensor, b_tensor, bits_b) -> str | None``, the outside check's own comparison (None:
            within tolerance or identical).
        plan: A's MLX export plan (``export_plan``; None: B is not MLX, A is, or A does not export to MLX).
    """
    if plan is None or outside.skipped or outside.passed:
        return []
    source, entries, dropped = plan
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
            a = as_exported(entry, source)
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
