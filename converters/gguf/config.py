"""config.json from a GGUF's metadata, and the metadata keys that say what the model computes.

``METADATA``: the Hugging Face config key -> the GGUF key (``{arch}``: ``general.architecture``) llama.cpp's
converter writes it to (``TextModel.set_gguf_parameters``) and llama.cpp reads back. ``verify`` compares
these, key by key, against the other side's config.json; ``hf_config`` builds a config.json from them, so
transformers can build the model a GGUF holds.
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
}
EXPERTS_KEY = "{arch}.expert_count"


def metadata_values(fields: dict, family: Family) -> dict:
    """The Hugging Face config values the metadata holds (only those present), experts under the family's key."""
    out = {}
    for hf, key in (*METADATA.items(), (family.moe_key, EXPERTS_KEY)):
        key = key.format(arch=family.arch)
        if key in fields:
            v = fields[key]
            out[hf] = float(str(np.float32(v))) if isinstance(v, float) else v  # float32: its shortest decimal
    return out


def rope_theta(config: dict):
    """A config's rope base: ``rope_theta``, or transformers 5's ``rope_parameters.rope_theta``."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        return rope["rope_theta"]
    return config.get("rope_theta")


def hf_config(fields: dict, family: Family, vocab_size: int, tied: bool, dtype: str) -> dict:
    """config.json for transformers from the metadata ``fields`` (name -> value)."""
    values = metadata_values(fields, family)
    config: dict = {"architectures": [family.architecture], "model_type": family.model_type, "hidden_act": "silu",
                    "vocab_size": vocab_size, "tie_word_embeddings": tied, "dtype": dtype, **values}
    for key, field in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                       ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if field in fields:
            config[key] = fields[field]
    if "rope_theta" in config:  # transformers 5 keeps it under rope_parameters
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    return config
