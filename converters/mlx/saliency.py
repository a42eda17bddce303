"""``ffn-tools saliency`` of an MLX checkpoint, run in mlx_lm (``MLXLM.expert_saliency``): the sums REAP's score and
the routing frequency are made of (``ffn_tools.surgery.saliency``).

mlx_lm's MoE blocks call their router (``gate``/``router``) and then their ``SwitchGLU`` (``switch_mlp``; GPT-OSS's
``experts``) as ``switch(x, inds)``, which returns each chosen expert's own output, unweighted (..., k, hidden):
both are wrapped in the block. The router's weights: DeepSeek's ``MoEGate`` gives them (its scores); a linear
router's logits are softmaxed and taken at the chosen experts, renormalized over them unless the config's
``norm_topk_prob`` is false (Mixtral and GPT-OSS softmax the top-k logits: the same).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ffn_tools.errors import FFNToolsError

log = logging.getLogger(__name__)
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
ROUTERS = ("gate", "router")


def expert_saliency(path: Path, texts: list[str], max_tokens: int) -> tuple[int, dict[int, tuple[list, list]]]:
    """The tokens run, and each MoE layer's per-expert sums: of router weight x the norm of the expert's output
    over the tokens routed to it, and the count of those tokens."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.models.switch_layers import SwitchGLU

    config = json.loads((Path(path) / "config.json").read_text())
    norm = (config.get("text_config") or config).get("norm_topk_prob", True) is not False
    model, tokenizer = load(str(path))[:2]
    sums: dict[int, tuple[list, list]] = {}
    for name, block in model.named_modules():
        m = LAYER.search(name)
        switch = next(((k, v) for k, v in block.children().items() if isinstance(v, SwitchGLU)), None)
        router = next(((k, block[k]) for k in ROUTERS if k in block), None)
        if m is None or switch is None or router is None or int(m.group(1)) in sums:
            continue
        experts = block[switch[0]].down_proj["weight"].shape[0]
        sums[int(m.group(1))] = s = ([0.0] * experts, [0] * experts)
        seen: list = []

        def route(x, gate=router[1], seen=seen):
            out = gate(x)
            seen[:] = [out]
            return out

        def run(x, inds, switch=switch[1], seen=seen, s=s):
            y = switch(x, inds)
            out = seen[0]
            if isinstance(out, tuple):  # DeepSeek's MoEGate: (inds, weights)
                w = out[1].astype(mx.float32)
            else:
                w = mx.take_along_axis(mx.softmax(out.astype(mx.float32), axis=-1), inds, axis=-1)
                if norm:
                    w = w / w.sum(axis=-1, keepdims=True)
            score = np.asarray(w * mx.linalg.norm(y.astype(mx.float32), axis=-1)).reshape(-1)
            for e, v in zip(np.asarray(inds).reshape(-1).tolist(), score.tolist()):
                s[0][e] += v
                s[1][e] += 1
            return y

        setattr(block, router[0], route)
        setattr(block, switch[0], run)
    if not sums:
        raise FFNToolsError(f"{path}: no MoE block found in mlx_lm's model (a SwitchGLU beside a gate or router)")
    tokens = 0
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)[:max_tokens]
        mx.eval(model(mx.array([ids])))
        tokens += len(ids)
        log.info("saliency: prompt %d of %d (%d tokens so far)", i + 1, len(texts), tokens)
    return tokens, sums
