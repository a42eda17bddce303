"""B paired with A as B's client loads it: A through the transforms B's client applies to its own checkpoints.

An MLX model is what ``mlx_lm``'s ``sanitize`` makes of a Hugging Face checkpoint: names prefixed
(``language_model.``), tensors computed (DeepSeek's ``embed_q``/``unembed_out`` from ``kv_b_proj``, Qwen3-Next's
norms +1, conv weights transposed), buffers dropped. Reading B back cannot undo every one of those, so the plain
pairing by name lists them as differences although the export is exactly what ``mlx_lm.convert`` writes. Where
that pairing fails, the failing tensors are compared again against A exported by the same plan the MLX export
runs (``converters.mlx.exporter.mlx_entries``: mlx_lm's own model class and sanitize): a B tensor equal to what
sanitize makes of A passes, exactly where B stores it unquantized in the same dtype; A's tensors that sanitize
consumed or dropped are then not missing from B. What still differs stays a failure.

The FFNs are paired the same way, before their checks (``computed``): where B is MLX and A is not, each
of A's FFN tensors that the plan computes through sanitize (Falcon-H1's ``mlp_multipliers`` folded into gate
and down, ``param *= m``) and that B's view reads back by plain rename is taken as the plan computes it, bit
for bit: A as mlx_lm loads it. The engine's note names them. B's FFN must then equal that (or re-quantize from
it), so a different factor, or gate and up swapped, still fails.
"""

from __future__ import annotations

import logging

from ffn_tools.checks.diagnose import first_difference
from ffn_tools.clients import Pairing
from ffn_tools.errors import FFNToolsError, listing
from ffn_tools.io.store import Checkpoint

from .requant import check_requantized
from .scheme import SCHEMES

log = logging.getLogger(__name__)


def _name(line: str) -> str:
    """The tensor a failure line of ``OutsideResult.differ`` names (the text before ``[`` or ``:``)."""
    return line.split(":", 1)[0].split("[", 1)[0]


def as_exported(entry, source: Checkpoint):
    """The torch tensor the MLX plan's ``entry`` computes from A (``source``)."""
    from .quant import RawTensor

    made = entry.apply([source[n] for n in entry.inputs])
    return made.to_torch() if isinstance(made, RawTensor) else made


class AsMlxLoads(Pairing):
    """A through its MLX export plan (``exporter.mlx_entries``: mlx_lm's own model class and sanitize), against
    MLX B (``view.MLXCheckpoint``: ``made_from``, ``read_stored``, ``stored_parts``, ``inverse``)."""

    def __init__(self, ca, cb, plan: tuple):
        self.ca, self.cb = ca, cb
        self.source, self.entries, self.dropped = plan
        self._computed: dict = {}

    @classmethod
    def of(cls, ca, cb) -> "AsMlxLoads | None":
        """A's MLX export plan, built once per verify; None where A does not export to MLX (logged)."""
        from .matching import mlx_entries

        try:
            return cls(ca, cb, mlx_entries(ca))
        except FFNToolsError as e:
            log.info("A is not exported to MLX here (%s): B is paired with A's tensors as stored, by name", e)
            return None

    def computed(self, names: list[str]) -> set[str]:
        """A's tensors among ``names`` that the plan computes through mlx_lm's sanitize and B's view reads back by
        plain rename (same shape)."""
        sources = self.cb.inverse.sources  # what the view traced back; the rest keeps its MLX name (or a slice)
        for n in names:
            stored: tuple[str, ...] = self.cb.made_from(n) if n in self.cb else ()
            moved = n in sources and sources[n].kind != "rename"  # a stack's slice, or gathered back: not as stored
            entry = self.entries.get(stored[0]) if len(stored) == 1 and not moved else None
            # no inputs by name: computed by sanitize, not a byte copy, rename or stack of A's tensor
            if entry is not None and not entry.inputs and tuple(entry.shape) == tuple(self.ca.info(n).shape):
                self._computed[n] = entry
        return {n for n in names if n in self._computed}

    def read(self, name: str):
        return as_exported(self._computed[name], self.source)

    def describe(self, names) -> str:
        return (f"B is MLX: {len(names)} of A's FFN tensors compared as mlx_lm's sanitize computes them from A (the "
                "MLX export's own computation, bit for bit), not as A stores them (A as mlx_lm loads it): "
                f"{listing(sorted(names), 4)}")

    def settle(self, outside, cb, compare) -> list[str]:
        """Settle ``outside``'s failures for an MLX B through A's MLX export; returns notes (see ``Pairing``)."""
        if outside.skipped or outside.passed:
            return []
        entries = self.entries
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
                a = as_exported(entry, self.source)
                b, parts = cb.read_stored(m).to_torch(), cb.stored_parts(m)
                outcome, why = check_requantized(m, a, parts) if parts is not None else ("within", None)
                if outcome == "within":  # not quantized, or its bits cannot be reproduced: bits or the tolerance row
                    params = parts[3] if parts is not None else None
                    lossless = params is None and a.dtype == b.dtype
                    bits = SCHEMES[params["mode"]].row_bits(params) if params else None
                    why = first_difference(m, a, b) if lossless else compare(m, a, b, bits)
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
        gone = [n for n in outside.only_a if n in consumed or n in self.dropped]
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
