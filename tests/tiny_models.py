"""Tiny real checkpoints built with transformers' own configs and ``save_pretrained``.

Every architecture the tests use is one row of ``ARCHS``: a config class and model class from
transformers, and config keyword arguments (2 layers, hidden 64). ``build(arch, path, dtype=...)`` writes
a real Hugging Face checkpoint directory and returns its path.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)

# arch -> (config class, model class, extra config kwargs)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"mlp_bias": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                   "shared_expert_intermediate_size": 80, "decoder_sparse_step": 1}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",  # norm_topk_prob as Qwen3-MoE's checkpoints have it (its
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "head_dim": 16,  # config
                   "decoder_sparse_step": 1, "norm_topk_prob": True}),  # class's default is false: test_clients)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16, "hidden_act": "gelu_pytorch_tanh",
                                                   "hidden_activation": "gelu_pytorch_tanh"}),
    # Gemma 2/3: tied head; a window of 6 (a longer batch reaches past it); llama.cpp scales queries by
    # 1/sqrt(head_dim), so query_pre_attn_scalar is head_dim; Gemma 3's every 6th layer is global: 6 layers.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
                                                     "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                                                     "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
                                                         "hidden_activation": "gelu_pytorch_tanh", "num_hidden_layers": 6,
                                                         "tie_word_embeddings": True, "final_logit_softcapping": 30.0}),
}


# DeepSeek V3 / V2 (MLA attention, a dense first layer, routed + shared experts). One k/v head per query head
# (MLA has no GQA: llama.cpp's converter splits kv_b_proj by num_key_value_heads). V3 as its config.json
# says: sigmoid routing with a learned bias, grouped (noaux_tc), q through a LoRA pair. V2 as V2-Lite: no q
# LoRA (q_proj), softmax routing, greedy top-k, and 27 layers: llama.cpp reads a deepseek2 GGUF without
# q_lora_rank only where it has 27 (V2-Lite) or 26 layers (llama-model.cpp's is_lite).
_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=48,
            first_k_dense_replace=1, pad_token_id=None)  # llama-bpe has no pad token
ARCHS.update({
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {**_MLA, "q_lora_rank": 24, "n_group": 2, "topk_group": 1, "scoring_func": "sigmoid",
                     "topk_method": "noaux_tc"}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    {**_MLA, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
                     "routed_scaling_factor": 1.0, "num_hidden_layers": 27}),
})


def make_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """An initialised transformers model of ``arch`` (random weights, seeded, in ``dtype``)."""
    import transformers

    cfg_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, cfg_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    with torch.no_grad():  # default init leaves some weights (norms, biases) at exact 0/1: perturb all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def build(arch: str, path: Path, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None,
          safe_serialization: bool = True, seed: int = 0) -> Path:
    """Save a tiny ``arch`` model with ``save_pretrained`` into ``path`` and return ``path``."""
    model = make_model(arch, dtype, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if not safe_serialization:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        path.mkdir(parents=True, exist_ok=True)
        model.config.architectures = [type(model).__name__]  # as save_pretrained records it
        model.config.save_pretrained(path)
        model.generation_config.save_pretrained(path)
        torch.save(state, path / "pytorch_model.bin")
        return path
    model.save_pretrained(path, **kwargs)
    return path


def logits(path: Path, arch: str, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of the checkpoint at ``path`` loaded by transformers' own ``from_pretrained``."""
    import transformers

    model_name = ARCHS[arch][1]
    model = getattr(transformers, model_name).from_pretrained(path).eval()
    if tokens is None:
        tokens = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        return model(tokens).logits
