"""config.json from a GGUF's metadata, and the metadata keys that say what the model computes.

``METADATA``: the Hugging Face config key -> the GGUF key (``{arch}``: ``general.architecture``) llama.cpp's
converter writes it to (``TextModel.set_gguf_parameters``) and llama.cpp reads back. ``verify`` compares
these, key by key, against the other side's config.json; ``hf_config`` builds a config.json from them, so
transformers can build the model a GGUF holds. ``rope_theta`` is the full-attention layers' base and
``sliding_rope_theta`` the sliding-window layers' (Gemma 3: ``rope_parameters.{full,sliding}_attention``).
"""

from __future__ import annotations

import numpy as np

from .names import Family

METADATA: dict[str, str] = {
    "num_hidden_layers": "{arch}.block_count",
    "max_position_embeddings": "{arch}.context_length",
    "hidden_size": "{arch}.embedding_length",
    "intermediate_size": "{arch}.feed_forward_length",
    "num_attention_heads": "{arch}.attention.head_count",
    "num_key_value_heads": "{arch}.attention.head_count_kv",
    "rope_theta": "{arch}.rope.freq_base",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon",
    "head_dim": "{arch}.attention.key_length",
    "num_experts_per_tok": "{arch}.expert_used_count",
    "moe_intermediate_size": "{arch}.expert_feed_forward_length",
    "sliding_window": "{arch}.attention.sliding_window",
    "sliding_rope_theta": "{arch}.rope.freq_base_swa",
    "attn_logit_softcapping": "{arch}.attn_logit_softcapping",
    "final_logit_softcapping": "{arch}.final_logit_softcapping",
    "original_max_position_embeddings": "{arch}.rope.scaling.original_context_length",
}
EXPERTS_KEY = "{arch}.expert_count"
# Values the converter writes for a key the config leaves unset, which llama.cpp reads as unset (Phi-3's
# ``sliding_window: null`` is written 0: no sliding window).
UNSET = {"sliding_window": 0}

# What llama.cpp takes a config value to be where the GGUF has no key for it (its llama-model.cpp), per
# ``general.architecture``. Gemma's query scale, 1/sqrt(query_pre_attn_scalar) in transformers, is
# 1/sqrt(head_dim) in llama.cpp, or 1/sqrt(hidden_size / num_attention_heads) for the 27B model, which it knows
# by its layer count: key -> (the key llama.cpp uses, the 27B's layer count).
QUERY_SCALE = {"gemma2": ("query_pre_attn_scalar", 46), "gemma3": ("query_pre_attn_scalar", 62)}
# The layers llama.cpp runs with the sliding window: all but every n-th (its ``set_swa_pattern(n)``).
SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}


def implied_values(arch: str, config: dict) -> dict:
    """The values of ``config``'s keys that llama.cpp assumes for ``arch`` (``QUERY_SCALE``,
    ``SLIDING_PATTERN``) rather than reads from the GGUF, given the rest of ``config``; only where ``config``
    has what they derive from."""
    out: dict = {}
    layers = config.get("num_hidden_layers")
    if arch in QUERY_SCALE and isinstance(layers, int):
        key, big = QUERY_SCALE[arch]
        heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
        head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
        out[key] = hidden // heads if layers == big and hidden and heads else head_dim
    if arch in SLIDING_PATTERN and isinstance(layers, int):
        n = SLIDING_PATTERN[arch]
        out["layer_types"] = ["sliding_attention" if i % n < n - 1 else "full_attention" for i in range(layers)]
    return out


def metadata_values(fields: dict, family: Family) -> dict:
    """The Hugging Face config values the metadata holds (only those present), experts under the family's key."""
    out = {}
    for hf, key in (*METADATA.items(), (family.moe_key, EXPERTS_KEY)):
        key = key.format(arch=family.arch)
        if key in fields:
            v = fields[key]
            if hf in UNSET and v == UNSET[hf]:
                continue
            out[hf] = float(str(np.float32(v))) if isinstance(v, float) else v  # float32: its shortest decimal
    return out


def rope_theta(config: dict, layers: str = "full_attention"):
    """A config's rope base for ``layers`` (full_attention, sliding_attention): ``rope_theta``, or transformers
    5's ``rope_parameters.rope_theta``, or per layer type ``rope_parameters.{layers}.rope_theta`` (Gemma 3);
    a sliding layers' base only where the config has one of its own."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get(layers), dict):
        return rope[layers].get("rope_theta")
    if layers != "full_attention":
        return config.get("rope_local_base_freq")
    if isinstance(rope, dict) and "rope_theta" in rope:
        return rope["rope_theta"]
    return config.get("rope_theta")


def original_context(config: dict):
    """The context a scaled rope was trained for: top level (Phi-3) or in ``rope_parameters`` (YaRN)."""
    rope = config.get("rope_parameters")
    return config.get("original_max_position_embeddings") or (
        rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None)


def hf_config(fields: dict, family: Family, vocab_size: int, tied: bool, dtype: str) -> dict:
    """config.json for transformers from the metadata ``fields`` (name -> value), with the values llama.cpp
    assumes where the metadata has no key (``implied_values``): the model llama.cpp runs."""
    values = metadata_values(fields, family)
    config: dict = {"architectures": [family.architecture], "model_type": family.model_type,
                    "hidden_act": family.hidden_act, "vocab_size": vocab_size,
                    "tie_word_embeddings": tied, "dtype": dtype, **family.extra, **values}
    for key, field in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                       ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if field in fields:
            config[key] = fields[field]
    config.update(implied_values(family.arch, config))  # what llama.cpp runs where the metadata is silent
    local = config.pop("sliding_rope_theta", None)
    if "rope_theta" in config:  # transformers 5 keeps it under rope_parameters (per layer type where two)
        full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
        config["rope_parameters"] = full if local is None else {
            "full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return config
