"""The naming families ffn-tools knows, as data: groups of FFN tensors relative to a layer, placed under every
layer prefix, and the families (sets of groups) model types select.

A group says where one kind of FFN lives (``mlp``, ``mlp.experts``, ``mlp.shared_experts``, ...) and in which
forms; ``{P}`` stands for the layer prefix. A family lists the groups a model family has and the config
``model_type`` values that select it. Detection (``detect``) matches every group of ``LIBRARY`` and names
the union after the family holding it. Adding a family is adding rows here.
"""

from __future__ import annotations

from .layouts import CONCAT, GateUpLayout
from .registry import Form, Group, Scheme


def _sep(prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj", w: str = ".weight",
         stacked: bool = False) -> Form:
    return Form(gate=f"{prefix}.{gate}{w}", up=f"{prefix}.{up}{w}", down=f"{prefix}.{down}{w}", stacked=stacked)


def _fused(prefix: str, gate_up: str = "gate_up_proj", down: str = "down_proj", w: str = ".weight",
           stacked: bool = False, transposed: bool = False) -> Form:
    return Form(gate_up=f"{prefix}.{gate_up}{w}", down=f"{prefix}.{down}{w}", stacked=stacked, transposed=transposed)


# Where a layer lives in a checkpoint. Every group below is declared relative to one ("{P}") and exists
# under each: the language model of a multimodal checkpoint is found like a plain one.
LAYER_PREFIXES = ("model.layers.{layer}", "layers.{layer}", "model.language_model.layers.{layer}",
                  "language_model.model.layers.{layer}", "model.model.layers.{layer}", "transformer.h.{layer}",
                  "backbone.layers.{layer}", "backbone.blocks.{layer}", "cpmant.encoder.layers.{layer}")
_E = "{expert}"
_COLS = GateUpLayout(axis="columns")
_V5 = "{P}.mlp.experts"  # where transformers v5 keeps stacked routed experts in memory


def _hf(block: str) -> dict[str, Form]:
    """gate_proj/up_proj/down_proj (or fused gate_up_proj) under ``block``."""
    return {"separate": _sep(block), "fused": _fused(block)}


def _experts(block: str, names=("gate_proj", "up_proj", "down_proj"), fused_name="gate_up_proj",
             stacked_at: str | None = None) -> dict[str, Form]:
    """Routed experts ``block.{e}.*`` with the v5 stacked form at ``stacked_at.{gate_up_proj,down_proj}``."""
    g, u, d = names
    return {"separate": _sep(f"{block}.{_E}", g, u, d), "fused": _fused(f"{block}.{_E}", fused_name, d),
            "stacked": _fused(stacked_at or block, w="", stacked=True)}


# Groups relative to a layer: name -> (kind, forms with "{P}" for the layer prefix, layout).
GROUP_SPECS: dict[str, tuple[str, dict[str, Form], GateUpLayout]] = {
    "mlp": ("dense", _hf("{P}.mlp"), CONCAT),
    "feed_forward": ("dense", _hf("{P}.feed_forward"), CONCAT),
    "mlp_block": ("dense", _hf("{P}.mlp_block"), CONCAT),
    "shared_transf.feed_forward": ("dense", _hf("{P}.shared_transf.feed_forward"), CONCAT),
    "block_sparse_moe": ("dense", _hf("{P}.block_sparse_moe"), CONCAT),
    "feed_forward.w": ("dense", {"separate": _sep("{P}.feed_forward", "w1", "w3", "w2"),
                                 "fused": _fused("{P}.feed_forward", "w13", "w2")}, CONCAT),
    "mlp.c_fc": ("dense", {"separate": _sep("{P}.mlp", "c_fc_0", "c_fc_1", "c_proj"),
                           "fused": _fused("{P}.mlp", "c_fc_01", "c_proj")}, CONCAT),
    "mlp.linear_gate": ("dense", {"separate": _sep("{P}.mlp", "linear_gate"),
                                  "fused": _fused("{P}.mlp")}, CONCAT),
    # Fused-only families split into Llama's names (what separate-projection consumers read).
    "mlp.Wi": ("dense", {"fused": _fused("{P}.mlp", "Wi", "Wo"), "separate": _sep("{P}.mlp")}, CONCAT),
    "mlp.fc": ("dense", {"fused": _fused("{P}.mlp", "fc1", "fc2"), "separate": _sep("{P}.mlp")}, CONCAT),
    "ffn.proj_up": ("dense", {"separate": _sep("{P}.ffn", "proj_up_gate", "proj_up", "proj_down"),
                              "fused": _fused("{P}.ffn", "proj_up_gate_z", "proj_down")}, CONCAT),
    "ffn.ffn.w_in": ("dense", {"separate": _sep("{P}.ffn.ffn", "w_in.w_0", "w_in.w_1", "w_out"),
                               "fused": _fused("{P}.ffn.ffn", "w_in.w_01", "w_out")}, CONCAT),
    "mlp.experts": ("expert", _experts("{P}.mlp.experts"), CONCAT),
    "feed_forward.experts": ("expert", _experts("{P}.feed_forward.experts"), CONCAT),
    "block_sparse_moe.experts": ("expert", _experts("{P}.block_sparse_moe.experts"), CONCAT),
    "block_sparse_moe.experts.w": ("expert", _experts("{P}.block_sparse_moe.experts", ("w1", "w3", "w2"), "w13",
                                                      _V5), CONCAT),
    "ffn.experts.w": ("expert", _experts("{P}.ffn.experts", ("w1", "w3", "w2"), "w13", _V5), CONCAT),
    "block_sparse_moe.input_linear": ("expert", {
        "stacked": _fused("{P}.block_sparse_moe", "input_linear", "output_linear", stacked=True),
        "separate": _sep(f"{{P}}.block_sparse_moe.experts.{_E}")}, CONCAT),
    # Stacked (in, out): GPT-OSS interleaves gate and up columns, Llama-4 concatenates them, Aria too (fc1/fc2).
    "mlp.experts.T-interleaved": ("expert", {
        "stacked": _fused("{P}.mlp.experts", w="", stacked=True, transposed=True),
        "separate": _sep(f"{{P}}.mlp.experts.{_E}")}, GateUpLayout(arrangement="interleaved", axis="columns")),
    "feed_forward.experts.T": ("expert", {
        "stacked": _fused("{P}.feed_forward.experts", w="", stacked=True, transposed=True),
        "separate": _sep(f"{{P}}.feed_forward.experts.{_E}")}, _COLS),
    "mlp.experts.fc": ("expert", {
        "stacked": _fused("{P}.mlp.experts", "fc1", "fc2", stacked=True, transposed=True),
        "separate": _sep(f"{{P}}.mlp.experts.{_E}")}, _COLS),
    "mlp.shared_expert": ("shared", _hf("{P}.mlp.shared_expert"), CONCAT),
    "mlp.shared_experts": ("shared", {**_hf("{P}.mlp.shared_experts"),
                                      "stacked-separate": _sep("{P}.mlp.shared_experts", w="", stacked=True)}, CONCAT),
    "mlp.shared_mlp": ("shared", _hf("{P}.mlp.shared_mlp"), CONCAT),
    "feed_forward.shared_expert": ("shared", _hf("{P}.feed_forward.shared_expert"), CONCAT),
    "block_sparse_moe.shared_experts": ("shared", _hf("{P}.block_sparse_moe.shared_experts"), CONCAT),
    "ffn.shared_experts.w": ("shared", {"separate": _sep("{P}.ffn.shared_experts", "w1", "w3", "w2"),
                                        "fused": _fused("{P}.ffn.shared_experts", "w13", "w2")}, CONCAT),
    "mlp.shared_experts.linear_gate": ("shared", {"separate": _sep("{P}.mlp.shared_experts", "linear_gate"),
                                                  "fused": _fused("{P}.mlp.shared_experts")}, CONCAT),
    "shared_mlp": ("shared", {"fused": _fused("{P}.shared_mlp", "input_linear", "output_linear"),
                              "separate": _sep("{P}.shared_mlp")}, CONCAT),
}


def _at(name: str, prefix: str) -> Group:
    kind, forms, layout = GROUP_SPECS[name]
    placed = {f: Form(**{**{r: t.replace("{P}", prefix) for r, t in form.templates().items()},
                         "stacked": form.stacked, "transposed": form.transposed}) for f, form in forms.items()}
    return Group(kind, placed, layout, name, prefix)


def _family(name: str, description: str, groups: tuple[str, ...], model_types: tuple[str, ...] = (),
            by_model_type_only: bool = False) -> Scheme:
    return Scheme(name, description, tuple(_at(g, p) for g in groups for p in LAYER_PREFIXES), model_types,
                  by_model_type_only)


# Naming families: which groups a model family has, and the config model_types that select it (with several
# families matching the same tensors, the config's decides; then table order). Families that share a
# layout share an entry.
SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    _family("hf", "Hugging Face Llama-style MLP (Llama, Mistral, Qwen2/3, Gemma, ...; Phi-3 fused gate_up_proj)",
            ("mlp",),
            ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "granite", "olmo",
             "olmo2", "cohere", "starcoder2", "glm", "helium", "smollm3")),
    _family("v5-experts", "transformers v5 stacked experts mlp.experts.gate_up_proj (E, 2I, H)",
            ("mlp.experts", "mlp"),
            ("olmoe", "cohere2_moe", "flex_olmo", "mellum", "minimax", "minimax_m2", "phimoe",
             "mimo_v2_flash")),
    _family("qwen-moe", "Qwen2-MoE / Qwen3-MoE: mlp.experts.{e}.*_proj and mlp.shared_expert",
            ("mlp.experts", "mlp.shared_expert", "mlp"),
            ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "qwen4_exp_text", "laguna", "lara_mini")),
    _family("deepseek", "DeepSeek V2/V3 style: mlp.experts, mlp.shared_experts, dense mlp (GLM4-MoE, dots1, "
            "Ernie4.5-MoE, Exaone-MoE, AFMoE, Solar-Open, Sarvam, ...)",
            ("mlp.experts", "mlp.shared_experts", "mlp"),
            ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "dots1",
             "ernie4_5_moe", "exaone_moe", "afmoe", "solar_open", "sarvam_mla", "sarvam_moe", "kolibri1", "axk1",
             "axk2", "bailing_hybrid", "inkling_text", "minimax_m3_vl_text")),
    _family("hunyuan-moe", "Hunyuan MoE: mlp.experts and mlp.shared_mlp", ("mlp.experts", "mlp.shared_mlp", "mlp"),
            ("hunyuan_v1_moe", "hy_v3")),
    _family("hunyuan-v4", "Hunyuan V4: linear_gate in dense and shared MLPs",
            ("mlp.linear_gate", "mlp.experts", "mlp.shared_experts.linear_gate"), ("hy_v4",)),
    _family("mixtral", "Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2 (w1 gate, w3 up, w2 down)",
            ("block_sparse_moe.experts.w",), ("mixtral",)),
    _family("kimi", "Kimi-Linear: block_sparse_moe dense, experts w1/w3/w2, shared_experts",
            ("block_sparse_moe", "block_sparse_moe.experts.w", "block_sparse_moe.shared_experts"), ("kimi_linear",)),
    _family("jamba", "Jamba / Bamba / Falcon-H1: feed_forward and feed_forward.experts",
            ("feed_forward", "feed_forward.experts"), ("jamba", "bamba", "falcon_h1")),
    _family("llama4", "Llama-4: feed_forward.experts stacked (E, H, 2I) and feed_forward.shared_expert",
            ("feed_forward.experts.T", "feed_forward.shared_expert", "feed_forward"), ("llama4_text", "llama4")),
    _family("gpt-oss", "GPT-OSS: mlp.experts stacked (E, H, 2I), gate/up interleaved, with biases",
            ("mlp.experts.T-interleaved",), ("gpt_oss",)),
    _family("aria", "Aria: mlp.experts.fc1/fc2 stacked (E, H, 2I) and mlp.shared_experts",
            ("mlp.experts.fc", "mlp.shared_experts"), ("aria_text", "aria")),
    _family("granite-moe", "Granite-MoE: block_sparse_moe.input_linear (E, 2I, H) / output_linear, shared_mlp",
            ("block_sparse_moe.input_linear", "block_sparse_moe.experts", "shared_mlp"),
            ("granitemoe", "granitemoeshared", "granitemoehybrid", "granitemoe_swa")),
    _family("deepseek-v4", "DeepSeek-V4: ffn.experts.{e}.w1/w3/w2 and ffn.shared_experts",
            ("ffn.experts.w", "ffn.shared_experts.w"), ("deepseek_v4",)),
    _family("meta", "Meta / Mistral native and LFM2: feed_forward.w1/w3/w2 (w1 gate, w3 up, w2 down)",
            ("feed_forward.w",), ("lfm2", "lfm3")),
    _family("exaone", "EXAONE 3: transformer.h.{l}.mlp.c_fc_0/c_fc_1/c_proj", ("mlp.c_fc",), ("exaone",)),
    _family("zamba", "Zamba: the shared transformer block's shared_transf.feed_forward in hybrid layers",
            ("shared_transf.feed_forward",), ("zamba", "zamba2")),
    _family("recurrent-gemma", "RecurrentGemma: mlp_block", ("mlp_block",), ("recurrent_gemma",)),
    _family("modernbert", "ModernBERT decoder: mlp.Wi fused (gate first) / mlp.Wo", ("mlp.Wi",),
            ("modernbert-decoder",)),
    _family("moshi", "Moshi: mlp.fc1 fused (gate first) / mlp.fc2; only by config model_type (fc1/fc2 also name "
            "ungated MLPs)", ("mlp.fc",), ("moshi",), by_model_type_only=True),
    _family("xlstm", "xLSTM: ffn.proj_up_gate / proj_up / proj_down", ("ffn.proj_up",), ("xlstm",)),
    _family("cpmant", "CPM-Ant: ffn.ffn.w_in.w_0 / w_1 / w_out", ("ffn.ffn.w_in",), ("cpmant",)),
    Scheme("ffn-tools", "ffn-tools extract output: layers.{l}.{gate,up,down}.weight",
           (Group("dense", {"separate": _sep("layers.{layer}", "gate", "up", "down")}, CONCAT, "ffn-tools"),
            Group("expert", {"separate": _sep("layers.{layer}.experts.{expert}", "gate", "up", "down")}, CONCAT,
                  "ffn-tools.experts"),
            Group("shared", {"separate": _sep("layers.{layer}.shared_expert", "gate", "up", "down")}, CONCAT,
                  "ffn-tools.shared"))),
)}

# Every group of every family, once: what detection matches a checkpoint against.
LIBRARY: tuple[Group, ...] = tuple(dict.fromkeys(g for s in SCHEMES.values() if not s.by_model_type_only
                                                 for g in s.groups))
