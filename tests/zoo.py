"""transformers' own model zoo, built tiny: every causal-LM model type it ships, judged gated or not by its
torch module tree, and saved with ``save_pretrained``.

The oracle is the module tree, not tensor names: a gated FFN is a module holding two (H -> I) projections
and one (I -> H) projection (separate), one (H -> 2I) and one (I -> H) (fused), or the same as 3-D expert
parameters (E, ...) in either orientation. Names never enter the count, so the registry is checked against
something it does not share.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

H, I, I_MOE, I_SHARED = 64, 96, 48, 80
# Overrides applied where the model type's config has the key (the config's own defaults otherwise).
TINY = dict(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=160, moe_intermediate_size=I_MOE, num_experts=4, num_local_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=I_SHARED,
            n_shared_experts=1, max_position_embeddings=128, first_k_dense_replace=1, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, mlp_bias=True, attention_bias=True,
            mlp_only_layers=[0], kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, qk_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2,
            vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, shared_intermediate_size=I_SHARED,
            attention_hidden_size=128, attention_head_dim=16, mamba_dt_rank=8, mamba_headdim=16,
            moe_num_experts=4, ffn_hidden_size=I, dim_ff=I)
LAYERS = 2
TOKENS = torch.arange(3, 19).reshape(2, 8)  # inside every tiny vocabulary


@dataclass
class Counts:
    """Gated FFNs by kind, as the module tree has them."""

    dense: int = 0
    expert: int = 0
    shared: int = 0
    d_ffn: set = field(default_factory=set)

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.dense, self.expert, self.shared)


def tiny_config(model_type: str, keep: tuple[str, ...] = (), extra: dict | None = None):
    """The config of ``model_type`` with the TINY sizes it has (``keep``: TINY keys left at the type's default;
    ``extra``: more settings)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    kw = {k: v for k, v in {**{k: v for k, v in TINY.items() if k not in keep}, **(extra or {})}.items()
          if k in defaults}
    n = defaults.get("num_hidden_layers")
    for k, v in defaults.items():  # per-layer lists: one layer of each kind, the first kinds first
        if isinstance(v, list) and n and len(v) == n and k not in kw:
            kinds = list(dict.fromkeys(map(repr, v)))
            kw[k] = [v[[repr(x) for x in v].index(kinds[min(j, len(kinds) - 1)])] for j in range(LAYERS)]
    return cls(**kw)


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _linear_shape(m) -> tuple[int, int] | None:
    """(out, in) of a module holding one 2-D ``weight`` (Linear and its look-alikes)."""
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and not isinstance(m, torch.nn.Embedding):
        return tuple(w.shape)
    return None


def _gated(mats: list[tuple[int, int]]) -> int | None:
    """I when the (out, in) shapes are exactly a gated FFN's: two (I, H) and one (H, I), or (2I, H) and
    (H, I); else None. (I or 2I == H would be attention's square projections: tiny I avoids both.)"""
    for h, i in mats:  # down: (H, I)
        if i == h or 2 * i == h:
            continue
        rest = sorted(m for m in mats if m != (h, i)) + [(h, i)] * (mats.count((h, i)) - 1)
        if rest in ([(i, h), (i, h)], [(2 * i, h)]):
            return i
    return None


def _projections(mod) -> list[tuple[int, int]]:
    """(out, in) of the linear modules among a module's children and grandchildren (CPM-Ant nests its
    w_in.w_0 / w_in.w_1)."""
    out = []
    for path, m in mod.named_modules():
        if path and path.count(".") <= 1 and (s := _linear_shape(m)):
            out.append(s)
    return out


def module_tree_counts(model) -> Counts:
    """Count the gated FFNs of a torch model from its modules' parameter shapes (see module docstring).

    A dense FFN module holds nothing but its projections and vectors (a norm, scales): a Mamba mixer's
    in_proj (2I, H) and out_proj (H, I) come with a conv1d and a 2-D state matrix, so it does not count.
    """
    counts = Counts()
    for path, mod in model.named_modules():
        shared = "shared" in path.rsplit(".", 1)[-1]
        i = _gated(_projections(mod))
        own = {id(p) for q, c in mod.named_modules() if q and q.count(".") <= 1 and _linear_shape(c)
               for p in c.parameters()}
        if i is not None and all(p.dim() <= 1 for p in mod.parameters() if id(p) not in own):
            counts.shared += shared
            counts.dense += not shared
            counts.d_ffn.add(i)
            continue
        p3 = [tuple(p.shape) for _, p in mod.named_parameters(recurse=False) if p.dim() == 3]
        if len(p3) >= 2 and len({s[0] for s in p3}) == 1:
            e = p3[0][0]
            mats = [s[1:] for s in p3]
            i = _gated(mats) or _gated([m[::-1] for m in mats])
            if i is not None:
                counts.shared += e * shared
                counts.expert += e * (not shared)
                counts.d_ffn.add(i)
    return counts


def meta_model(model_type: str, keep: tuple[str, ...] = (), extra: dict | None = None):
    """(config, model on the meta device) of the tiny ``model_type`` (``keep``, ``extra``: as ``tiny_config``)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, keep, extra)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    return config, model


def logits(model):
    """The model's logits on ``TOKENS`` (no cache), or None where its own forward fails at this tiny size
    (sizes TINY sets that its attention variant does not accept: the load is still checked)."""
    try:
        with torch.no_grad():
            return model(TOKENS, use_cache=False).logits
    except Exception:  # noqa: BLE001 - transformers' own failure, any type: no logits to compare
        return None


def build(model_type: str, path: Path, seed: int = 0, keep: tuple[str, ...] = (), extra: dict | None = None):
    """Save the tiny ``model_type`` with random, perturbed weights (norms and biases too) into ``path``;
    returns the model (in eval mode). ``keep``, ``extra``: as ``tiny_config``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, keep, extra)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        model.save_pretrained(path)
    return model


def swap_first_gate_up(src: Path, dst: Path) -> str:
    """Copy a checkpoint whose FFNs are separate, with the first FFN's gate and up tensors swapped.

    Returns:
        the name of the swapped gate tensor.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    from ffn_tools.detect import find_ffns
    from ffn_tools.io.store import open_checkpoint

    shutil.copytree(src, dst)
    with open_checkpoint(src) as c:
        f = next(f for f in find_ffns(c).ffns if f.form_name == "separate")
    gate, up = f.names["gate"], f.names["up"]
    for file in dst.glob("*.safetensors"):
        t = load_file(file)
        if gate in t or up in t:
            with open_checkpoint(src) as c:
                t[gate], t[up] = c[up].clone(), c[gate].clone()
            save_file(t, file, metadata={"format": "pt"})
    return gate
