"""Meta's and Mistral's native checkpoint layouts, declared as data.

Meta (Llama 2/3/3.1 ``original/``): ``consolidated.00.pth .. consolidated.NN.pth`` (one per model-parallel
rank) and ``params.json``. Mistral (mistral-inference): ``consolidated.safetensors`` and ``params.json``, MoE
models with ``feed_forward.experts.{E}`` and a ``gate``. Both name tensors the same way; ``TENSORS`` maps each
to its Hugging Face name, the dimension model-parallel ranks split it along (None: every rank holds all of
it), and the rotary permutation transformers' conversion scripts apply to q and k (Meta's rotary pairs
interleaved halves, Hugging Face's the two halves of the head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

EMBED: Final = "embed"  # Llama 2 splits the embedding along its width (dim 1), Llama 3 along the vocabulary (dim 0)


@dataclass(frozen=True)
class Native:
    """One native tensor name and what it becomes.

    Attributes:
        native: the native name, with ``{L}`` (layer) and ``{E}`` (expert).
        hf: the Hugging Face name, same placeholders.
        dim: the model-parallel split dimension, None when replicated, ``EMBED`` for the embedding.
        rotary: "q" or "k" when the rotary permutation applies.
    """

    native: str
    hf: str
    dim: int | Literal["embed"] | None
    rotary: str | None = None

    def pattern(self) -> re.Pattern:
        p = re.escape(self.native).replace(re.escape("{L}"), r"(?P<L>\d+)").replace(re.escape("{E}"), r"(?P<E>\d+)")
        return re.compile(p)


_L = "model.layers.{L}"
_MOE = f"{_L}.block_sparse_moe"
TENSORS = (
    Native("tok_embeddings.weight", "model.embed_tokens.weight", EMBED),
    Native("norm.weight", "model.norm.weight", None),
    Native("output.weight", "lm_head.weight", 0),
    Native("layers.{L}.attention.wq.weight", f"{_L}.self_attn.q_proj.weight", 0, "q"),
    Native("layers.{L}.attention.wk.weight", f"{_L}.self_attn.k_proj.weight", 0, "k"),
    Native("layers.{L}.attention.wv.weight", f"{_L}.self_attn.v_proj.weight", 0),
    Native("layers.{L}.attention.wo.weight", f"{_L}.self_attn.o_proj.weight", 1),
    Native("layers.{L}.attention_norm.weight", f"{_L}.input_layernorm.weight", None),
    Native("layers.{L}.ffn_norm.weight", f"{_L}.post_attention_layernorm.weight", None),
    Native("layers.{L}.feed_forward.w1.weight", f"{_L}.mlp.gate_proj.weight", 0),
    Native("layers.{L}.feed_forward.w3.weight", f"{_L}.mlp.up_proj.weight", 0),
    Native("layers.{L}.feed_forward.w2.weight", f"{_L}.mlp.down_proj.weight", 1),
    # Mistral's MoE (Mixtral): experts under feed_forward, or directly under the layer
    Native("layers.{L}.feed_forward.gate.weight", f"{_MOE}.gate.weight", None),
    Native("layers.{L}.gate.weight", f"{_MOE}.gate.weight", None),
    *(Native(f"{box}.experts.{{E}}.{w}.weight", f"{_MOE}.experts.{{E}}.{w}.weight", dim)
      for box in ("layers.{L}.feed_forward", "layers.{L}") for w, dim in (("w1", 0), ("w3", 0), ("w2", 1))),
)
# Native tensors with no Hugging Face counterpart, and why they are not carried.
DROPPED = {"rope.freqs": "the rotary frequencies, which transformers recomputes from rope_theta"}


def permute(w, heads: int):
    """Meta's q/k rows (rotary on interleaved pairs) in Hugging Face's order (rotary on halves), as
    transformers' ``convert_llama_weights_to_hf`` does: a pure reordering of rows."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def unpermute(w, heads: int):
    """The inverse of ``permute``: Hugging Face's q/k rows back in Meta's order."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_config(params: dict, shapes: dict[str, tuple[int, ...]], dtype: str, moe: bool) -> dict:
    """config.json for transformers from ``params.json`` (sizes it lacks read from the tensors' shapes)."""
    dim, heads = params["dim"], params["n_heads"]
    vocab = params.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:  # Llama 2 writes -1: the tokenizer decides; the embedding has it
        vocab = shapes["model.embed_tokens.weight"][0]
    ffn = next((s[0] for n, s in shapes.items() if n.endswith(("mlp.gate_proj.weight", "experts.0.w1.weight"))), None)
    model_type = "mixtral" if moe else "mistral" if "sliding_window" in params else "llama"
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}[model_type]
    config = {
        "architectures": [arch], "model_type": model_type, "hidden_size": dim, "intermediate_size": ffn,
        "num_hidden_layers": params["n_layers"], "num_attention_heads": heads,
        "num_key_value_heads": params.get("n_kv_heads") or heads, "head_dim": params.get("head_dim") or dim // heads,
        "rms_norm_eps": params.get("norm_eps", 1e-5), "vocab_size": vocab, "hidden_act": "silu",
        "max_position_embeddings": params.get("max_seq_len") or params.get("max_position_embeddings") or 4096,
        "rope_theta": float(params.get("rope_theta", 10000.0)), "tie_word_embeddings": False, "dtype": dtype,
    }
    if params.get("use_scaled_rope"):  # Llama 3.1's rotary scaling, as transformers' conversion writes it
        config["rope_scaling"] = {"rope_type": "llama3", "factor": params.get("rope_scaling_factor", 8.0),
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}
    if "sliding_window" in params:
        config["sliding_window"] = params["sliding_window"]
    if moe:
        m = params.get("moe") or {}
        config["num_local_experts"] = m.get("num_experts") or 1 + max(  # every expert name is TENSORS' experts.{E}.
            int(e[1]) for n in shapes if ".experts." in n and (e := re.search(r"experts\.(\d+)\.", n)))
        config["num_experts_per_tok"] = m.get("num_experts_per_tok", 2)
    return config
