"""FFNs found in a checkpoint: ``FFNRef`` names one, ``FFN`` says where its tensors are.

Canonical weights are ``gate, up`` (I, H) and ``down`` (H, I) in PyTorch (out, in) orientation, plus
optional biases ``gate_bias``, ``up_bias`` (I,) and ``down_bias`` (H,).
"""

from __future__ import annotations

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
LEGACY_ACTIVATION = {("gemma", "gelu"): "gelu_pytorch_tanh"}
# model_type -> the activation its modeling code hard-codes where its config has no hidden_act (checked
# against transformers 5.24's modules).
HARD_CODED_ACTIVATION = {"lfm2": "silu", "lfm3": "silu", "xlstm": "silu", "cpmant": "gelu"}


@dataclass(frozen=True)
class Activation:
    """The FFN's gate activation as the config states it (or assumed when there is no config)."""

    config_name: str
    unit: str  # "SwiGLU" / "GeGLU"
    kernel: str  # "silu" / "gelu" / "gelu_tanh": what kernels.ffn(activation=...) takes
    assumed: bool = False

    def describe(self) -> str:
        note = " (assumed: no hidden_act in config)" if self.assumed else ""
        return f"{self.unit} ({self.config_name}){note}"


def activation_from_config(config: dict | None) -> Activation:
    """Read ``hidden_act`` (or ``hidden_activation``) from a config.

    Unknown activations are reported under their own name with unit "unknown" so nothing mislabels them.
    """
    name = None
    if config:
        name = config.get("hidden_activation") or config.get("hidden_act") or \
            HARD_CODED_ACTIVATION.get(config.get("model_type"))
        name = LEGACY_ACTIVATION.get((config.get("model_type"), name), name)
    if not name:
        return Activation(ASSUMED_ACTIVATION, *ACTIVATIONS[ASSUMED_ACTIVATION], assumed=True)
    unit, kernel = ACTIVATIONS.get(name, ("unknown", name))
    return Activation(name, unit, kernel)


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

    Fused tensors are split with the FFN's layout; stacked experts are indexed; both are exact.
    """
    def get(role: str) -> "torch.Tensor":
        t = ckpt[ffn.names[role]]
        return t[ffn.index] if ffn.index is not None else t

    out = {"down": get("down")}
    if "gate_up" in ffn.names:
        out["gate"], out["up"] = split(get("gate_up"), ffn.layout, name=ffn.names["gate_up"])
        if "gate_up_bias" in ffn.names:
            out["gate_bias"], out["up_bias"] = split(get("gate_up_bias"), ffn.layout, is_bias=True,
                                                     name=ffn.names["gate_up_bias"])
    else:
        out["gate"], out["up"] = get("gate"), get("up")
        for r in ("gate", "up"):
            if f"{r}_bias" in ffn.names:
                out[f"{r}_bias"] = get(f"{r}_bias")
    if "down_bias" in ffn.names:
        out["down_bias"] = get("down_bias")
    if ffn.form.transposed:  # stored (in, out): a pure move back to (out, in)
        for r in ("gate", "up", "down"):
            out[r] = out[r].T.contiguous()
    return out
