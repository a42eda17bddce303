"""``ffn-tools saliency`` of a transformers checkpoint (``Transformers.expert_saliency``): the sums REAP's score and
the routing frequency are made of (``ffn_tools.surgery.saliency``).

Transformers v5's MoE blocks: a ``gate``/``router`` giving each token's top-k experts and weights, and an
``experts`` module run as ``experts(hidden, top_k_index, top_k_weights)`` (Mixtral, Qwen2/3-MoE, DeepSeek-V3,
GPT-OSS); a hook on each ``experts`` module sees the routing and runs each routed expert alone on its tokens (one
weight, itself), so the score is of the expert's own output. One prompt at a time, nothing kept but the sums.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ffn_tools.errors import FFNToolsError

log = logging.getLogger(__name__)
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class _Sums:
    """One layer's running sums: REAP's numerator and the routed tokens, per expert."""

    def __init__(self, experts: int):
        self.reap = [0.0] * experts
        self.routed = [0] * experts


def _hook(sums: _Sums, busy: list[bool]):
    import torch

    def hook(module, args, output):
        if busy[0] or len(args) < 3:
            return None
        hidden, index, weights = args[0], args[1], args[2]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        busy[0] = True
        try:
            for e in torch.unique(index).tolist():
                routed = (index == e)
                rows = routed.any(-1)
                w = (weights * routed).sum(-1)[rows].float()
                n = int(rows.sum())
                alone = module(hidden[rows], torch.full((n, 1), e, dtype=index.dtype),
                               torch.ones((n, 1), dtype=weights.dtype))
                sums.reap[e] += float((w * alone.float().norm(dim=-1)).sum())
                sums.routed[e] += n
        finally:
            busy[0] = False
        return None

    return hook


def expert_saliency(path: Path, texts: list[str], max_tokens: int) -> tuple[int, dict[int, tuple[list, list]]]:
    """The tokens run, and each MoE layer's per-expert sums: of router weight x the norm of the expert's own
    output over the tokens routed to it, and the count of those tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise FFNToolsError(f"{path}: no tokenizer to run prompts through ({e})") from None
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    sums: dict[int, _Sums] = {}
    busy = [False]
    handles = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        router = getattr(module, "gate", None) or getattr(module, "router", None)
        m = LAYER.search(name + ".")
        if experts is None or router is None or m is None or not isinstance(experts, torch.nn.Module):
            continue
        count = int(getattr(experts, "num_experts", 0) or getattr(router, "num_experts", 0))
        if not count:
            continue
        sums[int(m.group(1))] = s = _Sums(count)
        handles.append(experts.register_forward_hook(_hook(s, busy)))
    if not sums:
        raise FFNToolsError(f"{path}: no MoE block found (a module with experts and a gate or router)")
    tokens = 0
    try:
        with torch.no_grad():
            for i, text in enumerate(texts):
                ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :max_tokens]
                model(ids)
                tokens += ids.shape[1]
                log.info("saliency: prompt %d of %d (%d tokens so far)", i + 1, len(texts), tokens)
    finally:
        for h in handles:
            h.remove()
    return tokens, {k: (s.reap, s.routed) for k, s in sums.items()}
