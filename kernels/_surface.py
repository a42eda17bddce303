"""The contract every backend module shares: names, argument checks and the `out=` convention.

Nothing here imports a heavy framework; each backend imports it lazily.
"""

from __future__ import annotations

import math
import struct
from typing import Mapping, NamedTuple

import torch

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu2")
"""Activations of the gated FFN: silu (SwiGLU), exact erf gelu and tanh-approximated gelu (GeGLU), and
squared ReLU (BitNet's gated `relu(x)**2`)."""


class GLU(NamedTuple):
    """A gated unit's function as data: `act(min(g, limit)) * (clamp(u, -limit, limit) + up_offset)`.

    `activation=` of every kernel takes a GLU, or one of ACTIVATIONS for `GLU(name)` (plain `act(g) * u`).

    Attributes:
        function: one of ACTIVATIONS.
        alpha: silu's sigmoid slope, `silu_alpha(g) = g * sigmoid(alpha * g)`; 1 is plain silu (GPT-OSS: 1.702).
            Only silu takes another value.
        limit: None (no clamp), or the clamp limit: the gate is clamped from above only, `up` on both sides.
            The clamps keep NaN a NaN (as torch.clamp does; `min`/`fmin` would turn it into the limit).
        up_offset: added to the clamped `up` before the product (GPT-OSS: 1, its `(up + 1) * glu`).

    Backends clamp and add in float32 (the clamps are exact; `up + up_offset` is one float32 rounding and is
    not rounded to the dtype), then round `act` and the product as they do for a plain activation.
    """

    function: str = "silu"
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0


ORDERS = ("gate-up", "up-gate")
"""Which half of a fused gate_up activation comes first (or which comes first in each interleaved pair)."""

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Activation and weight dtypes every backend accepts."""

BIAS_KEYS = ("gate", "up", "down")


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# PyTorch's gelu constants as its kernels use them (computed in double from <cmath>'s M_SQRT1_2, M_SQRT2,
# M_2_SQRTPI, then rounded to float32, the opmath type): every float32 backend uses exactly these values.
GELU_SQRT1_2 = _f32(0.70710678118654752440)
GELU_TANH_BETA = _f32(1.41421356237309504880 * 1.12837916709551257390 * 0.5)
GELU_TANH_KAPPA = _f32(0.044715)


def one_line(exc: BaseException) -> str:
    """`Type: message` on one line, for why_unavailable() reasons."""
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())


def check_activation(activation: str | GLU) -> GLU:
    """Validate an activation name or GLU and return it as a GLU."""
    glu = activation if isinstance(activation, GLU) else GLU(activation)
    if not isinstance(glu.function, str) or glu.function not in ACTIVATIONS:
        raise ValueError(f"Unknown activation {glu.function!r}; expected one of {', '.join(ACTIVATIONS)} "
                         f"(or a GLU of one of them).")
    numbers = {"alpha": glu.alpha, "up_offset": glu.up_offset, **({} if glu.limit is None else {"limit": glu.limit})}
    for name, v in numbers.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"GLU {name} must be a finite number, got {v!r}.")
    if glu.alpha <= 0 or (glu.alpha != 1 and glu.function != "silu"):
        raise ValueError(f"GLU alpha {glu.alpha!r} is not allowed for {glu.function}: alpha is silu's sigmoid "
                         f"slope (> 0); every other activation takes 1.")
    if glu.limit is not None and glu.limit < 0:
        raise ValueError(f"GLU limit {glu.limit!r} must be >= 0 (the gate is clamped to <= limit, up to +-limit).")
    return glu


def check_order(order: str) -> bool:
    """Validate a halves order and return True when the gate comes first."""
    if order not in ORDERS:
        raise ValueError(f"Unknown gate/up order {order!r}; expected one of {', '.join(ORDERS)}.")
    return order == "gate-up"


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"`{name}` has dtype {t.dtype}; supported dtypes are {supported}.")


def check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Validate separate gate and up activations: same shape, dtype and device, at least 1-D."""
    _check_float("gate", gate)
    _check_float("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"`gate` {tuple(gate.shape)} and `up` {tuple(up.shape)} must have the same shape.")
    if gate.dtype != up.dtype:
        raise TypeError(f"`gate` is {gate.dtype} but `up` is {up.dtype}; cast one of them.")
    if gate.device != up.device:
        raise ValueError(f"`gate` is on {gate.device} but `up` is on {up.device}.")
    if gate.dim() == 0:
        raise ValueError("`gate` and `up` must be at least 1-D (..., I), got scalars.")


def check_fused(gate_up: torch.Tensor) -> int:
    """Validate a fused (..., 2I) activation and return I."""
    _check_float("gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"`gate_up` must have an even last dimension (..., 2I), got shape {tuple(gate_up.shape)}."
        )
    return gate_up.shape[-1] // 2


def fused_views(gate_up: torch.Tensor, order: str, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided (gate, up) views of a fused (..., 2I) activation, no copy."""
    gate_first = check_order(order)
    n = check_fused(gate_up)
    if interleaved:
        first, second = gate_up[..., 0::2], gate_up[..., 1::2]
    else:
        first, second = gate_up[..., :n], gate_up[..., n:]
    return (first, second) if gate_first else (second, first)


def check_ffn(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    up_w: torch.Tensor,
    down_w: torch.Tensor,
    biases: Mapping[str, torch.Tensor] | None,
    activation: str | GLU,
) -> dict[str, torch.Tensor]:
    """Validate FFN operands (PyTorch (out, in) weights) and return the biases as a plain dict."""
    check_activation(activation)
    for name, t in (("x", x), ("gate_w", gate_w), ("up_w", up_w), ("down_w", down_w)):
        _check_float(name, t)
        if t.dtype != x.dtype:
            raise TypeError(f"`{name}` is {t.dtype} but `x` is {x.dtype}; all operands must share one dtype.")
        if t.device != x.device:
            raise ValueError(f"`{name}` is on {t.device} but `x` is on {x.device}.")
    if x.dim() < 1 or gate_w.dim() != 2 or up_w.dim() != 2 or down_w.dim() != 2:
        raise ValueError(
            f"Expected x (..., H), gate_w (I, H), up_w (I, H), down_w (H, I); got x {tuple(x.shape)}, "
            f"gate_w {tuple(gate_w.shape)}, up_w {tuple(up_w.shape)}, down_w {tuple(down_w.shape)}."
        )
    inter, hidden = gate_w.shape
    if up_w.shape != (inter, hidden) or down_w.shape != (hidden, inter) or x.shape[-1] != hidden:
        raise ValueError(
            f"FFN shapes do not agree: x {tuple(x.shape)}, gate_w {tuple(gate_w.shape)}, "
            f"up_w {tuple(up_w.shape)}, down_w {tuple(down_w.shape)}; expected x (..., H), gate_w and up_w "
            f"(I, H), down_w (H, I) in PyTorch (out, in) orientation (transpose Flax/JAX kernels first)."
        )
    out = dict(biases or {})
    unknown = sorted(set(out) - set(BIAS_KEYS))
    if unknown:
        raise ValueError(f"Unknown bias keys {unknown}; expected a subset of {list(BIAS_KEYS)}.")
    sizes = {"gate": inter, "up": inter, "down": hidden}
    for key, b in out.items():
        _check_float(f"biases[{key!r}]", b)
        if b.shape != (sizes[key],) or b.dtype != x.dtype or b.device != x.device:
            raise ValueError(
                f"`biases[{key!r}]` is {tuple(b.shape)} {b.dtype} on {b.device}; expected ({sizes[key]},) "
                f"{x.dtype} on {x.device}."
            )
    return out


def check_out(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """Validate a caller-provided output buffer (must match exactly and be contiguous)."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"`out` must be a torch.Tensor, got {type(out).__name__}.")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"`out` is {tuple(out.shape)} {out.dtype} on {out.device}; expected {tuple(shape)} {dtype} on {device}."
        )
    if not out.is_contiguous():
        raise ValueError("`out` must be contiguous; pass a fresh buffer from torch.empty(...).")


def emit(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Return `result`, or copy it into `out` (already checked) and return `out`."""
    if out is None:
        return result
    out.copy_(result)
    return out
