"""A transformers model run with some routed experts masked out of its routing: what ``verify --logits`` holds a
pruned B against (``Client.masked_logits``, ``ffn_tools.verification.expert_map.masking``).

Each MoE layer's router is found by its weight's name (``layers.N.<...>.gate.weight``, ``router.weight``,
``gate.wg.weight``: ``ROUTER_MODULES``) and its forward wrapped:

- a router with a selection-score bias (DeepSeek's sigmoid router, ``e_score_correction_bias``): that bias is
  -inf at the dropped experts, so they are never chosen while the kept experts' weights are the sigmoid scores as
  before (with one expert group this is the pruned model);
- any other router (a softmax router: Mixtral, Qwen-MoE; GPT-OSS's top-k of its logits, then softmax): its
  logits, the output of ``F.linear`` of its own weight, are -inf at the dropped experts (caught by a
  ``TorchFunctionMode`` while the router runs), so the softmax renormalizes over the kept ones.

Before each masked call the router runs unmasked once more, on the same hidden states, for the routing mass each
layer loses: the share of the top-k routing weight (its second output, over the indices of its third) the
dropped experts would have had. Then A runs once more unmasked (its own model, not the pruned one), for the share
of each layer's router probability (softmax of its logits; a selection-bias router's sigmoid scores, normalized)
on the dropped experts, mean and max over the tokens: ``verify``'s routing mass B dropped, reported as information.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from ffn_tools.errors import FFNToolsError

ROUTER_MODULES = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[^.]+\.)*?(?:gate|router|gate\.wg)\.weight$")
SELECTION_BIAS = "e_score_correction_bias"  # DeepSeek: added to the scores to choose, not to weigh


class _MaskLogits(TorchFunctionMode):
    """``F.linear`` of ``weight``'s output -inf at ``dropped`` (the router's logits), any other call as it is."""

    def __init__(self, weight: torch.Tensor, dropped: torch.Tensor):
        super().__init__()
        self.weight, self.dropped = weight, dropped

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear and len(args) > 1 and args[1] is self.weight:
            out = out.index_fill(-1, self.dropped, float("-inf"))
        return out


def routers(model) -> dict[int, torch.nn.Module]:
    """Each MoE layer's router module, by its weight's name."""
    out: dict[int, torch.nn.Module] = {}
    for name, _ in model.named_parameters():
        m = ROUTER_MODULES.search(name)
        if m:
            out.setdefault(int(m.group(1)), model.get_submodule(name.rsplit(".", 1)[0]))
    return out


def _mass(output, dropped: torch.Tensor) -> float | None:
    """The share of the top-k routing weight on ``dropped`` in a router's ``(logits, weights, indices)``, mean over
    the tokens (None: a router giving something else)."""
    if not (isinstance(output, tuple) and len(output) == 3 and not output[2].is_floating_point()):
        return None
    weights, idx = output[1].double(), output[2]
    lost = (weights * torch.isin(idx, dropped)).sum(-1) / weights.sum(-1).clamp_min(1e-300)
    return float(lost.mean())


def _shares(output, dropped: torch.Tensor, sigmoid: bool) -> torch.Tensor | None:
    """Per token, the share of a router's probability on ``dropped``, from the logits its ``(logits, weights,
    indices)`` starts with: softmax over every expert, or (``sigmoid``: a selection-bias router) the sigmoid scores
    normalized by their sum (None: a router giving something else)."""
    if not (isinstance(output, tuple) and output and torch.is_tensor(output[0]) and output[0].is_floating_point()):
        return None
    logits = output[0].double()
    p = logits.sigmoid() if sigmoid else logits.softmax(-1)
    return (p.index_select(-1, dropped).sum(-1) / p.sum(-1).clamp_min(1e-300)).reshape(-1)


def mask(model, dropped: dict[int, tuple[int, ...]], ungrouped: bool,
         shares: dict[int, list] | None = None) -> dict[int, list]:
    """``model``'s routers wrapped (module docstring); the lists each layer's routing mass lost fills, per call.
    Where ``shares`` is given, ``shares["on"]`` set to True runs the routers unmasked instead, each call's
    per-token probability share on the dropped experts (``_shares``) appended to ``shares[layer]``.

    Raises:
        FFNToolsError: a layer to mask has no router found, or one with fewer rows than an expert named.
    """
    found, lost = routers(model), dict[int, list]()
    if ungrouped:
        for r in found.values():
            if isinstance(getattr(r, "num_group", None), int):  # DeepSeek's TopkRouter reads these per call
                setattr(r, "num_group", 1)
                setattr(r, "topk_group", 1)
    for layer, experts in dropped.items():
        router = found.get(layer)
        if router is None:
            raise FFNToolsError(f"transformers: no router found in layer {layer} of the model (a parameter named "
                                f"layers.{layer}.*.gate.weight or router.weight) to mask experts {list(experts)} in")
        weight = router.get_parameter("weight")
        if max(experts) >= weight.shape[0]:
            raise FFNToolsError(f"transformers: layer {layer}'s router has {weight.shape[0]} rows; cannot mask "
                                f"expert {max(experts)}")
        idx = torch.tensor(experts, dtype=torch.long)
        lost[layer] = []
        bias = dict(router.named_buffers(recurse=False)).get(SELECTION_BIAS)
        if bias is None:
            bias = dict(router.named_parameters(recurse=False)).get(SELECTION_BIAS)
        forward = router.forward

        if shares is not None:
            shares[layer] = []

        def wrapped(*args, forward=forward, weight=weight, idx=idx, bias=bias, into=lost[layer], layer=layer,
                    **kwargs):
            if shares is not None and shares.get("on"):
                out = forward(*args, **kwargs)
                shares[layer].append(_shares(out, idx, bias is not None))
                return out
            into.append(_mass(forward(*args, **kwargs), idx))
            if bias is not None:
                kept = bias.data.clone()
                bias.data.index_fill_(0, idx, float("-inf"))
                try:
                    return forward(*args, **kwargs)
                finally:
                    bias.data.copy_(kept)
            with _MaskLogits(weight, idx):
                return forward(*args, **kwargs)

        router.forward = wrapped
    return lost


def masked_logits(path: Path, tokens, dtype: str | None, dropped: dict[int, tuple[int, ...]], ungrouped: bool):
    """``Transformers.masked_logits``: the logits (float64), the loading problems, each masked layer's routing
    mass lost (mean over the router's calls), and each masked layer's share of A's own router probability on the
    dropped experts, ``{"mean", "max"}`` over the tokens (A run once more, unmasked: module docstring)."""
    from .loading import load_model

    model, problems = load_model(path, dtype)
    shares: dict = {}
    lost = mask(model, dropped, ungrouped, shares)
    with torch.no_grad():
        logits = model.eval()(tokens).logits.to(torch.float64)
        if dropped:
            shares["on"] = True
            model(tokens)
    mass = {k: sum(v) / len(v) for k, v in lost.items() if v and None not in v}
    held = {k: torch.cat(v) for k, v in shares.items() if k != "on" and v and None not in v}
    return logits, problems, mass, {k: {"mean": float(t.mean()), "max": float(t.max())} for k, t in held.items()}
