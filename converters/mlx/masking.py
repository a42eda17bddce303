"""An mlx_lm model run with some routed experts masked out of its routing: what ``verify --logits`` holds a pruned
B against (``Client.masked_logits``; the transformers side is ``converters.pytorch.masking``).

Each MoE layer's router is the module named ``layers.N.<...>.gate`` or ``.router`` (mlx_lm's ``mlp.gate``,
``block_sparse_moe.gate``, GPT-OSS's ``mlp.router``), replaced in its parent by a function calling it:

- a router choosing by a selection-score bias (DeepSeek's ``MoEGate``, ``e_score_correction_bias``): called with
  that bias -inf at the dropped experts;
- a linear router (its output the router logits, softmaxed or top-k'd by the block): its output plus 0 / -inf.

Before each masked call the router runs unmasked on the same input for the routing mass each layer loses: the
share of the top-k routing weight the dropped experts would have had (a linear router's: of the softmax of its
logits over the top-k, which is GPT-OSS's weights and the others' up to their renormalization; DeepSeek's: of its
scores). Then A runs once more unmasked for the share of a linear router's softmax probability on the dropped
experts, every token (``verify``'s routing mass B dropped; not measured for a selection-bias router, whose gate
gives no logits).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ffn_tools.errors import FFNToolsError
from ffn_tools.surgery.routers import NESTED, TOP_K_KEYS

ROUTERS = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[^.]+\.)*?(?:gate|router)$")
SELECTION_BIAS = "e_score_correction_bias"


def _top_k(path: Path) -> int:
    config = json.loads((Path(path) / "config.json").read_text())
    for c in (config, *(config.get(k) for k in NESTED if isinstance(config.get(k), dict))):
        for key in TOP_K_KEYS:
            if isinstance(c.get(key), int):
                return c[key]
    raise FFNToolsError(f"{path}: config.json names no experts-per-token ({', '.join(TOP_K_KEYS)})")


def _parent(model, name: str):
    *path, last = name.split(".")
    obj = model
    for part in path:
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj, last


def _share(inds, weights, dropped) -> list[float]:
    import mlx.core as mx
    import numpy as np

    hit = (inds[..., None] == dropped).any(axis=-1)
    w = weights.astype(mx.float32)
    lost = (w * hit).sum(axis=-1) / mx.maximum(w.sum(axis=-1), 1e-30)
    return [float(np.asarray(mx.mean(lost)))]


def mask(model, path: Path, dropped: dict[int, tuple[int, ...]], ungrouped: bool,
         shares: dict | None = None) -> dict[int, list]:
    """``model``'s routers replaced (module docstring); the lists each layer's routing mass lost fills, per call.
    Where ``shares`` is given, ``shares["on"]`` set to True runs a linear router unmasked instead, each call's
    per-token softmax probability on the dropped experts appended to ``shares[layer]``.

    Raises:
        FFNToolsError: a layer to mask has no router found.
    """
    import mlx.core as mx

    found: dict[int, tuple[str, object]] = {}
    for name, module in model.named_modules():
        m = ROUTERS.search(name)
        if m:
            found.setdefault(int(m.group(1)), (name, module))
    if ungrouped:
        for _, gate in found.values():
            if isinstance(gate, dict) and isinstance(getattr(gate, "n_group", None), int):
                setattr(gate, "n_group", 1)
                setattr(gate, "topk_group", 1)
    lost: dict[int, list] = {}
    k = _top_k(path) if dropped else 0
    for layer, experts in dropped.items():
        if layer not in found:
            raise FFNToolsError(f"mlx_lm: no router found in layer {layer} of the model (a module named "
                                f"layers.{layer}.*.gate or .router) to mask experts {list(experts)} in")
        name, gate = found[layer]
        idx = mx.array(list(experts))
        into = lost.setdefault(layer, [])
        if isinstance(gate, dict) and SELECTION_BIAS in gate:
            def call(x, gate=gate, idx=idx, into=into, layer=layer):
                inds, scores = gate(x)
                into += _share(inds, scores, idx)
                bias = gate[SELECTION_BIAS]
                gate[SELECTION_BIAS] = bias + _minus_inf(bias.shape[0], idx, bias.dtype)
                try:
                    return gate(x)
                finally:
                    gate[SELECTION_BIAS] = bias
        else:
            if shares is not None:
                shares[layer] = []

            def call(x, gate=gate, idx=idx, into=into, layer=layer):
                logits = gate(x)
                if shares is not None and shares.get("on"):
                    p = mx.softmax(logits.astype(mx.float32), axis=-1)
                    shares[layer].append(mx.take(p, idx, axis=-1).sum(axis=-1).reshape(-1))
                    return logits
                probs = mx.softmax(logits.astype(mx.float32), axis=-1)
                inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
                into += _share(inds, mx.take_along_axis(probs, inds, axis=-1), idx)
                return logits + _minus_inf(logits.shape[-1], idx, logits.dtype)
        parent, last = _parent(model, name)
        setattr(parent, last, call)
    return lost


def _minus_inf(n: int, idx, dtype):
    import mlx.core as mx

    return mx.where((mx.arange(n)[:, None] == idx).any(axis=-1), float("-inf"), 0.0).astype(dtype)


def masked_logits(path: Path, tokens, dtype: str | None, dropped: dict[int, tuple[int, ...]], ungrouped: bool):
    """``MLXLM.masked_logits``: the logits (float64), the loading problems, each masked layer's routing mass lost
    (mean over the router's calls), and each linear router's share of its probability on the dropped experts,
    ``{"mean", "max"}`` over the tokens (A run once more, unmasked)."""
    import mlx.core as mx
    import numpy as np
    import torch
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(path)
    except ValueError as e:  # strict loading: missing or unexpected parameters
        return torch.empty(0), [f"mlx_lm: {str(e).splitlines()[0][:300]}"], {}, {}
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    shares: dict = {}
    lost = mask(model, path, dropped, ungrouped, shares)
    out = model(mx.array(tokens.numpy()))
    logits = torch.from_numpy(np.array(out.astype(mx.float32))).to(torch.float64)
    if any(k != "on" for k in shares):
        shares["on"] = True
        mx.eval(model(mx.array(tokens.numpy())))
    mass = {k: sum(v) / len(v) for k, v in lost.items() if v}
    held = {k: np.concatenate([np.asarray(t, dtype=np.float64) for t in v]) for k, v in shares.items()
            if k != "on" and v}
    return logits, [], mass, {k: {"mean": float(t.mean()), "max": float(t.max())} for k, t in held.items()}
