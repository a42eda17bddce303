"""FFNs found in a checkpoint: ``FFNRef`` names one, ``FFN`` says where its tensors are.

Canonical weights are ``gate, up`` (I, H) and ``down`` (H, I) in PyTorch (out, in) orientation, plus
optional biases ``gate_bias``, ``up_bias`` (I,) and ``down_bias`` (H,).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .layouts import GateUpLayout, split
from .registry import Form, Group

if TYPE_CHECKING:
    import torch

# config.json hidden_act -> (gated unit name, kernel activation name). Data, not branches.
ACTIVATIONS: dict[str, tuple[str, str]] = {
    "silu": ("SwiGLU", "silu"),
    "swish": ("SwiGLU", "silu"),
    "gelu": ("GeGLU", "gelu"),
    "gelu_pytorch_tanh": ("GeGLU", "gelu_tanh"),
    "gelu_new": ("GeGLU", "gelu_tanh"),
    "gelu_fast": ("GeGLU", "gelu_tanh"),
    "gelu_python": ("GeGLU", "gelu"),
    "relu2": ("ReGLU²", "relu2"),  # BitNet: relu(x)**2 gating
}
ASSUMED_ACTIVATION = "silu"
# (model_type, hidden_act) -> what transformers actually runs: Gemma's released configs carry a legacy
# "gelu" that GemmaConfig replaces by the tanh approximation.
LEGACY_ACTIVATION: dict[tuple[str, str], str] = {("gemma", "gelu"): "gelu_pytorch_tanh"}
# model_type -> the activation its modeling code hard-codes where its config has no hidden_act (checked
# against transformers 5.24's modules).
HARD_CODED_ACTIVATION: dict[str, str] = {"lfm2": "silu", "lfm3": "silu", "lfm2_moe": "silu", "xlstm": "silu",
                                         "cpmant": "gelu"}


@dataclass(frozen=True)
class Clamped:
    """A model family's clamped gated unit: its modeling code runs ``act(min(g, limit)) * (clamp(u, -limit,
    limit) + up_offset)`` with ``act`` silu of slope alpha (``g * sigmoid(alpha * g)``) or the config's hidden_act.

    Attributes:
        label: the family, as reports name it.
        limit_key, limit_default: the config key of the clamp limit, and its config class's default.
        alpha_key, alpha_default: the config key of silu's slope (None: not configurable), and its default.
        up_offset: added to the clamped up.
        function: the kernel activation the modeling code hard-codes (None: the config's hidden_act).
        only_positive: a limit <= 0 means no clamp (mlx_lm's ``if self.limit > 0``).
    """

    label: str
    limit_key: str
    limit_default: float
    alpha_key: str | None = None
    alpha_default: float = 1.0
    up_offset: float = 0.0
    function: str | None = None
    only_positive: bool = False


# model_type -> the clamped unit its modeling code runs (read from that code; file and lines per entry).
CLAMPED: dict[str, Clamped] = {
    # transformers 5.24 models/gpt_oss/modeling_gpt_oss.py GptOssExperts._apply_gate (lines 82-88): gate.clamp(
    # max=limit), up.clamp(-limit, limit), gate * sigmoid(gate * alpha), (up + 1) * glu; hidden_act is not used.
    # Defaults: configuration_gpt_oss.py lines 68-69. (mlx_lm 0.32's gpt_oss.py: SwigluOAI(), the same formula.)
    "gpt_oss": Clamped("GPT-OSS", "swiglu_limit", 7.0, "swiglu_alpha", 1.702, up_offset=1.0, function="silu"),
    # transformers 5.24 models/deepseek_v4/modeling_deepseek_v4.py DeepseekV4MLP.forward (lines 1030-1033, the
    # shared expert) and DeepseekV4Experts._apply_gate (lines 1066-1074): the same clamps around
    # ACT2FN[hidden_act]. Default: configuration_deepseek_v4.py line 154.
    "deepseek_v4": Clamped("DeepSeek-V4", "swiglu_limit", 10.0),
    # mlx_lm 0.32 models/deepseek_v41.py DeepseekV41SwiGLU (lines 626-640, shared and routed experts): the same
    # clamps around silu, skipped when the limit is <= 0. Default: line 38.
    "deepseek_v41": Clamped("DeepSeek-V4.1", "swiglu_limit", 10.0, function="silu", only_positive=True),
}


@dataclass(frozen=True)
class Activation:
    """The FFN's gated unit as the config states it (or assumed when there is no config).

    ``act(min(g, limit)) * (clamp(u, -limit, limit) + up_offset)``, ``act`` = ``function`` (silu with slope
    ``alpha``: ``g * sigmoid(alpha * g)``); ``limit`` None: no clamps (plain ``act(g) * u``).
    """

    config_name: str
    unit: str  # "SwiGLU" / "GeGLU" / "ReGLU²" / "unknown"
    function: str  # "silu" / "gelu" / "gelu_tanh" / "relu2": the kernels' activation name
    assumed: bool = False
    family: str = ""  # the clamped variant's family ("GPT-OSS"), "" for a plain unit
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0

    @property
    def kernel(self):
        """What the kernels take as ``activation=``: a ``kernels.GLU`` (imports torch; verify uses it)."""
        from .kernels import GLU

        return GLU(self.function, self.alpha, self.limit, self.up_offset)

    def describe(self) -> str:
        note = " (assumed: no hidden_act in config)" if self.assumed else ""
        if not self.family or self.unit == "unknown":
            return f"{self.unit} ({self.config_name}){note}"
        what = [f"alpha {self.alpha:g}" if self.alpha != 1 else self.function]
        what += [f"limit {self.limit:g}" if self.limit is not None else "no clamp"]
        what += [f"up + {self.up_offset:g}"] if self.up_offset else []
        return f"{self.unit}{'-clamped' if self.limit is not None else ''} ({self.family}: {', '.join(what)})"


def _number(config: dict, key: str | None, default: float) -> float:
    """config[key] as a float (absent or null: the config class's default); NaN when it is not a finite number."""
    v = config.get(key) if key else None
    if v is None:
        return default
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else math.nan


def activation_from_config(config: dict | None) -> Activation:
    """Read ``hidden_act`` (or ``hidden_activation``) from a config, and the clamped variant its model_type runs
    (``CLAMPED``: GPT-OSS's limit, alpha and up offset, DeepSeek-V4's limit).

    Unknown activations, and clamp parameters that are not numbers, are reported under their own name with
    unit "unknown" so nothing mislabels them (and verify refuses to run them).
    """
    config = config or {}  # no config: no name, no model_type, as an empty one
    if isinstance(config.get(CLAMPED_RECORD), dict):  # an FFN-only output (extract)
        config = {**config, **config[CLAMPED_RECORD]}
    model_type: str | None = config.get("model_type")  # a string or absent (``read_config`` checks config.json)
    name: str | None = config.get("hidden_activation") or config.get("hidden_act") or \
        (HARD_CODED_ACTIVATION.get(model_type) if model_type is not None else None)
    if model_type is not None and name is not None:
        name = LEGACY_ACTIVATION.get((model_type, name), name)
    clamped = CLAMPED.get(model_type) if model_type is not None else None
    if clamped and clamped.function:  # the modeling code ignores hidden_act
        name = name or clamped.function
    if not name:
        return Activation(ASSUMED_ACTIVATION, *ACTIVATIONS[ASSUMED_ACTIVATION], assumed=True)
    unit, function = ACTIVATIONS[clamped.function] if clamped and clamped.function else \
        ACTIVATIONS.get(name, ("unknown", name))
    if clamped is None:
        return Activation(name, unit, function)
    limit = _number(config, clamped.limit_key, clamped.limit_default)
    alpha = _number(config, clamped.alpha_key, clamped.alpha_default)
    unclamped = clamped.only_positive and limit <= 0
    if not unclamped and (not limit >= 0 or not alpha > 0):  # NaN: not a number
        bad = clamped.limit_key if not limit >= 0 else clamped.alpha_key
        return Activation(f"{name} with {bad}={config.get(bad)!r}", "unknown", function, family=clamped.label)
    return Activation(name, unit, function, family=clamped.label, alpha=alpha, limit=None if unclamped else limit,
                      up_offset=clamped.up_offset)


CLAMPED_RECORD = "ffn_tools_clamped"  # config key of an FFN-only output: its source's clamped unit


def clamped_record(activation: Activation) -> dict:
    """What an FFN-only output (an extract, which has no model_type) keeps of a clamped unit so that it reads
    back the same: the source's model_type and the unit's parameters under their config keys; {} for a plain
    unit."""
    for model_type, c in CLAMPED.items():
        if activation.family and c.label == activation.family:
            record = {"model_type": model_type, c.limit_key: 0 if activation.limit is None else activation.limit}
            return {**record, c.alpha_key: activation.alpha} if c.alpha_key else record
    return {}


@dataclass(frozen=True, order=True)
class FFNRef:
    """Which FFN: a layer, an expert index (None for dense and shared FFNs), and the kind."""

    layer: int
    kind: str  # "dense" | "expert" | "shared"
    expert: int = -1  # -1: not an expert

    def __str__(self) -> str:
        if self.kind == "expert":
            return f"layer {self.layer} expert {self.expert}"
        return f"layer {self.layer}" + (" shared expert" if self.kind == "shared" else "")


@dataclass(frozen=True)
class FFN:
    """One FFN's tensors in a checkpoint.

    Attributes:
        ref: which FFN.
        form_name: "separate", "fused", "stacked" or "stacked-separate" (see ``registry``).
        form: the templates of that form.
        layout: how gate/up share ``gate_up`` in fused forms.
        names: role -> tensor name, for weights ("gate", "up", "down", "gate_up") and biases
            ("gate_bias", ... , "gate_up_bias").
        index: for stacked forms, this expert's index along dim 0.
        d_model, d_ffn: H and I.
        group: the registry group it was found through (its other forms are where split/fuse go).
    """

    ref: FFNRef
    form_name: str
    form: Form
    layout: GateUpLayout
    names: dict[str, str]
    index: int | None
    d_model: int
    d_ffn: int
    group: Group

    @property
    def has_bias(self) -> bool:
        return any(k.endswith("_bias") for k in self.names)


def canonical_weights(ckpt, ffn: FFN) -> "dict[str, torch.Tensor]":
    """Read an FFN's canonical weights (gate, up, down and any biases) from a checkpoint.

    Fused tensors are split with the FFN's layout; stacked experts are indexed (flattened ones sliced); all exact.
    """
    def get(role: str) -> "torch.Tensor":
        return ffn.form.expert_part(ckpt[ffn.names[role]], role, ffn.index, ffn.d_model, ffn.d_ffn)

    out = {"down": get("down")}
    if "gate_up" in ffn.names:
        out["gate"], out["up"] = split(get("gate_up"), ffn.layout, name=ffn.names["gate_up"])
        if "gate_up_bias" in ffn.names:
            out["gate_bias"], out["up_bias"] = split(get("gate_up_bias"), ffn.layout, is_bias=True,
                                                     name=ffn.names["gate_up_bias"])
    else:
        out["gate"], out["up"] = get("gate"), get("up")
    for r in ("gate", "up"):
        if f"{r}_bias" in ffn.names:  # separate, or a fused form's biases stored apart (``separate_biases``)
            out[f"{r}_bias"] = get(f"{r}_bias")
    if "down_bias" in ffn.names:
        out["down_bias"] = get("down_bias")
    for r in ("gate", "up", "down"):
        if ffn.form.turns(r):  # stored (in, out): a pure move back to (out, in)
            out[r] = out[r].T.contiguous()
    return out
