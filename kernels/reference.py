"""Float64 reference: the ground truth every other backend is compared against.

Inputs of any supported dtype are converted exactly to float64 and the FFN is evaluated in float64 with no
intermediate rounding; results are float64. `single_rounding` is accepted for surface parity and changes
nothing here (there is no rounding to choose).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from ffn_tools.kernels._surface import GLU, check_activation, check_ffn, check_out, check_pair, emit, fused_views

__all__ = ["available", "why_unavailable", "silu_mul", "silu_mul_fused", "ffn", "ffn_lora"]
EXTRA = None  # the ffn-tools extra that installs this backend's framework (None: torch alone)


def available() -> bool:
    """Always True: the reference needs only torch."""
    return True


def why_unavailable() -> str:
    """Always "": the reference is always available."""
    return ""


def _act(x: torch.Tensor, function: str, alpha: float) -> torch.Tensor:
    if function == "silu":
        return F.silu(x * alpha) / alpha  # x * sigmoid(alpha * x); alpha 1: exactly F.silu(x)
    if function == "gelu":
        return F.gelu(x)
    if function == "relu2":
        return F.relu(x).square()
    return F.gelu(x, approximate="tanh")


def _glu(g: torch.Tensor, u: torch.Tensor, glu: GLU) -> torch.Tensor:
    """`act(min(g, limit)) * (clamp(u, -limit, limit) + up_offset)` in float64 (torch.clamp keeps NaN)."""
    if glu.limit is not None:
        g, u = g.clamp(max=glu.limit), u.clamp(-glu.limit, glu.limit)
    if glu.up_offset:
        u = u + glu.up_offset
    return _act(g, glu.function, glu.alpha) * u


def silu_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act(gate) * up` in float64, no rounding.

    Args:
        gate: (..., I) activation input, float32/float16/bfloat16.
        up: (..., I) multiplier, same shape and dtype.
        activation: "silu", "gelu" (erf), "gelu_tanh", "relu2", or a GLU (clamp limit, alpha, up offset).
        single_rounding: ignored (float64 throughout).
        out: optional float64 (..., I) buffer to write into.

    Returns:
        float64 tensor (..., I).
    """
    check_pair(gate, up)
    glu = check_activation(activation)
    check_out(out, tuple(gate.shape), torch.float64, gate.device)
    return emit(_glu(gate.double(), up.double(), glu), out)


def silu_mul_fused(
    gate_up: torch.Tensor,
    *,
    order: str = "gate-up",
    interleaved: bool = False,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act(gate) * up` for a fused (..., 2I) activation, in float64.

    Args:
        gate_up: (..., 2I). Halves `[gate | up]` (order "gate-up") or `[up | gate]` ("up-gate"); with
            `interleaved=True`, columns alternate g0, u0, g1, u1, ... ("gate-up") or u0, g0, ... ("up-gate").
        order: "gate-up" or "up-gate".
        interleaved: pairs of adjacent columns instead of halves.
        activation: "silu", "gelu", "gelu_tanh", "relu2" or a GLU.
        single_rounding: ignored (float64 throughout).
        out: optional float64 (..., I) buffer.

    Returns:
        float64 tensor (..., I).
    """
    gate, up = fused_views(gate_up, order, interleaved)
    return silu_mul(gate, up, activation=activation, out=out)


def ffn(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    up_w: torch.Tensor,
    down_w: torch.Tensor,
    biases: Mapping[str, torch.Tensor] | None = None,
    *,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
) -> torch.Tensor:
    """`down(act(gate(x)) * up(x))` in float64.

    Args:
        x: (..., H) input.
        gate_w: (I, H) gate projection, PyTorch (out, in).
        up_w: (I, H) up projection.
        down_w: (H, I) down projection.
        biases: optional dict with any of "gate" (I,), "up" (I,), "down" (H,).
        activation: "silu", "gelu", "gelu_tanh", "relu2" or a GLU.
        single_rounding: ignored (float64 throughout).

    Returns:
        float64 tensor (..., H).

    Raises:
        ValueError / TypeError: shapes, dtypes or bias keys that do not fit together.
    """
    b = {k: v.double() for k, v in check_ffn(x, gate_w, up_w, down_w, biases, activation).items()}
    x64 = x.double()
    g = F.linear(x64, gate_w.double(), b.get("gate"))
    u = F.linear(x64, up_w.double(), b.get("up"))
    return F.linear(_glu(g, u, check_activation(activation)), down_w.double(), b.get("down"))


def ffn_lora(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    up_w: torch.Tensor,
    down_w: torch.Tensor,
    loras: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
    biases: Mapping[str, torch.Tensor] | None = None,
    *,
    activation: str | GLU = "silu",
) -> torch.Tensor:
    """`ffn` with an unmerged LoRA's low-rank path added to each projection, as runtimes run an adapter:
    `x·Wᵀ + scale·(x·Aᵀ)·Bᵀ`, in float64.

    Args:
        loras: projection ("gate", "up", "down") -> (A (r, in), B (out, r), scale); a projection without one
            runs its weight alone.

    Returns:
        float64 tensor (..., H).
    """
    b = {k: v.double() for k, v in check_ffn(x, gate_w, up_w, down_w, biases, activation).items()}

    def proj(role: str, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = F.linear(inp, w.double(), b.get(role))
        if role in loras:
            a, bb, scale = loras[role]
            y = y + F.linear(F.linear(inp, a.double()), bb.double()) * scale
        return y

    x64 = x.double()
    h = _glu(proj("gate", x64, gate_w), proj("up", x64, up_w), check_activation(activation))
    return proj("down", h, down_w)
