"""What a client computes from a config, in the settings clients are known to read differently: where two
clients would run the same weights as different functions although every key of the config matches.

Each client says how it runs each setting (``Client.runs``), read from its own code: transformers from its config
classes (``transformers_runs``), mlx_lm from its model's ``ModelArgs``, llama.cpp from what it assumes per
architecture. ``differences`` compares two clients' readings, setting by setting:

    sliding_window   the attention window of each layer (None: full attention)
    norm_topk_prob   whether the weights of the routed top-k experts are renormalized to sum to 1

A setting a client's reading leaves out is one it is not known to read otherwise, and is not compared.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import listing


@dataclass(frozen=True)
class Runs:
    """How a client runs one setting: its ``value`` (compared) and the ``words`` that say it."""

    value: object
    words: str


def windows_words(windows: list[int | None]) -> str:
    """``a 64-token window on layers 0-3 of 4`` / ``full attention on every layer``."""
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if not sliding:
        return f"full attention on every layer ({len(windows)})"
    sizes = sorted({w for w in windows if w is not None})
    what = " or ".join(f"{s}-token" for s in sizes)
    where = ("every layer" if len(sliding) == len(windows) else
             f"layer{'s' * (len(sliding) > 1)} {listing([str(i) for i in sliding], 6)}")
    return f"a {what} window on {where} of {len(windows)}"


def windows(sliding_window, layer_types, layers: int, max_positions=None) -> list[int | None]:
    """Each layer's window: ``sliding_window`` on the layers ``layer_types`` marks sliding (every layer where there
    are no layer types), None elsewhere; a window no shorter than the longest context is no window."""
    w = sliding_window if isinstance(sliding_window, int) and not isinstance(sliding_window, bool) else None
    if not w or (isinstance(max_positions, int) and w >= max_positions):
        return [None] * layers
    if isinstance(layer_types, list) and len(layer_types) == layers:
        return [w if t == "sliding_attention" else None for t in layer_types]
    return [w] * layers


# Top-k renormalization transformers' modeling code fixes for a model type whose config has no norm_topk_prob:
# Mixtral normalizes the top-k softmax weights (modeling_mixtral.py); Jamba takes them from the softmax over every
# expert as they are (modeling_jamba.py: softmax, then topk).
TRANSFORMERS_TOPK = {"mixtral": True, "jamba": False}


def transformers_runs(normalized: dict) -> dict[str, Runs]:
    """The settings as transformers' modeling code runs them from its normalized config (``transformers_view``):
    the window per layer (its ``layer_types``; a window on every layer where it has none, unless
    ``use_sliding_window`` is off, as Mistral and Phi-3 apply one), and ``norm_topk_prob`` where the config class
    has it, or the model fixes it (``TRANSFORMERS_TOPK``)."""
    out: dict[str, Runs] = {}
    layers = normalized.get("num_hidden_layers")
    if isinstance(layers, int) and layers > 0:
        sw = normalized.get("sliding_window") if normalized.get("use_sliding_window") is not False else None
        ws = windows(sw, normalized.get("layer_types"), layers, normalized.get("max_position_embeddings"))
        out["sliding_window"] = Runs(ws, windows_words(ws))
    norm = normalized.get("norm_topk_prob")
    norm = norm if isinstance(norm, bool) else TRANSFORMERS_TOPK.get(str(normalized.get("model_type")))
    if norm is not None:
        out["norm_topk_prob"] = Runs(norm, topk_words(norm))
    return out


def topk_words(norm: bool) -> str:
    return ("the top-k experts' router weights renormalized to sum to 1" if norm else
            "the top-k experts' router weights as the router gives them, not renormalized")


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def moot(config: dict) -> set[str]:
    """The settings that compute the same function whichever way a client runs them under ``config``: top-k
    renormalization where every expert is chosen (the softmax over all of them already sums to 1)."""
    k = config.get("num_experts_per_tok")
    n = next((config[c] for c in EXPERT_COUNTS if isinstance(config.get(c), int)), None)
    return {"norm_topk_prob"} if isinstance(k, int) and n is not None and k >= n else set()


def differences(a: dict[str, Runs], b: dict[str, Runs], a_who: str, b_who: str,
                b_runs: str = "runs", config: dict | None = None) -> list[tuple[str, str]]:
    """(setting, sentence) for each setting both readings have and run otherwise, but for those ``moot`` under
    ``config``; ``a_who``, ``b_who`` name the clients in the sentence ("A's client (transformers)"), ``b_runs``
    the second one's verb ("would run")."""
    out, same = [], moot(config or {})
    for key in sorted(set(a) & set(b) - same):
        if a[key].value != b[key].value:
            out.append((key, f"{key}: {a_who} runs {a[key].words}; {b_who} {b_runs} {b[key].words}"))
    return out
