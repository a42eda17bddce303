"""``verify A B`` where B records an expert mapping (``prune-experts``, ``reorder-experts``: ``surgery.mapping``):
each of B's routed experts is paired with its source expert in A through the mapping (then compared as every pair
is, bit for bit), the experts B dropped are named and left out of the pairing, and the routers' tensors are
compared row by row through the mapping here (B's row n must be A's row of B's expert n's source, bit for bit)
instead of as tensors outside the FFNs, whose shapes differ.

``paired`` runs once both sides' FFNs are found and before they are compared (``engine``'s ``_pair``); it returns
the sides unchanged where B records no mapping. Where A records one too (both pruned from one source), B's
experts are paired with A's holding the same source expert.
"""

from __future__ import annotations

import dataclasses

import torch

from ..detect import FFNSet
from ..errors import FFNToolsError
from ..ffn import FFNRef
from ..surgery import mapping
from ..surgery.layers import moe_layers
from ..surgery.routers import EXPERT_COUNT_KEYS, GROUP_KEY
from ..specs import spans


def _sources(ckpt, experts: dict[int, int]) -> dict[int, tuple[int, ...]]:
    """Each MoE layer's source expert of each of ``ckpt``'s experts (itself where it records no mapping)."""
    rec = mapping.recorded(ckpt)
    if rec is None:
        return {k: tuple(range(n)) for k, n in experts.items()}
    return rec["layers"]


def paired(report, ca, cb, fa: FFNSet, fb: FFNSet) -> tuple[FFNSet, FFNSet]:
    """A's and B's FFNs as ``verify`` pairs them where B records an expert mapping: A's routed experts re-keyed
    to the B expert made from each (those B dropped left out, said in ``report.notes``), both sides' router
    tensors counted as FFN tensors (not compared outside) and compared here through the mapping (a row out of
    step is a problem in ``report``). Unchanged where B records none."""
    rec = mapping.recorded(cb)
    if rec is None:
        return fa, fb
    try:
        la, lb = moe_layers(ca, fa), moe_layers(cb, fb)
    except FFNToolsError as e:
        report.problems.append(f"B records an expert mapping ({mapping.FILE}), but the experts cannot be paired "
                               f"through it: {e}")
        return fa, fb
    held = _sources(ca, {k: m.experts for k, m in la.items()})
    problems, dropped, pairs = [], [], {}
    if set(rec["layers"]) != set(la) or set(lb) != set(la):
        problems.append(f"B's expert mapping names layers {spans(rec['layers'])}; A's MoE layers are {spans(la)}, "
                        f"B's {spans(lb)}")
    for layer, sources in sorted(rec["layers"].items()):
        if layer not in la or layer not in lb:
            continue
        where = {s: i for i, s in enumerate(held[layer])}  # source expert -> A's index holding it
        if len(sources) != lb[layer].experts:
            problems.append(f"layer {layer}: B's expert mapping names {len(sources)} experts, B holds "
                            f"{lb[layer].experts}")
            continue
        lost = [s for s in sources if s not in where]
        if lost:
            problems.append(f"layer {layer}: B's experts come from source experts {spans(lost)}, which A does not "
                            "hold")
            continue
        index = tuple(where[s] for s in sources)  # B's expert n is A's expert index[n]
        pairs[layer] = index
        dropped += [f"layer {layer} expert {e}" for e in range(la[layer].experts) if e not in index]
        problems += _routers(ca.stored, cb.stored, la[layer].routers, lb[layer].routers, index, layer)
    report.problems += problems
    rekeyed = []
    for f in fa.ffns:
        if f.ref.kind == "expert" and f.ref.layer in pairs:
            index = pairs[f.ref.layer]
            if f.ref.expert in index:
                rekeyed.append(dataclasses.replace(f, ref=FFNRef(f.ref.layer, "expert", index.index(f.ref.expert))))
            continue
        rekeyed.append(f)
    moved = sum(1 for k, v in pairs.items() for n, e in enumerate(v) if n != e)
    report.notes.append(
        f"B records an expert mapping ({rec.get('command', 'expert surgery')}, {mapping.FILE}): each of B's experts "
        f"is compared with its source expert in A ({moved} renumbered; the table numbers B's experts), the "
        f"routers' rows through it ({sum(len(la[k].routers) for k in pairs)} router tensors"
        f"{', every row in step' if not problems else ''})"
        + (f"; A's experts B dropped are not compared: {', '.join(dropped)}" if dropped else ""))
    if explained(ca, cb):
        report.notes.append("config.json's expert count differs as B's mapping says (its kept experts): accepted in "
                            "the config check")
    routers_a = {n for m in la.values() for n in m.routers}
    routers_b = {n for m in lb.values() for n in m.routers}
    return (dataclasses.replace(fa, ffns=tuple(sorted(rekeyed, key=lambda f: f.ref)), tensors=fa.tensors | routers_a),
            dataclasses.replace(fb, tensors=fb.tensors | routers_b))


def explained(ca, cb) -> list[str]:
    """The expert-count keys of config.json whose difference B's recorded mapping explains: B's count is the number
    of experts each layer of its mapping holds, and A's is not, under any of the count's names ([] where B records
    none)."""
    rec = mapping.recorded(cb)
    if rec is None or not rec["layers"]:
        return []
    kept = {len(v) for v in rec["layers"].values()}
    held = [k for k in EXPERT_COUNT_KEYS if {_count(cb.config, k)} == kept != {_count(ca.config, k)}]
    return list(EXPERT_COUNT_KEYS) if held else []  # every name of the count (a reader may hold one of several)


def _count(config: dict | None, key: str):
    """``config``'s value at (dotted) ``key``, or None."""
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(t.shape[0], -1).view(torch.uint8) if t.numel() else t.reshape(t.shape[0], 0)


def _routers(ca, cb, names_a: list[str], names_b: list[str], index: tuple[int, ...], layer: int) -> list[str]:
    """B's router tensors against A's rows ``index``, bit for bit as stored (a quantized router's codes, scales
    and biases each); the problems found."""
    if sorted(names_a) != sorted(names_b):
        return [f"layer {layer}: the router's tensors differ: A has {', '.join(names_a)}, B {', '.join(names_b)}"]
    out = []
    for name in names_a:
        a, b = _bits(ca[name]), _bits(cb[name])
        if a.dtype != b.dtype or a.shape[1:] != b.shape[1:] or b.shape[0] != len(index):
            out.append(f"{name}: B's {list(cb.info(name).shape)} {cb.info(name).st_dtype} is not A's "
                       f"{list(ca.info(name).shape)} {ca.info(name).st_dtype} cut to {len(index)} rows")
            continue
        for n, e in enumerate(index):
            if not torch.equal(a[e], b[n]):
                same = [k for k in range(a.shape[0]) if torch.equal(a[k], b[n])]
                held = f"A's row {same[0]}" if same else "no row of A's"
                out.append(f"{name}: B's row {n} (expert {n}) is {held}, not A's row {e} (the mapping's source "
                           "expert): the router is out of step with the experts")
    return out


@dataclasses.dataclass
class Masking:
    """What ``verify --logits`` runs A with where B records an expert mapping (``masked``).

    Attributes:
        dropped: A's MoE layer -> A's experts B does not hold (their router logits masked to -inf in A's run;
            empty for a reorder: A runs as it is).
        ungrouped: A's config routes in expert groups (DeepSeek's n_group > 1): the pruned model regroups its
            kept experts, which A masked does not, so both sides run with one group instead.
        row: the dtype row (``tolerances.DTYPE_TOLERANCES``) of A's routers: the logits are held to it, widened,
            where they would be bit for bit (B's router has fewer or reordered rows, its experts' outputs summed
            in another order: equal up to that rounding, not bit for bit).
    """

    dropped: dict[int, tuple[int, ...]]
    ungrouped: bool
    row: str
    lost: dict[int, float] = dataclasses.field(default_factory=dict)  # filled by A's run (Client.masked_logits)
    # A's own router probability on the experts B dropped, per layer {"mean", "max"} over the tokens (A's run)
    mass: dict[int, dict] = dataclasses.field(default_factory=dict)
    layers: tuple[int, ...] = ()  # every MoE layer B's mapping names (those dropping none lose 0, unmeasured)

    def describe(self) -> str:
        """The words for the logits line: what A ran as, and the most routing mass a layer lost."""
        n = sum(len(v) for v in self.dropped.values())
        what = (f"A with the {n} expert{'s' * (n != 1)} B dropped masked out of its routing" if n
                else "A as it is (B reorders its experts)")
        if self.lost:
            worst = max(self.lost, key=lambda k: self.lost[k])
            what += f" (routing mass lost on these tokens: up to {self.lost[worst]:.1%}, layer {worst})"
        return what + ("; both sides routed in one expert group (B regroups its experts)" if self.ungrouped else "")

    def as_dict(self) -> dict:
        return {"dropped": {str(k): list(v) for k, v in sorted(self.dropped.items())}, "ungrouped": self.ungrouped,
                "routing_mass_lost": {str(k): v for k, v in sorted(self.lost.items())}, "row": self.row,
                "routing_mass_dropped": {str(k): self.mass[k] if k in self.dropped else {"mean": 0.0, "max": 0.0}
                                         for k in sorted({*self.layers, *self.mass})
                                         if k in self.mass or k not in self.dropped}}


def mass_note(masked: dict, tokens: int, client: str) -> str:
    """The expert-map check's line for ``masked`` (``Masking.as_dict``): each layer's share of A's router
    probability on the experts B dropped, over ``tokens`` tokens (0 in a layer where B drops none)."""
    what = ("the routing mass B dropped (A's own router probability on the experts B dropped, softmax or sigmoid "
            f"as it routes, over --logits' {tokens} tokens; information, not a pass/fail criterion): ")
    mass = masked.get("routing_mass_dropped") or {}
    if not mass or not set(masked["dropped"]) <= set(mass):
        return what + f"not measured ({client} gives no router logits for it)"
    return what + "; ".join(f"layer {k} mean {v['mean']:.1%}, max {v['max']:.1%}" for k, v in mass.items())


def masking(pa, pb) -> Masking | None:
    """How A must run for its logits to be B's where B (at ``pb``) records an expert mapping, or None where it
    records none. A softmax router's dropped experts masked to -inf before its softmax is the pruned model
    (renormalization included); a top-k-then-softmax router's (GPT-OSS) too; DeepSeek's sigmoid router masks the
    selection score (correction bias included), which holds with one expert group: grouped routing is run
    ungrouped on both sides (``Masking.ungrouped``)."""
    from ..adapters.formats import open_checkpoint
    from ..detect import find_ffns
    from ..tolerances import coarsest

    with open_checkpoint(pb) as cb:
        rec = mapping.recorded(cb)
        if rec is None:
            return None
        with open_checkpoint(pa, like=cb) as ca:
            la = moe_layers(ca, find_ffns(ca))
            held = _sources(ca, {k: m.experts for k, m in la.items()})
            dtypes = {ca.stored.info(n).st_dtype for m in la.values() for n in m.routers}  # as stored (MLX: codes)
            config = ca.config or {}
    dropped = {}
    for layer, sources in rec["layers"].items():
        if layer in held:
            dropped[layer] = tuple(i for i, s in enumerate(held[layer]) if s not in set(sources))
    groups = [c.get(GROUP_KEY) for c in (config, *(v for v in config.values() if isinstance(v, dict)))]
    row = coarsest({"F16": "float16", "BF16": "bfloat16"}.get(d, "float32") for d in dtypes)
    return Masking({k: v for k, v in dropped.items() if v}, any(isinstance(g, int) and g > 1 for g in groups), row,
                   layers=tuple(sorted(dropped)))
