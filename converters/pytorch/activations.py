"""Activations of a transformers model (``verify --locate``): forward hooks on its decoder layers' parts, read by
their module names as transformers' model classes name them.

Per layer (``ffn_tools.verification.locate`` names the parts): the attention's input norm and output, the hidden
state after attention (the FFN norm's input), the FFN norm, the router's logits and top-k choice, the shared
expert's output (before its gate), the routed experts' combined output, the FFN block's output (the dense FFN or the
whole MoE block) and the layer's output; around them, the embedding rows, the final norm and the logits. A part the
model has not (a dense layer's router) is absent, not zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# a decoder layer's child module names -> the part it computes (the first name a layer has wins)
ATTN_NORMS = ("input_layernorm", "attention_norm", "ln_1")
ATTENTIONS = ("self_attn", "attention", "attn")
FFN_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm", "ffn_norm", "ln_2")
FFNS = ("mlp", "block_sparse_moe", "feed_forward")
ROUTERS = ("gate", "router")
SHARED = ("shared_expert", "shared_experts")
ROUTED = ("experts",)


def _first(module, names: tuple[str, ...]):
    return next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), _nn().Module)), None)


def _nn():
    import torch.nn as nn

    return nn


def _tensor(out) -> Any:
    """A module's output tensor (the first of a tuple: attention's output, a router's logits)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _choice(out) -> Any:
    """A router's top-k choice where its output carries one (an integer tensor of a tuple), else None."""
    import torch

    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point()), None)
    return None


def layers_of(model) -> Any:
    """The decoder layers (the ModuleList ``layers`` of the base model)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers named 'layers' to hook")
    return base, layers


def capture(model, sequences: list[list[int]], top_k: int | None) -> dict[str, np.ndarray]:
    """``model`` run on each of ``sequences`` (batch 1, no padding), its parts' activations captured: key (``embed``,
    ``L<i>.<part>``, ``final_norm``, ``logits``) -> float32 (positions of every sequence, features); ``L<i>.topk``
    the sorted top-k expert ids (int64). ``top_k``: experts per token, where the router gives no choice of its own."""
    import torch

    base, layers = layers_of(model)
    got: dict[str, list[np.ndarray]] = {}

    def keep(key: str, t) -> None:
        if isinstance(t, torch.Tensor):
            got.setdefault(key, []).append(t.detach().float().reshape(-1, t.shape[-1]).cpu().numpy())

    def after(key: str, router: bool = False) -> Callable:
        def hook(_m, _inp, out):
            keep(key, _tensor(out))
            if router:
                chosen = _choice(out)
                if chosen is None and top_k:
                    chosen = _tensor(out).float().topk(top_k, dim=-1).indices
                if chosen is not None:
                    c = chosen.reshape(-1, chosen.shape[-1]).sort(-1).values.cpu().numpy().astype(np.int64)
                    got.setdefault(key[: -len("router")] + "topk", []).append(c)
        return hook

    def before(key: str) -> Callable:
        def hook(_m, args):
            keep(key, args[0] if args else None)
        return hook

    handles: list = []
    add = handles.append
    if (emb := getattr(base, "embed_tokens", None)) is not None:
        add(emb.register_forward_hook(after("embed")))
    for i, layer in enumerate(layers):
        p = f"L{i}."
        if (m := _first(layer, ATTN_NORMS)) is not None:
            add(m.register_forward_hook(after(p + "attn_norm")))
        if (m := _first(layer, ATTENTIONS)) is not None:
            add(m.register_forward_hook(after(p + "attn")))
        if (m := _first(layer, FFN_NORMS)) is not None:
            add(m.register_forward_pre_hook(before(p + "after_attn")))
            add(m.register_forward_hook(after(p + "ffn_norm")))
        if (ffn := _first(layer, FFNS)) is not None:
            add(ffn.register_forward_hook(after(p + "ffn")))
            if (r := _first(ffn, ROUTED)) is not None:
                add(r.register_forward_hook(after(p + "routed")))
                if (g := _first(ffn, ROUTERS)) is not None:
                    add(g.register_forward_hook(after(p + "router", router=True)))
            if (s := _first(ffn, SHARED)) is not None:
                add(s.register_forward_hook(after(p + "shared")))
        add(layer.register_forward_hook(after(p + "hidden")))
    if (norm := getattr(base, "norm", None)) is not None:
        add(norm.register_forward_hook(after("final_norm")))
    try:
        with torch.no_grad():
            for seq in sequences:
                keep("logits", model(torch.tensor([seq])).logits)
    finally:
        for h in handles:
            h.remove()
    return {k: np.concatenate(v) for k, v in got.items()}
