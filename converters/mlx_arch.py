"""How mlx-lm names and quantizes each architecture's weights, declared as data.

mlx-lm loads Hugging Face names almost unchanged; what each model's ``sanitize`` changes is listed here:
routed experts stacked into ``switch_mlp`` tensors (E, out, in), rotary ``inv_freq`` buffers dropped, and
``lm_head`` dropped when the model ties it to ``embed_tokens`` (decided as transformers decides, see
``head_is_tied``, not by mlx-lm's ``ModelArgs`` defaults). ``quantize_overrides`` mirrors a model's
``quant_predicate`` (module path suffix -> the parameters ``mlx_lm.convert`` records for it). Read from
mlx_lm 0.32 ``models/*.py``; mistral shares llama's entry as in mlx-lm's ``MODEL_REMAPPING``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ffn_tools.errors import FFNToolsError


@dataclass(frozen=True)
class SwitchMLP:
    """Routed experts ``{prefix}.experts.{e}.{hf}.weight`` stacked as ``{prefix}.switch_mlp.{mlx}.weight``.

    Attributes:
        prefix: module path of the MoE block, with ``{layer}``.
        projections: HF projection name -> mlx-lm projection name.
        count_keys: config.json keys that may give the number of experts (transformers v5 renamed some).
    """

    prefix: str
    projections: dict[str, str]
    count_keys: tuple[str, ...]

    def count(self, config: dict) -> int | None:
        """The number of experts config.json declares, if it does."""
        return next((config[k] for k in self.count_keys if isinstance(config.get(k), int)), None)

    def expert_pattern(self) -> re.Pattern:
        """Matches per-expert HF weight names; groups: layer, expert, proj."""
        p = re.escape(self.prefix).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
        projs = "|".join(map(re.escape, self.projections))
        return re.compile(rf"{p}\.experts\.(?P<expert>\d+)\.(?P<proj>{projs})\.weight")

    def switch_pattern(self) -> re.Pattern:
        """Matches stacked MLX names; groups: layer, proj (mlx-lm's name), part (weight/scales/biases)."""
        p = re.escape(self.prefix).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
        projs = "|".join(map(re.escape, self.projections.values()))
        return re.compile(rf"{p}\.switch_mlp\.(?P<proj>{projs})\.(?P<part>weight|scales|biases)")

    def stacked_name(self, layer: int, hf_proj: str) -> str:
        return f"{self.prefix.format(layer=layer)}.switch_mlp.{self.projections[hf_proj]}.weight"

    def expert_name(self, layer: int, expert: int, mlx_proj: str) -> str:
        hf = {v: k for k, v in self.projections.items()}[mlx_proj]
        return f"{self.prefix.format(layer=layer)}.experts.{expert}.{hf}.weight"


@dataclass(frozen=True)
class Arch:
    """What mlx-lm's model class for a ``model_type`` expects.

    Attributes:
        tie: "config" (``tie_word_embeddings``, see ``head_is_tied``), "always" (no lm_head in the MLX model)
            or "never" (lm_head always kept).
        tie_default: mlx-lm's ``ModelArgs`` default for ``tie_word_embeddings``; None where it is required.
        hf_tie_default: transformers' default for it (the config class's), used when config.json lacks the key.
        dense_form: "separate" (gate_proj, up_proj) or "fused" (Phi-3's gate_up_proj).
        switch: how routed experts are stacked, or None for dense models.
        quantize_overrides: (module path suffix, quantization parameters) from the model's quant_predicate.
    """

    tie: str = "config"
    tie_default: bool | None = False
    hf_tie_default: bool = False
    dense_form: str = "separate"
    switch: SwitchMLP | None = None
    quantize_overrides: tuple[tuple[str, dict], ...] = field(default=())


_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_QWEN = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_LLAMA = Arch(tie_default=True)
_QWEN_COUNT = ("num_experts", "num_local_experts")

ARCHS: dict[str, Arch] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": Arch(tie_default=True),
    "qwen3": Arch(tie_default=None),
    "gemma": Arch(tie="always", hf_tie_default=True),
    "gemma2": Arch(tie="always", hf_tie_default=True),
    "phi3": Arch(dense_form="fused"),
    "mixtral": Arch(switch=SwitchMLP("model.layers.{layer}.block_sparse_moe", _W, ("num_local_experts",))),
    "qwen2_moe": Arch(tie="never", switch=SwitchMLP("model.layers.{layer}.mlp", _QWEN, _QWEN_COUNT)),
    "qwen3_moe": Arch(tie_default=None, switch=SwitchMLP("model.layers.{layer}.mlp", _QWEN, _QWEN_COUNT),
                      quantize_overrides=(("mlp.gate", {"group_size": 64, "bits": 8}),)),
}

# Tensors mlx-lm recomputes instead of loading.
DROPPED = (re.compile(r".*\.rotary_emb\.inv_freq"),)
# Forms mlx-lm's model classes cannot load, and the ffn-tools command that fixes each.
_WRONG_FORM = {
    "separate": (re.compile(r".*\.gate_up_proj(\.weight)?"), "ffn-tools split-gateup"),
    "fused": (re.compile(r".*\.mlp\.gate_proj\.weight"), "ffn-tools fuse-gateup"),
}


def arch_for(config: dict | None, where: str) -> tuple[str, Arch]:
    """The model_type and its ``Arch``.

    Raises:
        FFNToolsError: no config.json, or a model_type this table does not describe.
    """
    if not config:
        raise FFNToolsError(f"{where}: no config.json; MLX export needs it to know the architecture "
                            "(model_type) mlx_lm will build; put the model's config.json beside the weights")
    model_type = config.get("model_type")
    if model_type not in ARCHS:
        raise FFNToolsError(f"{where}: model_type {model_type!r} is not supported for MLX export; "
                            f"supported: {', '.join(sorted(ARCHS))}")
    return model_type, ARCHS[model_type]


TIE_KEY = "tie_word_embeddings"
# safetensors metadata naming the config.json keys export added that the source lacked (comma-separated):
# ``tie_word_embeddings`` and ``legacy_config``'s v4 keys; reading the directory back drops them, so the round
# trip gives the source's config.json. Keys the source had stay, whatever their value. mlx-lm ignores it.
ADDED_KEYS = "ffn_tools_added_config_keys"
# Likewise the keys the source had as null that export filled in (``rope_scaling``): reading back nulls them.
NULLED_KEYS = "ffn_tools_null_config_keys"


def added_metadata(source: dict, config: dict) -> dict[str, str]:
    """The safetensors metadata recording what export added to ``source`` to make ``config`` (see
    ``ADDED_KEYS``, ``NULLED_KEYS``); empty when nothing was."""
    added = sorted(k for k in config if k not in source)
    nulled = sorted(k for k in config if k in source and source[k] is None and config[k] is not None)
    return {k: ",".join(v) for k, v in ((ADDED_KEYS, added), (NULLED_KEYS, nulled)) if v}


def restore_source_config(config: dict, metadata: dict) -> dict:
    """The inverse of ``added_metadata``: ``config`` without the keys export added, its filled nulls nulled."""
    out = dict(config)
    for k in filter(None, metadata.get(ADDED_KEYS, "").split(",")):
        out.pop(k, None)
    for k in filter(None, metadata.get(NULLED_KEYS, "").split(",")):
        if k in out:
            out[k] = None
    return out


def head_is_tied(arch: Arch, config: dict, has_head: bool = True) -> bool:
    """Whether the model ties lm_head to embed_tokens, so mlx-lm's model must have no lm_head.

    As transformers decides: config.json's ``tie_word_embeddings`` where present, else the config class's
    default (``hf_tie_default``; False for Llama and Qwen2 although mlx-lm's ``ModelArgs`` say True). A
    checkpoint without ``lm_head.weight`` (``has_head`` False) can only run tied.
    """
    if arch.tie != "config":
        return arch.tie == "always"
    if TIE_KEY in config:
        return bool(config[TIE_KEY])
    return arch.hf_tie_default or not has_head


def added_tie_key(arch: Arch, config: dict, has_head: bool) -> bool | None:
    """The ``tie_word_embeddings`` value the MLX config.json needs because the source's lacks the key and
    mlx-lm's ``ModelArgs`` would otherwise decide differently (or fail: Qwen3 requires it), else None."""
    if arch.tie != "config" or TIE_KEY in config:
        return None
    tied = head_is_tied(arch, config, has_head)
    return None if arch.tie_default is tied else tied


def wrong_form(arch: Arch, names) -> str | None:
    """An error message when the checkpoint's FFNs are in a form mlx-lm's model cannot load, else None."""
    rx, fix = _WRONG_FORM[arch.dense_form]
    bad = sorted(n for n in names if rx.fullmatch(n))
    if not bad:
        return None
    want = "separate gate_proj/up_proj" if arch.dense_form == "separate" else "one fused gate_up_proj"
    return (f"{bad[0]}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}: mlx-lm's model expects {want} "
            f"projections; run `{fix}` on the checkpoint first")


def quantize_override(arch: Arch, module_path: str) -> dict | None:
    """The parameters a model's quant_predicate gives ``module_path``, or None for the defaults."""
    for suffix, params in arch.quantize_overrides:
        if module_path.endswith(suffix):
            return dict(params)
    return None


def legacy_config(config: dict, arch: Arch) -> tuple[dict, list[str]]:
    """config.json with the keys transformers v5 moved restored where mlx-lm's ``ModelArgs`` read them.

    transformers v5 nests ``rope_theta`` (and the scaling) under ``rope_parameters`` and renamed some expert
    counts; most mlx-lm models read the old top-level keys and would silently use their defaults (Qwen2's
    rope_theta 1e6 instead of the checkpoint's). Existing keys are never overwritten (a null ``rope_scaling``
    is filled in). Export records what it added (``added_metadata``) so reading back removes only that.

    Returns:
        (the new config, lines saying what was added).
    """
    config, added = dict(config), []
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
            added.append("rope_theta")
        if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            config["rope_scaling"] = {"type": scaling["rope_type"], **scaling}
            added.append("rope_scaling")
    if arch.switch and arch.switch.count_keys[0] not in config and (n := arch.switch.count(config)) is not None:
        config[arch.switch.count_keys[0]] = n
        added.append(arch.switch.count_keys[0])
    lines = [f"config.json: added {', '.join(added)} from transformers v5 keys (mlx-lm reads the old names); "
             "reading the MLX model back drops them again"] if added else []
    return config, lines
