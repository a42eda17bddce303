"""B paired with A as B's client loads it: A through the transforms B's client applies to its own checkpoints.

An MLX model is what ``mlx_lm``'s ``sanitize`` makes of a Hugging Face checkpoint: names prefixed
(``language_model.``), tensors computed (DeepSeek's ``embed_q``/``unembed_out`` from ``kv_b_proj``, Qwen3-Next's
norms +1, conv weights transposed), buffers dropped. Reading B back cannot undo every one of those (a constant
added in bfloat16 rounds), so B is not compared by name with A where sanitize computed it: which of B's tensors
its load computes is decided from A's MLX export plan (``converters.mlx.matching.mlx_entries``: mlx_lm's own
model class and sanitize) and B's view before anything is compared (``derives``), and each is compared once, B's
MLX tensors as stored against what that plan computes from A (``compare``): bit for bit where B stores it
unquantized in the plan's dtype, re-quantized where B is quantized, else within the tolerance row. A norm B holds
shifted twice, or not at all, differs from A's shifted once and fails, naming it. A's tensors sanitize uses or
drops are not looked for in B. Nothing compared by name is forgiven after.

The FFNs are paired the same way, before their checks (``computed``): where B is MLX and A is not, each
of A's FFN tensors that the plan computes through sanitize (Falcon-H1's ``mlp_multipliers`` folded into gate
and down, ``param *= m``) and that B's view reads back by plain rename is taken as the plan computes it, bit
for bit: A as mlx_lm loads it. The engine's note names them. B's FFN must then equal that (or re-quantize from
it), so a different factor, or gate and up swapped, still fails.
"""

from __future__ import annotations

import logging

from ffn_tools.checks.diagnose import first_difference
from ffn_tools.checks.outside import DIFFER, IDENTICAL, WITHIN, Derived
from ffn_tools.pairing import Pairing
from ffn_tools.errors import FFNToolsError, listing
from ffn_tools.io.store import Checkpoint

from .requant import check_requantized
from .scheme import SCHEMES

log = logging.getLogger(__name__)


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

    def derives(self, a_names, b_names) -> tuple[frozenset[str], frozenset[str]]:
        """B's tensors outside the FFNs that mlx_lm's sanitize computes from A's (decided from the export plan and
        B's view before any comparison): those read back from MLX tensors the plan computes through sanitize (no
        input by name: a norm it added 1.0 to, ``embed_q`` from ``kv_b_proj``, a folded multiplier), or taken
        back by removing a constant it added, or with no tensor of that name in A; and A's the plan uses for them
        or sanitize drops, which B has no tensor of."""
        sources, derived, used = self.cb.inverse.sources, set[str](), set[str]()
        for n in b_names:
            stored = self.cb.made_from(n)
            if not stored or any(m not in self.entries for m in stored):
                continue  # not made by A's export: compared by name (and listed where it is only in B)
            entries = [self.entries[m] for m in stored]
            offset = n in sources and sources[n].offset
            if offset or n not in a_names or any(not e.inputs for e in entries):
                derived.add(n)
                used.update(i for e in entries for i in e.inputs)
        gone = {n for n in a_names if n not in b_names and (n in used or n in self.dropped)}
        return frozenset(derived), frozenset(gone)

    def compare(self, names, compare) -> tuple[list[Derived], list[str]]:
        """Each of B's tensors ``names`` (``derives``'s) against A through its MLX export plan, once: B's MLX
        tensors as stored (not as the view reads them back) against what the plan computes from A, re-quantized
        with B's parameters where B is quantized, bit for bit where B stores them unquantized in the plan's dtype,
        else within the tolerance row."""
        outcomes = [self._compare_one(n, compare) for n in names]
        exact = sum(d.outcome == IDENTICAL for d in outcomes)
        notes = [f"{len(names)} of B's tensors compared with what mlx_lm's sanitize makes of A's, as mlx_lm loads B "
                 f"(the MLX export's own plan; {exact} bit for bit, re-quantized where B is quantized): "
                 f"{listing(list(names), 4)}"] if names else []
        return outcomes, notes

    def _compare_one(self, name: str, compare) -> Derived:
        whys: list[str] = []
        same = True
        for m in self.cb.made_from(name):  # B's MLX tensors it is read from, as mlx_lm names them
            a = as_exported(self.entries[m], self.source)
            b, parts = self.cb.read_stored(m).to_torch(), self.cb.stored_parts(m)
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
        if whys:
            return Derived(name, DIFFER, "; ".join(whys) + " (B as mlx_lm's sanitize makes it of A)")
        return Derived(name, IDENTICAL if same else WITHIN)
