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
# Whether llama.cpp renormalizes the routed top-k experts' weights, fixed in its graph whatever the GGUF says
# (``norm_w`` of ``build_moe_ffn`` in src/models/<arch>.cpp: qwen3moe true, qwen2moe false), for the MoE
# architectures whose transformers config has ``norm_topk_prob`` (deepseek2 reads it: expert_weights_norm).
TOPK_RENORM = {"qwen3moe": True, "qwen2moe": False}


def implied_values(arch: str, config: dict) -> dict:
    """The values of ``config``'s keys that llama.cpp assumes for ``arch`` (``QUERY_SCALE``,
    ``SLIDING_PATTERN``, ``TOPK_RENORM``) rather than reads from the GGUF, given the rest of ``config``; only where
    ``config`` has what they derive from."""
    out: dict = {}
    if arch in TOPK_RENORM:
        out["norm_topk_prob"] = TOPK_RENORM[arch]
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
    for hf, key in metadata_keys(family).items():
        key = key.format(arch=family.arch)
        if key in fields:
            v = fields[key]
            v = ENUMS[hf].get(v, v) if hf in ENUMS else v
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
                    family.act_key: family.hidden_act, "vocab_size": vocab_size,
                    "tie_word_embeddings": tied, "dtype": dtype, **family.extra, **values}
    for key, field in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                       ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if field in fields:
            config[key] = fields[field]
    config.update(implied_values(family.arch, config))  # what llama.cpp runs where the metadata is silent
    fixed = IMPLIED.get(family.model_type, {})  # what transformers' model code fixes needs no key
    for key, value in absent_values(family.model_type).items():  # what llama.cpp takes a missing key to mean
        if key not in fixed:
            config.setdefault(key, value)
    for key, fn in DERIVED.get(family.model_type, {}).items():
        config[key] = fn(config)
    local = config.pop("sliding_rope_theta", None)
    if "rope_theta" in config:  # transformers 5 keeps it under rope_parameters (per layer type where two)
        full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
        config["rope_parameters"] = full if local is None else {
            "full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
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
# What llama.cpp runs without the key, for every architecture (llama-model.cpp's ``load_hparams``:
# ``rope_freq_base_train = 10000.0f`` before its optional ``{arch}.rope.freq_base`` is read).
COMMON_ABSENT: dict = {"rope_theta": 10000.0}


def absent_values(model_type: str) -> dict:
    """What llama.cpp takes each config key to be where a GGUF of ``model_type`` has no metadata key for it."""
    return {**COMMON_ABSENT, **ABSENT.get(model_type, {})}


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
