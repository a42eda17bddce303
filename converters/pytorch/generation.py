"""Prompts through transformers as a user runs a model with it: ``AutoTokenizer`` (its chat template), the model
``loading.load_model`` loads (``from_pretrained`` in the config's dtype), greedy decoding with the KV cache,
stopping at the ids of the model's ``generation_config`` (generation_config.json, else the config's
``eos_token_id``: what ``generate`` stops at)."""

from __future__ import annotations

import warnings

from ffn_tools.checks.prompts import greedy, hf_prompt_ids, pieces
from ffn_tools.generation import Generation


def eos_ids(value) -> list[int]:
    """An ``eos_token_id`` setting (an id, a list, None) as a list of ids."""
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def run(name: str, model, tokenizer, prompts: list[str], new_tokens: int, score) -> Generation:
    """``prompts`` through a transformers ``model`` and ``tokenizer`` (see the module docstring), as client
    ``name``."""
    import torch

    model.eval()
    ids, templated = hf_prompt_ids(tokenizer, prompts)
    eos = eos_ids(model.generation_config.eos_token_id)
    with torch.no_grad():
        if score is None:
            score = [greedy(p, new_tokens, set(eos), _stepper(model)) for p in ids]
        logits = [model(torch.tensor([s])).logits[0].float().numpy() for s in score]
    return Generation(name, ids, templated, eos, [list(s) for s in score], [len(p) for p in ids], logits,
                      pieces(lambda t: tokenizer.decode([t]), score, logits))


def _stepper(model):
    """``run(ids)`` for ``greedy``: the last position's logits, the KV cache kept between calls."""
    import torch

    state: dict = {"past": None}

    def run(ids: list[int]):
        with warnings.catch_warnings():  # transformers 5.2x renames the argument, and warns of the old name
            warnings.simplefilter("ignore", FutureWarning)
            out = model(torch.tensor([ids]), past_key_values=state["past"], use_cache=True)
        state["past"] = out.past_key_values
        return out.logits[0, -1].float()

    return run
