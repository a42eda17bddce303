"""Where a MoE layer's router and expert count are, as data: the router's tensors relative to the block holding
the experts, and the config keys of the expert count and of the experts each token runs.

Every tensor named here has one row per routed expert (dim 0 is E) and is sliced in step with the experts; a
router found with another dim 0 is refused, never copied out of step.
"""

from __future__ import annotations

from ..errors import FFNToolsError

# Router tensors, relative to the module holding the experts (``model.layers.0.mlp``): Mixtral, Qwen-MoE,
# DeepSeek (``gate.weight`` and its ``e_score_correction_bias``), GPT-OSS (``router.weight``/``router.bias``),
# Hunyuan (``gate.wg.weight``), MLX's quantized router (``gate.scales``/``gate.biases``).
ROUTER_TENSORS = ("gate.weight", "gate.bias", "gate.e_score_correction_bias", "gate.scales", "gate.biases",
                  "router.weight", "router.bias", "router.scales", "router.biases", "gate.wg.weight",
                  "e_score_correction_bias")

# config.json keys of the routed expert count (dotted: nested), each family's: Mixtral/GPT-OSS
# num_local_experts, Qwen-MoE num_experts, DeepSeek n_routed_experts, DBRX ffn_config.moe_num_experts.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                     "ffn_config.moe_num_experts")
# ... and of the experts each token is routed to, which must not exceed those kept.
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "ffn_config.moe_top_k", "num_experts_per_token")
# DeepSeek's grouped routing: the experts fall into n_group contiguous groups
GROUP_KEY = "n_group"
TOP_GROUPS_KEY = "topk_group"  # ... of which each token's experts come from this many
NESTED = ("text_config", "language_config")  # a multimodal config's language model


def _configs(config: dict) -> list[dict]:
    return [config, *(c for k in NESTED if isinstance(c := config.get(k), dict))]


def _get(config: dict, key: str):
    *path, last = key.split(".")
    for p in path:
        inner = config.get(p)
        config = inner if isinstance(inner, dict) else {}
    return config.get(last)


def _set(config: dict, key: str, value) -> None:
    *path, last = key.split(".")
    for p in path:
        config[p] = dict(config[p])
        config = config[p]
    config[last] = value


def updated_config(config: dict | None, experts: int, kept: int) -> tuple[dict | None, list[str]]:
    """A copy of ``config`` with its expert count ``experts`` set to ``kept`` (each key of ``EXPERT_COUNT_KEYS``
    holding ``experts``, in the config and its language model's), and what changed.

    Raises:
        FFNToolsError: no key holds the expert count; a token's top-k above ``kept``; DeepSeek's grouped routing
            whose groups ``kept`` does not divide into.
    """
    if config is None:
        return None, []
    out = {k: (dict(v) if k in NESTED and isinstance(v, dict) else v) for k, v in config.items()}
    changes, found = [], False
    for c in _configs(out):
        for key in EXPERT_COUNT_KEYS:
            v = _get(c, key)
            if isinstance(v, int) and not isinstance(v, bool):
                if v != experts:
                    raise FFNToolsError(f"config.json {key} is {v}, but the checkpoint's MoE layers hold {experts} "
                                        "routed experts")
                if kept != experts:
                    _set(c, key, kept)
                    changes.append(f"config.json: {key} {experts} -> {kept}")
                found = True
        for key in TOP_K_KEYS:
            k = _get(c, key)
            if isinstance(k, int) and k > kept:
                raise FFNToolsError(f"config.json {key} is {k}: every token runs {k} experts, more than the {kept} "
                                    "kept; keep at least that many")
        groups = c.get(GROUP_KEY)
        if isinstance(groups, int) and groups > 1 and kept != experts:
            if kept % groups or kept // groups < 2:
                raise FFNToolsError(f"config.json {GROUP_KEY} is {groups} (grouped routing): {kept} experts kept do "
                                    f"not divide into {groups} groups of at least 2 (a group is scored by its top 2)")
            top_k, picked = _get(c, "num_experts_per_tok"), c.get(TOP_GROUPS_KEY)
            if isinstance(top_k, int) and isinstance(picked, int) and picked * (kept // groups) < top_k:
                raise FFNToolsError(f"config.json {TOP_GROUPS_KEY} is {picked} of {groups} groups: {picked} groups of "
                                    f"{kept // groups} kept experts hold fewer than the {top_k} each token runs")
            changes.append(f"config.json: grouped routing ({GROUP_KEY} {groups}): each group is now {kept // groups} "
                           "consecutive kept experts, which need not be the source's groups")
    if not found:
        raise FFNToolsError(f"config.json names no routed expert count ({', '.join(EXPERT_COUNT_KEYS)}): which key "
                            "does this family's runtime read?")
    return out, changes
