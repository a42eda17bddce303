"""``ffn-tools saliency``: each MoE layer's experts scored on prompts, for ``prune-experts --saliency``.

For every routed expert: REAP's score (the mean, over the tokens routed to it, of its router weight times the
norm of its output, ``‖E_e(x)‖₂``) and its routing frequency (the share of tokens routed to it). The model runs
in the checkpoint's own client, which sums them with hooks (``Client.expert_saliency``: transformers'
``converters/pytorch/saliency.py``, each routed expert run alone on its tokens; mlx_lm's for an MLX checkpoint,
``converters/mlx/saliency.py``, from the SwitchGLU's per-expert outputs). One prompt at a time, nothing kept but
the sums.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import FFNToolsError

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


def saliency(path, *, prompts: str | None = None, max_tokens: int = 512) -> dict:
    """Each MoE layer's experts' REAP score and routing frequency on ``prompts`` (a file; None: the built-in
    set), each prompt cut to ``max_tokens`` tokens, run by the checkpoint's own client (transformers; mlx_lm for
    an MLX checkpoint: ``Client.expert_saliency``); what ``saliency -o`` writes (``top_scored`` reads it).

    Raises:
        FFNToolsError: the checkpoint's client scores no experts (its format runs in no such client here).
    """
    from ..clients import runtime
    from ..formats import registry

    texts = read_prompts(prompts)
    with registry().open_any(path) as ckpt:
        fmt = ckpt.format
    if fmt is None:
        raise FFNToolsError(f"{path}: opened without its format; no client is known to run it")
    client = runtime(fmt)
    tokens, sums = client.expert_saliency(Path(path), texts, max_tokens)
    layers = {str(k): {"reap": [r / n if n else 0.0 for r, n in zip(reap, routed)],
                       "frequency": [n / tokens for n in routed]} for k, (reap, routed) in sorted(sums.items())}
    return {"prompts": len(texts), "tokens": tokens, "client": client.name, "layers": layers,
            "scores": {"reap": "mean over the tokens routed to the expert of its router weight x the norm of its "
                               "output", "frequency": "the share of tokens routed to the expert"}}
