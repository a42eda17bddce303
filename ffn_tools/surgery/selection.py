"""What ``--keep``, ``--drop`` and ``--order`` say, per layer: each layer's source experts in their new order.

A selection is ``0,2,5`` or ``0-5`` (the same for every MoE layer), or a JSON file: a list (the same for every
layer) or ``{layer: [experts]}`` naming every MoE layer. Every layer keeps the same count (the runtimes have one
expert count), different sets per layer.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import FFNToolsError
from ..specs import parse_spec

Chosen = dict[int, tuple[int, ...]]  # layer -> the source experts, in the new order


def _read(spec: str, option: str, layers: list[int], ordered: bool) -> dict[int, list[int]]:
    """``spec`` per layer: a JSON file's lists as written, an inline selection sorted."""
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise FFNToolsError(f"{option} {spec}: cannot read it as JSON ({e})") from None
        if isinstance(data, list):
            data = {str(layer): data for layer in layers}
        if not isinstance(data, dict):
            raise FFNToolsError(f"{option} {spec}: a JSON list of experts, or an object {{layer: [experts]}}")
        out: dict[int, list[int]] = {}
        for k, v in data.items():
            if not str(k).isdigit() or not isinstance(v, list) or not all(isinstance(e, int) and not
                                                                          isinstance(e, bool) for e in v):
                raise FFNToolsError(f"{option} {spec}: key {k!r}: a layer number mapping to a list of expert "
                                    "indices")
            out[int(k)] = list(v)
        return out
    if ordered:
        raise FFNToolsError(f"{option} {spec}: an order is a JSON file (a list, or {{layer: [experts]}})")
    experts = sorted(parse_spec(spec))
    return {layer: experts for layer in layers}


def chosen(experts: dict[int, int], *, keep: str | None = None, drop: str | None = None,
           order: str | None = None, saliency: str | None = None, keep_ratio: float | None = None,
           score: str = "reap") -> Chosen:
    """Each MoE layer's source experts in their new order, from exactly one of ``keep``, ``drop``, ``order``,
    ``saliency`` (a scores file, with ``keep_ratio``: each layer's top experts by ``score``, in source order);
    ``experts``: each MoE layer's expert count.

    Raises:
        FFNToolsError: none or several of them given, a layer not named or not a MoE layer, an expert out of
            range or named twice, layers keeping different counts, nothing kept, an order that is no permutation.
    """
    given = [(o, s) for o, s in (("--keep", keep), ("--drop", drop), ("--order", order), ("--saliency", saliency))
             if s is not None]
    if len(given) != 1:
        raise FFNToolsError("give exactly one of --keep, --drop, --saliency (prune-experts) or --order "
                            "(reorder-experts)")
    if (saliency is None) != (keep_ratio is None):
        raise FFNToolsError("--saliency FILE and --keep-ratio R go together")
    option, spec = given[0]
    if saliency is not None:
        assert keep_ratio is not None
        return top_scored(experts, saliency, keep_ratio, score)
    layers = sorted(experts)
    per = _read(spec, option, layers, ordered=option == "--order")
    unknown = sorted(set(per) - set(layers))
    missing = sorted(set(layers) - set(per))
    if unknown or missing:
        raise FFNToolsError(f"{option} {spec}: " + "; ".join(
            ([f"layers {unknown} have no routed experts (MoE layers: {layers})"] if unknown else []) +
            ([f"names no experts for MoE layers {missing}"] if missing else [])))
    out: Chosen = {}
    for layer in layers:
        n, sel = experts[layer], per[layer]
        bad = sorted({e for e in sel if not 0 <= e < n})
        twice = sorted({e for e in sel if sel.count(e) > 1})
        if bad or twice:
            raise FFNToolsError(f"{option} {spec}: layer {layer}: " + "; ".join(
                ([f"experts {bad} out of range (it has {n}: 0-{n - 1})"] if bad else []) +
                ([f"experts {twice} named twice"] if twice else [])))
        if option == "--drop":
            sel = [e for e in range(n) if e not in sel]
        elif option == "--order" and len(sel) != n:
            raise FFNToolsError(f"{option} {spec}: layer {layer}: an order names each of its {n} experts once "
                                f"(found {len(sel)}); prune-experts --keep keeps some")
        if not sel:
            raise FFNToolsError(f"{option} {spec}: layer {layer} would keep no expert")
        out[layer] = tuple(sel)
    counts = {len(v) for v in out.values()}
    if len(counts) > 1:
        raise FFNToolsError(f"{option} {spec}: every layer keeps the same number of experts (the runtimes have one "
                            "expert count); found " + ", ".join(f"layer {k}: {len(v)}" for k, v in out.items()))
    return out


def top_scored(experts: dict[int, int], path: str, ratio: float, score: str) -> Chosen:
    """Each layer's ``round(E * ratio)`` experts of the highest ``score`` in the scores file ``path`` (what
    ``saliency`` writes: ``{"layers": {layer: {score: [one per expert], ...}}}``), kept in source order; ties
    keep the lower index.

    Raises:
        FFNToolsError: an unreadable file, a layer or score missing, a count not the layer's, a ratio out of (0, 1].
    """
    if not 0 < ratio <= 1:
        raise FFNToolsError(f"--keep-ratio {ratio}: a fraction in (0, 1]")
    try:
        layers = json.loads(Path(path).read_text())["layers"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FFNToolsError(f"--saliency {path}: not a scores file ({e!r}): saliency writes one") from None
    out: Chosen = {}
    for layer, n in sorted(experts.items()):
        scores = (layers.get(str(layer)) or {}).get(score) if isinstance(layers, dict) else None
        if not isinstance(scores, list) or len(scores) != n or not all(isinstance(v, (int, float)) for v in scores):
            raise FFNToolsError(f"--saliency {path}: layer {layer}: no {score!r} list of its {n} experts' scores")
        k = max(1, round(n * ratio))
        best = sorted(range(n), key=lambda e: (-scores[e], e))[:k]
        out[layer] = tuple(sorted(best))
    return out


def kept_share(path: str, picked: Chosen) -> dict[str, dict[str, float]]:
    """Per layer, the share of each score of the scores file ``path`` (``top_scored``'s) that the ``picked``
    experts hold: what the pruning keeps of the routing (1.0 where a score sums to 0)."""
    layers = json.loads(Path(path).read_text())["layers"]
    out = {}
    for layer, kept in picked.items():
        scores = layers[str(layer)]
        out[str(layer)] = {k: (sum(v[e] for e in kept) / sum(v) if sum(v) else 1.0) for k, v in scores.items()
                           if isinstance(v, list) and len(v) > max(kept)}
    return out
