"""Where FFN tensors live, declared as data: naming schemes with ``{layer}`` / ``{expert}`` templates.

A ``Scheme`` is a naming family (Hugging Face Llama-style, Meta-native, Mixtral, Qwen-MoE, ...). It has one
``Group`` per kind of FFN it contains (dense MLPs, routed experts, the shared expert), and each group lists
the *forms* its tensors can take, so that splitting and fusing move between forms of the same scheme:

    separate          gate, up, down per FFN
    fused             gate_up (layout: ``Group.layout``) and down per FFN
    stacked           experts stacked on dim 0: gate_up (E, 2I, H) and down (E, H, I), transformers v5
    stacked-separate  experts stacked on dim 0, separate: gate, up (E, I, H) and down (E, H, I), MLX

Weights are PyTorch (out, in). A bias is named like its weight with ``.weight`` -> ``.bias`` (or, for a
name without ``.weight``, with ``_bias`` appended, as GPT-OSS stores stacked expert biases).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SchemeError
from .layouts import CONCAT, GateUpLayout

KINDS = ("dense", "expert", "shared")
FORMS = ("separate", "fused", "stacked", "stacked-separate")
# The roles each form names.
FORM_ROLES = {"separate": {"gate", "up", "down"}, "fused": {"gate_up", "down"}, "stacked": {"gate_up", "down"},
              "stacked-separate": {"gate", "up", "down"}}
ROLES = ("gate", "up", "down", "gate_up")
PLACEHOLDERS = ("layer", "expert")


@dataclass(frozen=True)
class Form:
    """Tensor-name templates of one FFN in one storage form (unused roles are None)."""

    gate: str | None = None
    up: str | None = None
    down: str | None = None
    gate_up: str | None = None
    stacked: bool = False

    @property
    def fused(self) -> bool:
        return self.gate_up is not None

    def templates(self) -> dict[str, str]:
        """role -> weight-name template, for the roles this form has."""
        return {r: t for r in ROLES if (t := getattr(self, r)) is not None}


@dataclass(frozen=True)
class Group:
    """One kind of FFN in a scheme and the forms its tensors take."""

    kind: str
    forms: dict[str, Form]
    layout: GateUpLayout = CONCAT


@dataclass(frozen=True)
class Scheme:
    """A naming family. ``model_types`` are config.json ``model_type`` values that select it."""

    name: str
    description: str
    groups: tuple[Group, ...]
    model_types: tuple[str, ...] = field(default=())


def bias_name(weight_name: str) -> str:
    """The bias tensor that belongs to a weight tensor."""
    return weight_name[: -len("weight")] + "bias" if weight_name.endswith(".weight") else weight_name + "_bias"


def _sep(prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> Form:
    return Form(gate=f"{prefix}.{gate}.weight", up=f"{prefix}.{up}.weight", down=f"{prefix}.{down}.weight")


def _fused(prefix: str, gate_up: str = "gate_up_proj", down: str = "down_proj") -> Form:
    return Form(gate_up=f"{prefix}.{gate_up}.weight", down=f"{prefix}.{down}.weight")


_L = "model.layers.{layer}"
_HF_DENSE = Group("dense", {"separate": _sep(f"{_L}.mlp"), "fused": _fused(f"{_L}.mlp")})
_V5_STACKED = Form(gate_up=f"{_L}.mlp.experts.gate_up_proj", down=f"{_L}.mlp.experts.down_proj", stacked=True)

# Table order matters only to break ties between schemes that read a checkpoint identically.
SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("hf", "Hugging Face Llama-style MLP (Llama, Mistral, Qwen2/3, Gemma; Phi-3 fused gate_up_proj)",
           (_HF_DENSE,),
           ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "granite", "olmo",
            "olmo2", "cohere", "starcoder2", "deepseek_v2", "deepseek_v3", "glm", "helium", "smollm3")),
    Scheme("v5-experts", "transformers v5 stacked experts mlp.experts.gate_up_proj (E, 2I, H)",
           (Group("expert", {"stacked": _V5_STACKED,
                             "separate": _sep(f"{_L}.mlp.experts.{{expert}}"),
                             "fused": _fused(f"{_L}.mlp.experts.{{expert}}")}),
            _HF_DENSE)),
    Scheme("qwen-moe", "Qwen2-MoE / Qwen3-MoE: mlp.experts.{e}.*_proj and mlp.shared_expert",
           (Group("expert", {"separate": _sep(f"{_L}.mlp.experts.{{expert}}"),
                             "fused": _fused(f"{_L}.mlp.experts.{{expert}}"),
                             "stacked": _V5_STACKED}),
            Group("shared", {"separate": _sep(f"{_L}.mlp.shared_expert"), "fused": _fused(f"{_L}.mlp.shared_expert")}),
            _HF_DENSE),
           ("qwen2_moe", "qwen3_moe")),
    Scheme("mixtral", "Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2 (w1 gate, w3 up, w2 down)",
           (Group("expert", {"separate": _sep(f"{_L}.block_sparse_moe.experts.{{expert}}", "w1", "w3", "w2"),
                             "fused": _fused(f"{_L}.block_sparse_moe.experts.{{expert}}", "w13", "w2"),
                             "stacked": _V5_STACKED}),),
           ("mixtral",)),
    Scheme("meta", "Meta / Mistral native: layers.{l}.feed_forward.w1/w3/w2 (w1 gate, w3 up, w2 down)",
           (Group("dense", {"separate": _sep("layers.{layer}.feed_forward", "w1", "w3", "w2")}),)),
    Scheme("ffn-tools", "ffn-tools extract output: layers.{l}.{gate,up,down}.weight",
           (Group("dense", {"separate": _sep("layers.{layer}", "gate", "up", "down")}),
            Group("expert", {"separate": _sep("layers.{layer}.experts.{expert}", "gate", "up", "down")}),
            Group("shared", {"separate": _sep("layers.{layer}.shared_expert", "gate", "up", "down")}))),
)}


@functools.lru_cache(maxsize=None)
def compile_template(template: str) -> re.Pattern:
    """A regex matching the tensor names of a template, with named groups for its placeholders.

    Cached: detection and verify match every template against every tensor name.

    Raises:
        SchemeError: the template has no {layer}, or an unknown {placeholder}.
    """
    unknown = set(re.findall(r"\{(\w*)\}", template)) - set(PLACEHOLDERS)
    if unknown or "{layer}" not in template:
        raise SchemeError(f"template {template!r}: needs {{layer}} and may use {{expert}}; "
                          f"unknown placeholders: {', '.join(sorted(unknown)) or 'none'}")
    pattern = re.escape(template)
    for p in PLACEHOLDERS:
        pattern = pattern.replace(re.escape("{" + p + "}"), f"(?P<{p}>[0-9]+)")
    return re.compile(pattern)


def custom_scheme(gate: str | None = None, up: str | None = None, down: str | None = None,
                  gate_up: str | None = None, layout: GateUpLayout = CONCAT) -> Scheme:
    """A one-group scheme from ``--gate/--up/--down`` (or ``--gate-up``) templates.

    Raises:
        SchemeError: a template is missing or malformed.
    """
    if not down or not ((gate and up) or gate_up):
        raise SchemeError("custom templates need --down and either both --gate and --up or --gate-up")
    kind = "expert" if "{expert}" in (gate or gate_up or "") else "dense"
    forms = {}
    if gate and up:
        forms["separate"] = Form(gate=gate, up=up, down=down)
    if gate_up:
        forms["fused"] = Form(gate_up=gate_up, down=down)
    for f in forms.values():
        for t in f.templates().values():
            compile_template(t)
    return Scheme("custom", "templates given on the command line", (Group(kind, forms, layout),))


def load_scheme_file(path: str | Path) -> Scheme:
    """Read a scheme from JSON.

    Either the short form ``{"gate": T, "up": T, "down": T}`` (or ``"gate_up"``), or the full form
    ``{"name": ..., "groups": [{"kind": "dense", "forms": {"separate": {"gate": T, ...}},
    "layout": {"order": "gate-up", "arrangement": "concat", "tp": 1}}]}``.

    Raises:
        SchemeError: the file is missing, not JSON, or does not describe a scheme.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SchemeError(f"{path}: cannot read scheme file ({e})") from None
    if not isinstance(data, dict):
        raise SchemeError(f"{path}: a scheme file holds a JSON object")
    if "groups" not in data:
        if not data.get("down") or not ((data.get("gate") and data.get("up")) or data.get("gate_up")):
            raise SchemeError(f"{path}: a scheme file needs \"down\" and either \"gate\" and \"up\" or "
                              f"\"gate_up\" (templates with {{layer}}), or \"groups\"; found keys {sorted(data)}")
        return custom_scheme(**{k: data.get(k) for k in ROLES})
    try:
        groups = []
        if not data["groups"]:
            raise SchemeError(f"{path}: \"groups\" is empty; declare at least one group of FFN names")
        for g in data["groups"]:
            forms = {name: Form(stacked=name.startswith("stacked"), **spec) for name, spec in g["forms"].items()}
            bad = set(forms) - set(FORMS)
            if g["kind"] not in KINDS or bad:
                raise SchemeError(f"{path}: kind must be one of {KINDS}, forms among {FORMS}")
            for name, f in forms.items():
                need = FORM_ROLES[name]
                if set(f.templates()) != need:
                    raise SchemeError(f"{path}: form {name!r} of the {g['kind']} group needs exactly "
                                      f"{', '.join(sorted(need))}; found {', '.join(sorted(f.templates())) or 'none'}")
                for t in f.templates().values():
                    compile_template(t)
            groups.append(Group(g["kind"], forms, GateUpLayout(**g.get("layout", {}))))
        return Scheme(str(data.get("name", path.stem)), f"from {path}", tuple(groups),
                      tuple(data.get("model_types", ())))
    except (KeyError, TypeError) as e:
        raise SchemeError(f"{path}: malformed scheme ({type(e).__name__}: {e}); see --help for the format") from None


def scheme_for_model_type(model_type: str | None) -> Scheme | None:
    """The scheme a config's ``model_type`` selects, if any."""
    for s in SCHEMES.values():
        if model_type in s.model_types:
            return s
    return None
