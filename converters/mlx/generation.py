"""Prompts through mlx_lm as a user runs a model with it: ``mlx_lm.load`` (the model and its ``TokenizerWrapper``:
the chat template, the stop ids it reads from config.json and generation_config.json plus the tokenizer's EOS),
greedy decoding with mlx_lm's prompt cache."""

from __future__ import annotations

from pathlib import Path

from ffn_tools.checks.prompts import greedy, hf_prompt_ids, pieces
from ffn_tools.generation import Generation


def generate(path: Path, prompts: list[str], new_tokens: int, score, dtype) -> Generation:
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(str(path))[:2]  # (model, tokenizer[, config]) as mlx_lm's return_config says
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    ids, templated = hf_prompt_ids(tokenizer, prompts)
    eos = sorted(int(t) for t in tokenizer.eos_token_ids)

    def stepper():
        cache = make_prompt_cache(model)

        def run(tokens: list[int]):
            return np.array(model(mx.array([tokens]), cache=cache)[0, -1].astype(mx.float32))

        return run

    if score is None:
        score = [greedy(p, new_tokens, set(eos), stepper()) for p in ids]
    logits = [np.array(model(mx.array([s]))[0].astype(mx.float32)) for s in score]
    return Generation("mlx_lm", ids, templated, eos, [list(s) for s in score], [len(p) for p in ids], logits,
                      pieces(lambda t: tokenizer.decode([t]), score, logits))
