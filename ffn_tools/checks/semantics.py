"""What a client computes from a config, in the settings clients are known to read differently: where two
clients would run the same weights as different functions although every key of the config matches.

Each client says how it runs each setting (``Client.runs``), read from its own code: transformers from its config
classes (``transformers_runs``), mlx_lm from its model's ``ModelArgs``, llama.cpp from what it assumes per
architecture. ``differences`` compares two clients' readings, setting by setting:

    sliding_window   the attention window of each layer (None: full attention)
    norm_topk_prob   whether the weights of the routed top-k experts are renormalized to sum to 1
    mla_norm_eps     the eps of MLA attention's q_a/kv_a RMSNorms (read off each client's model: transformers'
                     GLM-4 MoE Lite keeps RMSNorm's default 1e-6, mlx_lm's takes the config's rms_norm_eps)
    router_bias      whether the router adds a learned bias (``e_score_correction_bias``) to the scores it picks
                     the top-k experts by (read off each client's model: transformers' ERNIE 4.5 MoE has one,
                     mlx_lm's sanitize drops it); moot where the checkpoint's bias is zero everywhere

A setting a client's reading leaves out is one it is not known to read otherwise, and is not compared. A difference
in the windows is bounded: the two clients compute the same on every sequence up to the smallest window among the
layers that differ (``sequences_alike``); every other difference shows at any length.
"""

from __future__ import annotations

import logging

from dataclasses import dataclass
from typing import NamedTuple

from ..errors import listing

log = logging.getLogger(__name__)


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


MLA_NORMS = ("q_a_layernorm", "kv_a_layernorm")  # MLA attention's norms of the low-rank query and key/value


def mla_norm_runs(epsilons: dict[str, float], whose: str) -> dict[str, Runs]:
    """``mla_norm_eps`` from the eps of each of ``MLA_NORMS`` a client's model has (norm -> eps); {} where it has
    none (no MLA attention)."""
    if not epsilons:
        return {}
    value = tuple(epsilons.get(n) for n in MLA_NORMS)
    said = ", ".join(f"{n} {epsilons[n]:g}" for n in MLA_NORMS if n in epsilons)
    return {"mla_norm_eps": Runs(value, f"eps {said} in the MLA attention's RMSNorms ({whose})")}


ROUTER_BIAS = "e_score_correction_bias"


def router_bias_runs(names, whose: str) -> dict[str, Runs]:
    """``router_bias`` from the parameter and buffer ``names`` of a client's model of an MoE."""
    biased = [n for n in names if n.endswith(ROUTER_BIAS)]
    if biased:
        return {"router_bias": Runs(True, f"the top-k experts picked on the router's scores plus its {ROUTER_BIAS} "
                                          f"({whose}: {listing(biased, 1)})")}
    return {"router_bias": Runs(False, f"the top-k experts picked on the router's scores alone, no bias ({whose})")}


def transformers_model_runs(config: dict) -> dict[str, Runs]:
    """The settings read off transformers' own model for ``config``, built on the meta device (nothing allocated),
    only where the config has MLA attention (``kv_lora_rank``) or routed experts: the eps of the q_a/kv_a norms,
    whether the router adds a bias; {} where transformers does not build it here."""
    moe = any(isinstance(config.get(c), int) for c in EXPERT_COUNTS)
    if "kv_lora_rank" not in config and not moe:
        return {}
    try:
        import torch
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "transformers_version"})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # noqa: BLE001 - no transformers, or its own refusal of this config: said, not silent
        log.warning("transformers' %s model was not built (%s: %s): the eps of its MLA norms and its router's bias "
                    "were not compared with the other client's", config.get("model_type"), type(e).__name__,
                    str(e).splitlines()[0][:160] if str(e) else "")
        return {}
    eps = {}
    for name, module in model.named_modules():
        norm = name.rsplit(".", 1)[-1]
        value = vars(module).get("variance_epsilon", vars(module).get("eps"))  # transformers' RMSNorms: the first
        if norm in MLA_NORMS and norm not in eps and isinstance(value, float):
            eps[norm] = value
    whose = f"transformers' {config.get('model_type')} model"
    return {**mla_norm_runs(eps, whose), **(router_bias_runs(model.state_dict(), whose) if moe else {})}


def topk_words(norm: bool) -> str:
    return ("the top-k experts' router weights renormalized to sum to 1" if norm else
            "the top-k experts' router weights as the router gives them, not renormalized")


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def moot(config: dict, ckpt=None) -> set[str]:
    """The settings that compute the same function whichever way a client runs them under ``config``: top-k
    renormalization where every expert is chosen (the softmax over all of them already sums to 1); the router's
    bias where checkpoint ``ckpt`` stores it as zeros everywhere (adding it changes no score)."""
    k = config.get("num_experts_per_tok")
    n = next((config[c] for c in EXPERT_COUNTS if isinstance(config.get(c), int)), None)
    out = {"norm_topk_prob"} if isinstance(k, int) and n is not None and k >= n else set()
    biases = [name for name in ckpt if name.endswith(ROUTER_BIAS)] if ckpt is not None else []
    if biases and not any(bool(ckpt[name].count_nonzero()) for name in biases):
        out.add("router_bias")
    return out


class Difference(NamedTuple):
    """A setting two clients run otherwise: its ``key``, the ``line`` that says both behaviours, and ``tokens``: the
    longest sequence on which the two still compute the same (None: they differ at any length)."""

    key: str
    line: str
    tokens: int | None = None


def sequences_alike(key: str, a, b) -> int | None:
    """The longest sequence on which setting ``key`` run as ``a`` and as ``b`` computes the same, or None where no
    length is safe. Windows (``sliding_window``, one per layer): a layer windowed at W lets each token see itself
    and the W-1 before it (transformers' mask keeps ``q - kv < W``; llama.cpp's and mlx_lm's alike), which on a
    sequence of at most W tokens is every token before it: full attention. So two readings agree up to the
    smallest window among the layers they run otherwise."""
    if key != "sliding_window" or not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b):
        return None
    differ = [w for wa, wb in zip(a, b) if wa != wb for w in (wa, wb) if w is not None]
    return min(differ) if differ else None


def differences(a: dict[str, Runs], b: dict[str, Runs], a_who: str, b_who: str,
                b_runs: str = "runs", config: dict | None = None, ckpt=None) -> list[Difference]:
    """Each setting both readings have and run otherwise, but for those ``moot`` under ``config`` and the weights
    of ``ckpt`` (the first side's); ``a_who``, ``b_who`` name the clients in the line ("A's client
    (transformers)"), ``b_runs`` the second one's verb ("would run"). A difference that only shows past a
    sequence length (``sequences_alike``) says that length in its line and ``tokens``."""
    out, same = [], moot(config or {}, ckpt)
    for key in sorted(set(a) & set(b) - same):
        if a[key].value != b[key].value:
            line = f"{key}: {a_who} runs {a[key].words}; {b_who} {b_runs} {b[key].words}"
            tokens = sequences_alike(key, a[key].value, b[key].value)
            if tokens is not None:
                line += f": the two agree on sequences of up to {tokens} tokens"
            out.append(Difference(key, line, tokens))
    return out
