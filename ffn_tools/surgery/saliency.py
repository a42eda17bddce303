"""``ffn-tools saliency``: each MoE layer's experts scored on prompts, for ``prune-experts --saliency``.

For every routed expert: REAP's score (the mean, over the tokens routed to it, of its router weight times the
norm of its output, ``‖E_e(x)‖₂``) and its routing frequency (the share of tokens routed to it). The model runs
in transformers (v5's MoE blocks: a ``gate``/``router`` giving each token's top-k experts and weights, and an
``experts`` module run as ``experts(hidden, top_k_index, top_k_weights)``: Mixtral, Qwen2/3-MoE, DeepSeek-V3,
GPT-OSS); a hook on each ``experts`` module sees the routing and runs each routed expert alone on its tokens (one
weight, itself), so the score is of the expert's own output. One prompt at a time, nothing kept but the sums.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ..errors import FFNToolsError

log = logging.getLogger(__name__)

# A small built-in prompt set (prose, code, arithmetic, dialogue, lists): used when no --prompts file is given.
PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Question: what is 17 times 23? Answer: 17 times 23 is 391, because 17 times 20 is 340 and 17 times 3 is 51.",
    "User: Can you recommend a good book about the ocean?\nAssistant: Certainly. One widely loved choice is",
    "Ingredients: two cups of flour, one teaspoon of salt, three eggs, and a cup of milk. Whisk the eggs first,",
    "SELECT name, count(*) FROM orders JOIN customers ON orders.customer_id = customers.id GROUP BY name;",
    "In mathematics, a group is a set with an operation that is associative, has an identity element, and",
    "Le soleil se couchait lentement sur la ville, et les rues se remplissaient de passants pressés qui",
)
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def read_prompts(path: str | None) -> list[str]:
    """The prompts of ``path`` (a JSON list of strings, or one prompt a line), or the built-in set."""
    if path is None:
        return list(PROMPTS)
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except ValueError:
        data = [line for line in text.splitlines() if line.strip()]
    if not isinstance(data, list) or not data or not all(isinstance(p, str) for p in data):
        raise FFNToolsError(f"--prompts {path}: a JSON list of strings, or one prompt a line")
    return data


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


def saliency(path, *, prompts: str | None = None, max_tokens: int = 512) -> dict:
    """Each MoE layer's experts' REAP score and routing frequency on ``prompts`` (a file; None: the built-in
    set), each prompt cut to ``max_tokens`` tokens; what ``saliency -o`` writes (``top_scored`` reads it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = read_prompts(prompts)
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
    layers = {str(k): {"reap": [r / n if n else 0.0 for r, n in zip(s.reap, s.routed)],
                       "frequency": [n / tokens for n in s.routed]} for k, s in sorted(sums.items())}
    return {"prompts": len(texts), "tokens": tokens, "layers": layers,
            "scores": {"reap": "mean over the tokens routed to the expert of its router weight x the norm of its "
                               "output", "frequency": "the share of tokens routed to the expert"}}
