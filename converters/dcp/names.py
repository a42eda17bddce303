"""The two namings a DCP checkpoint holds, as data: torchtitan's models' state dicts, or Hugging Face's.

``hf``: the keys are Hugging Face PyTorch names as they are (an HF model trained under FSDP and saved with
``torch.distributed.checkpoint``): read and written unchanged.

``torchtitan``: the state dict of torchtitan's model of the architecture, mapped to and from Hugging Face names
as torchtitan's own ``state_dict_adapter`` of that model does (its ``from_hf_map``; torchtitan 0.3's names are
written, and 0.2's read too: ``attention.wq`` for ``attention.qkv_linear.wq``, ``output`` for ``lm_head``,
``moe.experts.w1`` for ``moe.routed_experts.inner_experts.w1_EFD``, ``moe.expert_bias`` for ``moe.expert_bias_E``),
per family:

    llama3  Llama (model_type llama): q and k rows in torchtitan's rotary order (interleaved pairs, as Meta's
            weights: ``converters.native.layout.permute``), permuted on the way as the adapter does
    qwen3   Qwen3 and Qwen3-MoE: no permutation (torchtitan's Qwen3 rotates halves, as transformers);
            attention q_norm / k_norm; routed experts stacked on a leading axis, one tensor per projection
            (``w1_EFD`` (experts, d_ffn, d_model) = every expert's gate_proj, ``w3_EFD`` up, ``w2_EDF`` down
            (experts, d_model, d_ffn)) where Hugging Face has one tensor per expert, router ``moe.router.gate``;
            the load-balancing buffer ``moe.expert_bias_E`` has no Hugging Face counterpart (the adapter drops it)
    deepseek_v3  DeepSeek-V3: MLA attention (``attention.wkv_a``, ``kv_norm``, ``wkv_b``, ``wq`` or ``wq_a``/``q_norm``/
            ``wq_b``), dense first layers (``feed_forward``), experts stacked as qwen3's, shared experts
            (``moe.shared_experts.w1``), and ``moe.expert_bias_E`` = the router's ``e_score_correction_bias``

w1 is gate, w3 up, w2 down everywhere. A name of neither is refused on read, naming it; an architecture with no
torchtitan model here is refused on write with ``--dcp-naming hf`` as the way out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ffn_tools.errors import CheckpointError

NAMINGS = ("torchtitan", "hf")


@dataclass(frozen=True)
class Name:
    """One torchtitan tensor and its Hugging Face name(s).

    Attributes:
        titan: torchtitan's name, ``{L}`` the layer.
        hf: the Hugging Face name, ``{L}`` the layer and, where ``stacked``, ``{E}`` the expert.
        rotary: "q" or "k" where the rows are permuted (llama3).
        stacked: torchtitan stacks the experts on dim 0; Hugging Face has one tensor per expert.
    """

    titan: str
    hf: str
    rotary: str | None = None
    stacked: bool = False

    def titan_pattern(self) -> re.Pattern:
        return re.compile(re.escape(self.titan).replace(re.escape("{L}"), r"(?P<L>\d+)"))

    def hf_pattern(self) -> re.Pattern:
        p = re.escape(self.hf).replace(re.escape("{L}"), r"(?P<L>\d+)").replace(re.escape("{E}"), r"(?P<E>\d+)")
        return re.compile(p)


_L, _T = "model.layers.{L}", "layers.{L}"


def _family(qkv: str, output: str, experts: tuple[str, str, str], rotary: bool, qwen: bool) -> tuple[Name, ...]:
    """One family's names in one torchtitan version: ``qkv`` the attention projections' module, ``output`` the
    unembedding's name, ``experts`` the stacked gate, up and down names."""
    names = [
        Name("tok_embeddings.weight", "model.embed_tokens.weight"),
        Name("norm.weight", "model.norm.weight"),
        Name(output, "lm_head.weight"),
        Name(f"{_T}.{qkv}.wq.weight", f"{_L}.self_attn.q_proj.weight", rotary="q" if rotary else None),
        Name(f"{_T}.{qkv}.wk.weight", f"{_L}.self_attn.k_proj.weight", rotary="k" if rotary else None),
        Name(f"{_T}.{qkv}.wv.weight", f"{_L}.self_attn.v_proj.weight"),
        Name(f"{_T}.attention.wo.weight", f"{_L}.self_attn.o_proj.weight"),
        Name(f"{_T}.attention_norm.weight", f"{_L}.input_layernorm.weight"),
        Name(f"{_T}.ffn_norm.weight", f"{_L}.post_attention_layernorm.weight"),
        Name(f"{_T}.feed_forward.w1.weight", f"{_L}.mlp.gate_proj.weight"),
        Name(f"{_T}.feed_forward.w3.weight", f"{_L}.mlp.up_proj.weight"),
        Name(f"{_T}.feed_forward.w2.weight", f"{_L}.mlp.down_proj.weight"),
    ]
    if qwen:
        names += [Name(f"{_T}.attention.q_norm.weight", f"{_L}.self_attn.q_norm.weight"),
                  Name(f"{_T}.attention.k_norm.weight", f"{_L}.self_attn.k_norm.weight"),
                  Name(f"{_T}.moe.router.gate.weight", f"{_L}.mlp.gate.weight"),
                  *(Name(f"{_T}.moe.{w}", f"{_L}.mlp.experts.{{E}}.{role}_proj.weight", stacked=True)
                    for w, role in zip(experts, ("gate", "up", "down")))]
    return tuple(names)


# torchtitan 0.3's names (written, and read); its attention modules fuse q, k, v (``qkv_linear.wqkv``) but its
# ``state_dict()`` holds them apart, as saved
_NOW = ("attention.qkv_linear", "lm_head.weight",
        ("routed_experts.inner_experts.w1_EFD", "routed_experts.inner_experts.w3_EFD",
         "routed_experts.inner_experts.w2_EDF"))
def _deepseek(experts: tuple[str, str, str], output: str, bias: str) -> tuple[Name, ...]:
    """DeepSeek-V3: MLA attention (q through a low-rank pair where q_lora_rank is set), dense first layers,
    routed experts stacked, shared experts, the router's score-correction bias (``bias``: the MoE's buffer)."""
    mla = (("q_proj", "wq"), ("q_a_proj", "wq_a"), ("q_a_layernorm", "q_norm"), ("q_b_proj", "wq_b"),
           ("kv_a_proj_with_mqa", "wkv_a"), ("kv_a_layernorm", "kv_norm"), ("kv_b_proj", "wkv_b"), ("o_proj", "wo"))
    return (
        Name("tok_embeddings.weight", "model.embed_tokens.weight"),
        Name("norm.weight", "model.norm.weight"),
        Name(output, "lm_head.weight"),
        *(Name(f"{_T}.attention.{t}.weight", f"{_L}.self_attn.{h}.weight") for h, t in mla),
        Name(f"{_T}.attention_norm.weight", f"{_L}.input_layernorm.weight"),
        Name(f"{_T}.ffn_norm.weight", f"{_L}.post_attention_layernorm.weight"),
        *(Name(f"{_T}.feed_forward.{w}.weight", f"{_L}.mlp.{r}_proj.weight")
          for w, r in (("w1", "gate"), ("w3", "up"), ("w2", "down"))),
        Name(f"{_T}.moe.router.gate.weight", f"{_L}.mlp.gate.weight"),
        Name(f"{_T}.moe.{bias}", f"{_L}.mlp.gate.e_score_correction_bias"),
        *(Name(f"{_T}.moe.{w}", f"{_L}.mlp.experts.{{E}}.{r}_proj.weight", stacked=True)
          for w, r in zip(experts, ("gate", "up", "down"))),
        *(Name(f"{_T}.moe.shared_experts.{w}.weight", f"{_L}.mlp.shared_experts.{r}_proj.weight")
          for w, r in (("w1", "gate"), ("w3", "up"), ("w2", "down"))),
    )


# torchtitan 0.2's (read only); its MoE buffer was ``expert_bias``
_BEFORE = ("attention", "output.weight", ("experts.w1", "experts.w3", "experts.w2"))
FAMILIES: dict[str, tuple[Name, ...]] = {
    "llama3": _family(*_NOW, rotary=True, qwen=False),
    "qwen3": _family(*_NOW, rotary=False, qwen=True),
    "deepseek_v3": _deepseek(_NOW[2], _NOW[1], "expert_bias_E"),
}
LEGACY: dict[str, tuple[Name, ...]] = {
    "llama3": _family(*_BEFORE, rotary=True, qwen=False),
    "qwen3": _family(*_BEFORE, rotary=False, qwen=True),
    "deepseek_v3": _deepseek(_BEFORE[2], _BEFORE[1], "expert_bias"),
}
# Hugging Face model_type -> torchtitan family
MODEL_TYPES = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3", "deepseek_v3": "deepseek_v3"}
# torchtitan keys a model's state dict holds that are training state, not weights (not read; said by inspect)
BUFFERS = re.compile(r"layers\.\d+\.moe\.(?:expert_bias|tokens_per_expert)(?:_E)?$|freqs_cis")


def family_of(config: dict | None, titan_names: list[str] | None = None) -> str:
    """The torchtitan family of a model: from its config's model_type, else (a checkpoint read without one)
    from its names (q_norm: qwen3; else llama3).

    Raises:
        CheckpointError: a model_type torchtitan has no model of here.
    """
    model_type = (config or {}).get("model_type")
    if model_type is not None:
        if model_type not in MODEL_TYPES:
            raise CheckpointError(f"model_type {model_type!r} has no torchtitan naming here (those known: "
                                  f"{', '.join(sorted(MODEL_TYPES))}); write its Hugging Face names with "
                                  "--dcp-naming hf")
        return MODEL_TYPES[model_type]
    names = titan_names or []
    if any(".attention.wkv_a." in n for n in names):
        return "deepseek_v3"
    return "qwen3" if any(".attention.q_norm." in n or ".moe." in n for n in names) else "llama3"


def heads_of(config: dict) -> dict[str, int | None]:
    """The head counts the rotary permutation runs over: "q" the query's, "k" the key's (its kv heads)."""
    q = config.get("num_attention_heads")
    return {"q": q, "k": config.get("num_key_value_heads") or q}


def to_hf(titan: str, family: str) -> tuple[Name, dict[str, str]] | None:
    """The spec and placeholders of a torchtitan name, or None when the family has no such name."""
    for spec in (*FAMILIES[family], *LEGACY[family]):
        m = spec.titan_pattern().fullmatch(titan)
        if m:
            return spec, m.groupdict()
    return None


def to_titan(hf: str, family: str) -> tuple[Name, dict[str, str]] | None:
    """The spec and placeholders of a Hugging Face name, or None when the family has no such name."""
    for spec in FAMILIES[family]:
        m = spec.hf_pattern().fullmatch(hf)
        if m:
            return spec, m.groupdict()
    return None


def stacked(family: str) -> dict[str, str]:
    """Role ("gate", "up", "down") -> the torchtitan name (``{L}``) of the family's stacked experts; {} for a family
    without experts."""
    return {spec.hf.rsplit(".", 2)[-2].removesuffix("_proj"): spec.titan for spec in FAMILIES[family] if spec.stacked}
