"""Which Hugging Face names a GGUF's tensors had, per model type, declared as data.

llama.cpp's converter (``convert_hf_to_gguf.py``) names a tensor with gguf's ``TensorNameMap``; this module
runs that same map over the names transformers' ``save_pretrained`` writes for each model type (``FAMILIES``)
and inverts it, so ``blk.3.attn_q.weight`` reads as ``model.layers.3.self_attn.q_proj.weight``. Stacked
experts (``blk.L.ffn_gate_exps.weight``, (E, I, H)) read as one tensor per expert under the family's
``experts`` template. ``rotary``: the converter permutes q and k rows into llama.cpp's rotary order (its
``LlamaModel.permute``); the reader puts them back. ``plus_one``: the converter stores those weights plus one
(Gemma's RMSNorm scales by ``1 + weight``, llama.cpp's by the weight); the reader takes the one off again, and
verify compares A's weight plus one, computed as the converter computes it, with the stored bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_L = "model.layers.{L}"
# What save_pretrained writes for a Llama-like decoder layer (biases where the family has them).
_DECODER = (
    "model.embed_tokens", "model.norm", "lm_head",
    f"{_L}.self_attn.q_proj", f"{_L}.self_attn.k_proj", f"{_L}.self_attn.v_proj", f"{_L}.self_attn.o_proj",
    f"{_L}.input_layernorm", f"{_L}.post_attention_layernorm",
)
_MLP = (f"{_L}.mlp.gate_proj", f"{_L}.mlp.up_proj", f"{_L}.mlp.down_proj")
_QK_NORM = (f"{_L}.self_attn.q_norm", f"{_L}.self_attn.k_norm")
# Gemma 2/3: a norm before and after both the attention and the MLP; the output head is the embedding (tied).
_GEMMA = (*_DECODER, *_MLP, f"{_L}.pre_feedforward_layernorm", f"{_L}.post_feedforward_layernorm")


@dataclass(frozen=True)
class Family:
    """One model type as llama.cpp's converter writes it.

    Attributes:
        model_type: transformers' ``model_type``.
        architecture: the class name config.json's ``architectures`` lists.
        arch: gguf's ``general.architecture``.
        modules: Hugging Face module names (``{L}`` the layer) whose ``.weight``/``.bias`` the GGUF holds.
        experts: per-expert template of the stacked ``ffn_{gate,up,down}_exps`` (``{E}`` the expert, ``{P}``
            the projection name), None for dense models.
        projections: the names ``{P}`` takes for gate, up, down.
        rotary: q and k rows are in llama.cpp's rotary order (the converter permuted them).
        moe_key: the config key of the expert count.
        hidden_act: the FFN's activation (transformers' name), which the GGUF does not record: llama.cpp's
            graph for the architecture fixes it.
        act_key: the config.json key transformers' config class reads it from (Gemma 2/3: ``hidden_activation``;
            a ``hidden_act`` there is a key the source never had).
        plus_one: name endings (of Hugging Face names) of the weights the converter stores plus one (its
            ``modify_tensors``: ``if name.endswith("norm.weight"): data_torch = data_torch + 1``).
        extra: config.json keys for transformers that the metadata does not hold, fixed by the family.
    """

    model_type: str
    architecture: str
    arch: str
    modules: tuple[str, ...]
    experts: str | None = None
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    rotary: bool = False
    moe_key: str = "num_experts"
    hidden_act: str = "silu"
    act_key: str = "hidden_act"
    plus_one: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)
    splits: tuple[Split, ...] = ()  # Hugging Face tensors the converter wrote as several GGUF tensors


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", "llama", (*_DECODER, *_MLP), rotary=True),
    Family("mistral", "MistralForCausalLM", "llama", (*_DECODER, *_MLP), rotary=True),
    Family("mixtral", "MixtralForCausalLM", "llama", (*_DECODER, f"{_L}.block_sparse_moe.gate"),
           experts=_L + ".block_sparse_moe.experts.{E}.{P}.weight", projections=("w1", "w3", "w2"), rotary=True,
           moe_key="num_local_experts"),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", (*_DECODER, *_MLP)),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", (*_DECODER, *_MLP, *_QK_NORM)),
    # llama.cpp's qwen3moe graph (src/models/qwen3moe.cpp) makes every layer sparse (and renormalizes the top-k
    # weights: config.TOPK_RENORM); the converter writes no key for either, and mlx_lm's qwen3_moe ModelArgs
    # requires them all.
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", (*_DECODER, *_QK_NORM, f"{_L}.mlp.gate"),
           experts=_L + ".mlp.experts.{E}.{P}.weight", extra={"decoder_sparse_step": 1, "mlp_only_layers": []}),
    Family("phi3", "Phi3ForCausalLM", "phi3", ("model.embed_tokens", "model.norm", "lm_head",
                                                f"{_L}.self_attn.qkv_proj", f"{_L}.self_attn.o_proj",
                                                f"{_L}.input_layernorm", f"{_L}.post_attention_layernorm",
                                                f"{_L}.mlp.gate_up_proj", f"{_L}.mlp.down_proj")),
    Family("gemma2", "Gemma2ForCausalLM", "gemma2", _GEMMA, hidden_act="gelu_pytorch_tanh", act_key="hidden_activation",
           plus_one=("norm.weight",)),
    Family("gemma3_text", "Gemma3ForCausalLM", "gemma3", (*_GEMMA, *_QK_NORM), hidden_act="gelu_pytorch_tanh",
           act_key="hidden_activation", plus_one=("norm.weight",)),
)
BY_TYPE = {f.model_type: f for f in FAMILIES}
EXPERT_KINDS = ("gate", "up", "down")  # ffn_{kind}_exps, in the order of ``Family.projections``
# GGUF tensors with no Hugging Face counterpart, and why they are not read.
DROPPED = {"rope_freqs.weight": "the rotary frequency factors (Llama 3.1 rope scaling), which transformers "
                                "recomputes from config.json's rope_scaling"}


def family_of(arch: str, has_experts: bool, name: str | None = None) -> Family:
    """The family of a GGUF's ``general.architecture`` (llama with experts is Mixtral's layout).

    Raises:
        KeyError: no family writes this architecture.
    """
    if arch == "llama":
        return BY_TYPE["mixtral" if has_experts else "llama"]
    for f in FAMILIES:
        if f.arch == arch:
            return f
    raise KeyError(arch)


def hf_names(family: Family, n_layers: int) -> dict[str, str]:
    """GGUF name -> Hugging Face name for every module the family holds, through gguf's ``TensorNameMap``
    (the converter's own naming), both ``.weight`` and ``.bias``."""
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.arch)
    tmap = gguf.TensorNameMap(arch, n_layers)
    out: dict[str, str] = {}
    for module in family.modules:
        for layer in range(n_layers) if "{L}" in module else (None,):
            hf = module.format(L=layer) if layer is not None else module
            for suffix in (".weight", ".bias"):
                g = tmap.get_name(hf + suffix, try_suffixes=(".weight", ".bias"))
                if g is not None:
                    out[g] = renamed(hf + suffix)
    return out


def expert_names(family: Family, layer: int, kind: str, n_experts: int) -> list[str]:
    """The Hugging Face names of layer ``layer``'s experts' ``kind`` ("gate", "up", "down") projection."""
    assert family.experts is not None  # callers ask only for families with experts
    proj = family.projections[EXPERT_KINDS.index(kind)]
    return [family.experts.format(L=layer, E=e, P=proj) for e in range(n_experts)]


def plus_one(family: Family, name: str) -> bool:
    """Whether the converter stores Hugging Face tensor ``name`` of ``family`` plus one."""
    return name.endswith(family.plus_one) if family.plus_one else False


# DeepSeek V2/V3: llama.cpp's deepseek2 (MLA attention, routed + shared experts, first_k_dense_replace dense
# layers). MLA: q through a low-rank q_a/q_b pair (or one q_proj where q_lora_rank is None, V2-Lite), k and v
# from one compressed kv_a.
_DEEPSEEK = (
    "model.embed_tokens", "model.norm", "lm_head", f"{_L}.input_layernorm", f"{_L}.post_attention_layernorm",
    f"{_L}.self_attn.q_proj", f"{_L}.self_attn.q_a_proj", f"{_L}.self_attn.q_a_layernorm", f"{_L}.self_attn.q_b_proj",
    f"{_L}.self_attn.kv_a_proj_with_mqa", f"{_L}.self_attn.kv_a_layernorm", f"{_L}.self_attn.o_proj",
    f"{_L}.mlp.gate", *_MLP, f"{_L}.mlp.shared_experts.gate_proj", f"{_L}.mlp.shared_experts.up_proj",
    f"{_L}.mlp.shared_experts.down_proj",
)
# kv_b_proj, (H*(nope+v), kv_lora), the converter splits per head into k_b, transposed ((H, kv_lora, nope)), and
# v_b ((H, v, kv_lora)), for llama.cpp's absorbed attention (its DeepseekV2Model.modify_tensors).
@dataclass(frozen=True)
class Split:
    """A Hugging Face tensor (one per layer) the converter wrote as several GGUF tensors, and the rule that
    joins them back (a name in ``reader.JOINS``).

    Attributes:
        hf: the Hugging Face name, ``{L}`` the layer.
        parts: the GGUF names of the pieces (``{L}`` the layer), in the order the rule takes them.
        rule: the join's name.
    """

    hf: str
    parts: tuple[str, ...]
    rule: str


_KV_B = Split(f"{_L}.self_attn.kv_b_proj.weight", ("blk.{L}.attn_k_b.weight", "blk.{L}.attn_v_b.weight"), "mla_kv_b")
DEEPSEEK: tuple[Family, ...] = (
    # V3 routes by sigmoid scores plus a learned bias (e_score_correction_bias, llama.cpp's exp_probs_b)
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek2", (*_DEEPSEEK, f"{_L}.mlp.gate.e_score_correction"),
           experts=_L + ".mlp.experts.{E}.{P}.weight", moe_key="n_routed_experts", splits=(_KV_B,)),
    Family("deepseek_v2", "DeepseekV2ForCausalLM", "deepseek2", _DEEPSEEK,
           experts=_L + ".mlp.experts.{E}.{P}.weight", moe_key="n_routed_experts", splits=(_KV_B,)),
)
FAMILIES += DEEPSEEK
BY_TYPE.update({f.model_type: f for f in DEEPSEEK})
# One GGUF architecture, several model types: the first whose marker tensor (a name ending so) the GGUF holds;
# "" marks the default. DeepSeek-V3's router bias exists in V3 only (transformers' V2 has no such parameter).
VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {
    "deepseek2": ((".exp_probs_b.bias", "deepseek_v3"), ("", "deepseek_v2")),
}
# Names the converter changes before gguf's TensorNameMap sees them (its ModelBase.modify_tensors), changed back:
# TensorNameMap's name -> the one save_pretrained writes.
RENAMED = {".mlp.gate.e_score_correction.bias": ".mlp.gate.e_score_correction_bias"}  # name endings


def renamed(name: str) -> str:
    """``name`` as save_pretrained writes it (``RENAMED``)."""
    for theirs, ours in RENAMED.items():
        if name.endswith(theirs):
            return name[: -len(theirs)] + ours
    return name


def family_for(arch: str, tensor_names) -> Family:
    """The family of a GGUF from its architecture and tensor names (``VARIANTS`` where one architecture is
    several model types, else ``family_of``).

    Raises:
        KeyError: no family writes this architecture.
    """
    names = list(tensor_names)
    for marker, model_type in VARIANTS.get(arch, ()):
        if not marker or any(n.endswith(marker) for n in names):
            return BY_TYPE[model_type]
    return family_of(arch, any(n.endswith("_exps.weight") for n in names))
