"""transformers' own model zoo, built tiny: every causal-LM model type it ships, judged gated or not by its
torch module tree, and saved twice: with ``save_pretrained`` (which writes some families' legacy names back)
and as the model's own state dict (transformers v5's names, as the model holds them in memory).

The oracle is the module tree, not tensor names: a gated FFN is a module holding two (H -> I) projections
and one (I -> H) projection (separate), one (H -> 2I) and one (I -> H) (fused), or the same as 3-D expert
parameters (E, ...) in either orientation, or flattened to 2-D (E * I, H). Its kind comes from where it sits
(``module_tree_counts``). Names never enter the count, so the registry is checked against something it does
not share.
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
            moe_num_experts=4, ffn_hidden_size=I, dim_ff=I,
            mamba_chunk_size=8)  # Mamba-2's scan in torch pads to a chunk: 2.7 s a forward at 256 (default), 0.03 s
LAYERS = 2
TOKENS = torch.arange(3, 19).reshape(2, 8)  # inside every tiny vocabulary
# model_type -> settings it needs to build at this size (its defaults fail, or its validator wants them).
EXTRA: dict[str, dict] = {
    "dbrx": {"d_model": H, "n_heads": 4, "n_layers": LAYERS, "max_seq_len": 128,  # DbrxConfig's own names
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": I, "moe_num_experts": 4, "moe_top_k": 2}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # its default leaves None
    "zaya": {"num_experts_per_tok": 1},
    "kolibri1_1": {"index_num_heads": 2},  # at most the query heads per key head (4 // 2)  # "ZAYA currently supports num_experts_per_tok=1 only"
}
# case -> (model_type, settings): configurations of a type whose FFNs are another kind than at TINY's settings.
VARIANTS: dict[str, tuple[str, dict]] = {
    # Granite-4.0's dense models (granite-4.0-micro, -h-1b): no routed experts, shared_mlp is the layer's FFN
    "granitemoehybrid+dense": ("granitemoehybrid", {"num_local_experts": 0}),
}


@dataclass
class Counts:
    """Gated FFNs by kind, as the module tree has them, and each kind's d_ffn."""

    dense: int = 0
    expert: int = 0
    shared: int = 0
    d_ffn: set = field(default_factory=set)
    by_kind: dict = field(default_factory=dict)  # kind -> its d_ffn values

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.dense, self.expert, self.shared)

    def add(self, kind: str, n: int, i: int) -> None:
        setattr(self, kind, getattr(self, kind) + n)
        self.d_ffn.add(i)
        self.by_kind.setdefault(kind, set()).add(i)


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


def cases() -> list[str]:
    """Every causal-LM type, and the variants ``VARIANTS`` adds (``type+variant``)."""
    return sorted([*causal_lm_types(), *VARIANTS])


def case(name: str) -> tuple[str, dict | None]:
    """(model_type, the settings it is built with) of a case of ``cases``."""
    if name in VARIANTS:
        return VARIANTS[name]
    return name, EXTRA.get(name)


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


def _gated_any(mats: list[tuple[int, int]]) -> int | None:
    """``_gated`` with the experts' matrices stored (out, in), (in, out), or (in, out) for one of them alone (a
    down projection kept transposed, as DBRX's w2)."""
    tries = [mats, [m[::-1] for m in mats]] + [[m[::-1] if k == j else m for k, m in enumerate(mats)]
                                                for j in range(len(mats))]
    return next((i for t in tries if (i := _gated(t)) is not None), None)


def _projections(mod) -> list[tuple[int, int]]:
    """(out, in) of the linear modules among a module's children and grandchildren (CPM-Ant nests its
    w_in.w_0 / w_in.w_1)."""
    out = []
    for path, m in mod.named_modules():
        if path and path.count(".") <= 1 and (s := _linear_shape(m)):
            out.append(s)
    return out


def _layer(model, path: str) -> str | None:
    """The path of the layer holding module ``path``: its outermost ancestor (or itself) that is an item of a
    ``ModuleList``; None outside every list."""
    parts = path.split(".")
    for k in range(1, len(parts) + 1):
        if isinstance(model.get_submodule(".".join(parts[:k - 1])), torch.nn.ModuleList):
            return ".".join(parts[:k])
    return None


def _router_width(model, path: str, rows: int) -> int | None:
    """E of a flat expert stack at ``path`` ((E * I, H) parameters): the out size of the linear module nearest
    to it (in its ancestors' other descendants) whose out size divides ``rows``: the router scoring the experts."""
    parts = path.split(".")
    for k in range(len(parts) - 1, -1, -1):
        anc = ".".join(parts[:k])
        for q, m in model.get_submodule(anc).named_modules():
            full = f"{anc}.{q}" if anc else q
            s = _linear_shape(m)
            if s and not (full + ".").startswith(path + ".") and 1 < s[0] < rows and rows % s[0] == 0:
                return s[0]
    return None


def module_tree_counts(model) -> Counts:
    """Count the gated FFNs of a torch model from its modules' parameter shapes (see module docstring), by kind
    from where they sit in the tree:

        expert  an expert of a stack: 3-D parameters (E, ...), 2-D ones flattened (E * I, H) (E: the router
                beside them), or one of a ``ModuleList`` of FFN modules inside a layer
        shared  an FFN module in a layer that also holds experts
        dense   an FFN module in a layer without experts

    A dense FFN module holds nothing but its projections and vectors (a norm, scales): a Mamba mixer's
    in_proj (2I, H) and out_proj (H, I) come with a conv1d and a 2-D state matrix, so it does not count.
    """
    units = []  # (layer, routed, number of FFNs, I)
    for path, mod in model.named_modules():
        i = _gated(_projections(mod))
        own = {id(p) for q, c in mod.named_modules() if q and q.count(".") <= 1 and _linear_shape(c)
               for p in c.parameters()}
        if i is not None and all(p.dim() <= 1 for p in mod.parameters() if id(p) not in own):
            layer = _layer(model, path)
            listed = path and layer != path and isinstance(model.get_submodule(path.rpartition(".")[0]),
                                                           torch.nn.ModuleList)
            units.append((layer, bool(listed), 1, i))
            continue
        params = [tuple(p.shape) for _, p in mod.named_parameters(recurse=False)]
        p3 = [s for s in params if len(s) == 3]
        if len(p3) >= 2 and len({s[0] for s in p3}) == 1:
            mats = [s[1:] for s in p3]
            i = _gated(mats) or _gated([m[::-1] for m in mats])
            if i is not None:
                units.append((_layer(model, path), True, p3[0][0], i))
                continue
        p2 = [s for s in params if len(s) == 2]
        if len(p2) == 3 == len(params) and len(set(p2)) == 1 and _linear_shape(mod) is None:
            e = _router_width(model, path, p2[0][0])
            i = _gated_any([(p2[0][0] // e, p2[0][1])] * 3) if e else None
            if e and i is not None:
                units.append((_layer(model, path), True, e, i))
    with_experts = {layer for layer, routed, _, _ in units if routed}
    counts = Counts()
    for layer, routed, n, i in units:
        counts.add("expert" if routed else "shared" if layer in with_experts else "dense", n, i)
    return counts


def meta_model(model_type: str, keep: tuple[str, ...] = (), extra: dict | None = None):
    """(config, model on the meta device) of the tiny ``model_type`` (``keep``, ``extra``: as ``tiny_config``)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = tiny_config(model_type, keep, extra)
    # no initialisation: on the meta device it computes nothing, yet each init op went through the device's
    # function mode (the zoo's 350 meta builds 12 -> 8 s)
    with torch.device("meta"), no_init_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    return config, model


THREADS = 1  # torch threads every logits of the zoo are computed with (``logits``)


def logits(model):
    """The model's logits on ``TOKENS`` (no cache) with ``THREADS`` torch threads, or None where its own forward
    fails at this tiny size (sizes TINY sets that its attention variant does not accept: the load is still
    checked).

    The thread count is fixed because a forward's float sums depend on it: DeepSeek-V4's o_b_proj (in-features
    o_groups * o_lora_rank = 8192) gives other logits (by 5e-7) on 1 and 2 threads, the same on each, run after
    run (measured); logits compared with ``torch.equal`` are computed alike.

    Alike includes where the weights lie: a model transformers loads from safetensors keeps its tensors as views of
    the file's mapped pages, at the file's offsets, and on an AMD EPYC one thread gives DeepSeek-V4 other logits (by
    6e-8) from the same bits 16 bytes off a 64-byte boundary (measured: the fused copy's tensors lie 16 bytes off
    where the saved file's lie 20 off). Every tensor not on a 64-byte boundary is first copied to one (as torch
    allocates), so the logits are those of the bits alone; ``_holds`` compares the bits themselves."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() % 64:
            t.data = t.data.clone()
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        with torch.no_grad():
            return model(TOKENS, use_cache=False).logits
    except Exception:  # noqa: BLE001 - transformers' own failure, any type: no logits to compare
        return None
    finally:
        torch.set_num_threads(threads)


def build(model_type: str, path: Path, seed: int = 0, keep: tuple[str, ...] = (), extra: dict | None = None,
          state_dict: Path | None = None):
    """Save the tiny ``model_type`` with random, perturbed weights (norms and biases too) into ``path``;
    returns the model (in eval mode). ``keep``, ``extra``: as ``tiny_config``; ``state_dict``: a directory to
    save the model's own state dict into as well (``pytorch_model.bin`` with the same config.json)."""
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
    if state_dict is not None:
        import shutil

        state_dict.mkdir(parents=True, exist_ok=True)
        for side in ("config.json", "generation_config.json"):
            if (path / side).exists():
                shutil.copy(path / side, state_dict / side)
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, state_dict / "pytorch_model.bin")
    return model


def swap_first_gate_up(src: Path, dst: Path) -> str:
    """Copy a checkpoint whose FFNs have gate and up apart, with the first such FFN's gate and up tensors
    swapped (a stack's: every expert of it).

    Returns:
        the name of the swapped gate tensor.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    from ffn_tools.detect import find_ffns
    from ffn_tools.io.readers import open_checkpoint

    shutil.copytree(src, dst)
    with open_checkpoint(src) as c:
        f = next(f for f in find_ffns(c).ffns if not f.form.fused)
    gate, up = f.names["gate"], f.names["up"]
    for file in [*dst.glob("*.safetensors"), *dst.glob("*.bin")]:
        t = load_file(file) if file.suffix == ".safetensors" else torch.load(file, weights_only=True)
        if gate in t or up in t:
            with open_checkpoint(src) as c:
                t[gate], t[up] = c[up].clone(), c[gate].clone()
            if file.suffix == ".safetensors":
                save_file(t, file, metadata={"format": "pt"})
            else:
                torch.save(t, file)
    return gate
