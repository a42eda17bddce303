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
    for hf, key in metadata_keys(family).items():
        key = key.format(arch=family.arch)
        if key in fields:
            v = fields[key]
            v = ENUMS[hf].get(v, v) if hf in ENUMS else v
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
    fixed = IMPLIED.get(family.model_type, {})  # what transformers' model code fixes needs no key
    for key, value in ABSENT.get(family.model_type, {}).items():  # what llama.cpp takes a missing key to mean
        if key not in fixed:
            config.setdefault(key, value)
    for key, fn in DERIVED.get(family.model_type, {}).items():
        config[key] = fn(config)
    if "rope_theta" in config:  # transformers 5 keeps it under rope_parameters
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    return config


# DeepSeek V2/V3 (llama.cpp's deepseek2; its DeepseekV2Model.set_gguf_parameters). Replaced keys: head_count_kv
# is 1 and key_length kv_lora_rank + qk_rope_head_dim (llama.cpp runs MLA as MQA over the compressed kv), so
# neither is the config's num_key_value_heads or head_dim (None: not read from the metadata).
_DEEPSEEK = {
    "num_key_value_heads": None, "head_dim": None,
    "q_lora_rank": "{arch}.attention.q_lora_rank",
    "kv_lora_rank": "{arch}.attention.kv_lora_rank",
    "qk_rope_head_dim": "{arch}.rope.dimension_count",
    "qk_head_dim": "{arch}.attention.key_length_mla",  # qk_nope_head_dim + qk_rope_head_dim
    "v_head_dim": "{arch}.attention.value_length_mla",
    "n_shared_experts": "{arch}.expert_shared_count",
    "first_k_dense_replace": "{arch}.leading_dense_block_count",
    "routed_scaling_factor": "{arch}.expert_weights_scale",
    "norm_topk_prob": "{arch}.expert_weights_norm",
    "n_group": "{arch}.expert_group_count",
    "topk_group": "{arch}.expert_group_used_count",
    "scoring_func": "{arch}.expert_gating_func",
}
FAMILY_METADATA: dict[str, dict[str, str | None]] = {"deepseek_v3": _DEEPSEEK, "deepseek_v2": _DEEPSEEK}
# GGUF enum values -> the config's (gguf.ExpertGatingFuncType; names as DeepSeek's config.json writes them)
ENUMS: dict[str, dict] = {"scoring_func": {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}}
# Keys the converter writes only when set, and what llama.cpp runs without them (llama-model.cpp's defaults for
# deepseek2: no q LoRA, no renormalized or scaled expert weights, no expert groups, softmax gating), per model type.
_DEEPSEEK_ABSENT = {"q_lora_rank": None, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": 1,
                    "topk_group": 1, "n_shared_experts": 0, "scoring_func": "softmax", "first_k_dense_replace": 0}
ABSENT: dict[str, dict] = {"deepseek_v3": _DEEPSEEK_ABSENT, "deepseek_v2": _DEEPSEEK_ABSENT}
# What transformers' own model code fixes, whatever config.json says: the value A's side runs with.
IMPLIED: dict[str, dict] = {"deepseek_v3": {"scoring_func": "sigmoid"}, "deepseek_v2": {"scoring_func": "softmax"}}
# config.json keys computed from others: MLA's head sizes; MLA keeps one k/v head per query head; the router's
# topk_method: V3's is noaux_tc (the one transformers' V3 runs), V2's groups only with group_limited_greedy (as
# llama.cpp groups where n_group > 1).
_DEEPSEEK_DERIVED = {
    "qk_nope_head_dim": lambda c: c["qk_head_dim"] - c["qk_rope_head_dim"],
    "num_key_value_heads": lambda c: c["num_attention_heads"],
}
DERIVED: dict[str, dict] = {
    "deepseek_v3": {**_DEEPSEEK_DERIVED, "topk_method": lambda c: "noaux_tc"},  # sigmoid + bias + groups: V3's only router
    "deepseek_v2": {**_DEEPSEEK_DERIVED,
                    "topk_method": lambda c: "group_limited_greedy" if (c.get("n_group") or 1) > 1 else "greedy"},
}


def metadata_keys(family: Family) -> dict[str, str]:
    """Hugging Face config key -> GGUF key for ``family``: ``METADATA`` with the family's own keys
    (``FAMILY_METADATA``; a key mapped to None is not in its metadata) and its expert count."""
    keys = {**METADATA, **FAMILY_METADATA.get(family.model_type, {}), family.moe_key: EXPERTS_KEY}
    return {k: v for k, v in keys.items() if v is not None}
