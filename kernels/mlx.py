"""MLX backend: an `mx.compile`d fused activation and MLX matmuls (MLX's CPU or GPU device, whichever is default).

Numerics (default): the activation is computed in float32 and rounded to the input dtype, then multiplied by
`up` in float32 and rounded again, as eager `F.silu(g) * u`. MLX's own float32 exp/erf/tanh are used, so
results can differ from PyTorch's by a few float32 ulp before rounding (bounds in tests/test_kernels.py).
`single_rounding=True`: `act(g) * u` in float32, one rounding at the end. Tensors cross to and from MLX
exactly (bfloat16 as raw bits).
"""

from __future__ import annotations

import functools
import sys
from typing import Mapping

import torch

from ffn_tools.kernels._mlx_io import to_mlx, to_torch
from ffn_tools.kernels._surface import (
    GELU_SQRT1_2,
    GELU_TANH_BETA,
    GELU_TANH_KAPPA,
    GLU,
    check_activation,
    check_ffn,
    check_fused,
    check_order,
    check_out,
    check_pair,
    emit,
    one_line,
)

__all__ = ["available", "why_unavailable", "silu_mul", "silu_mul_fused", "ffn"]
# the ffn-tools extra that installs this backend's framework (None: torch alone)
EXTRA = "mlx" if sys.platform == "darwin" else "mlx-cpu"



@functools.lru_cache(maxsize=None)
def why_unavailable() -> str:
    """"" when mlx imports and can evaluate an array, otherwise a one-line reason."""
    try:
        import mlx.core as mx
    except ImportError as exc:
        return f"mlx is not installed ({one_line(exc)}); it comes with ffn-tools' {EXTRA} extra"
    try:
        mx.eval(mx.array([1.0]) + 1)
    except Exception as exc:
        return f"mlx cannot evaluate arrays on {mx.default_device()}: {one_line(exc)}"
    return ""


def available() -> bool:
    """True when mlx is installed and works on its default device."""
    return why_unavailable() == ""


def _act32(x, function: str, alpha: float):
    import mlx.core as mx

    if function == "silu":
        return x / (1.0 + mx.exp(-(x * alpha)))
    if function == "gelu":
        return x * 0.5 * (1.0 + mx.erf(x * GELU_SQRT1_2))
    if function == "relu2":
        r = mx.maximum(x, 0.0)
        return r * r
    return 0.5 * x * (1.0 + mx.tanh(GELU_TANH_BETA * (x + GELU_TANH_KAPPA * (x * x * x))))


def _glu(g, u, glu: GLU, single_rounding: bool):
    import mlx.core as mx

    dtype = g.dtype
    g, u = g.astype(mx.float32), u.astype(mx.float32)
    if glu.limit is not None:  # where, not mx.minimum/mx.clip: NaN stays NaN (as torch.clamp)
        g = mx.where(g > glu.limit, glu.limit, g)
        u = mx.where(u > glu.limit, glu.limit, mx.where(u < -glu.limit, -glu.limit, u))
    if glu.up_offset:
        u = u + glu.up_offset
    h = _act32(g, glu.function, glu.alpha)
    if not single_rounding:
        h = h.astype(dtype).astype(mx.float32)  # eager's first rounding
    return (h * u).astype(dtype)


@functools.lru_cache(maxsize=None)
def _compiled_pair(glu: GLU, single_rounding: bool):
    import mlx.core as mx

    return mx.compile(lambda g, u: _glu(g, u, glu, single_rounding))


@functools.lru_cache(maxsize=None)
def _compiled_fused(glu: GLU, single_rounding: bool, gate_first: bool, interleaved: bool):
    import mlx.core as mx

    def fn(gate_up):
        n = gate_up.shape[-1] // 2
        if interleaved:
            first, second = gate_up[..., 0::2], gate_up[..., 1::2]
        else:
            first, second = gate_up[..., :n], gate_up[..., n:]
        g, u = (first, second) if gate_first else (second, first)
        return _glu(g, u, glu, single_rounding)

    return mx.compile(fn)


def _require() -> None:
    why = why_unavailable()
    if why:
        raise RuntimeError(f"The MLX backend is unavailable: {why}")


def silu_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act(gate) * up` with a compiled MLX function.

    Default rounding: act in float32 rounded to the dtype, then the product in float32 rounded again
    (eager `F.silu(g) * u`); `single_rounding=True` rounds once.

    Args:
        gate: (..., I) float32/float16/bfloat16.
        up: (..., I), same shape and dtype.
        activation: "silu", "gelu", "gelu_tanh", "relu2" or a GLU (clamp limit, alpha, up offset).
        single_rounding: round once instead of twice.
        out: optional contiguous (..., I) buffer of the input dtype (the result is copied into it).

    Returns:
        (..., I) tensor of the input dtype on the input's device.
    """
    check_pair(gate, up)
    glu = check_activation(activation)
    check_out(out, tuple(gate.shape), gate.dtype, gate.device)
    _require()
    res = _compiled_pair(glu, bool(single_rounding))(to_mlx(gate), to_mlx(up))
    return emit(to_torch(res, gate.device), out)


def silu_mul_fused(
    gate_up: torch.Tensor,
    *,
    order: str = "gate-up",
    interleaved: bool = False,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act(gate) * up` from a fused (..., 2I) activation; the split happens inside the compiled function.

    Args:
        gate_up: (..., 2I): halves `[gate | up]` / `[up | gate]`, or interleaved pairs with `interleaved=True`.
        order: "gate-up" or "up-gate".
        interleaved: adjacent-column pairs instead of halves.
        activation: "silu", "gelu", "gelu_tanh", "relu2" or a GLU (clamp limit, alpha, up offset).
        single_rounding: round once instead of twice.
        out: optional contiguous (..., I) buffer.

    Returns:
        (..., I) tensor of the input dtype.
    """
    gate_first = check_order(order)
    n = check_fused(gate_up)
    glu = check_activation(activation)
    check_out(out, (*gate_up.shape[:-1], n), gate_up.dtype, gate_up.device)
    _require()
    fn = _compiled_fused(glu, bool(single_rounding), gate_first, bool(interleaved))
    return emit(to_torch(fn(to_mlx(gate_up)), gate_up.device), out)


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
    """`down(act(gate(x)) * up(x))`: MLX matmuls in the input dtype around the compiled activation.

    Args:
        x: (..., H).
        gate_w, up_w: (I, H), PyTorch (out, in).
        down_w: (H, I).
        biases: optional dict with any of "gate" (I,), "up" (I,), "down" (H,).
        activation: "silu", "gelu", "gelu_tanh", "relu2" or a GLU (clamp limit, alpha, up offset).
        single_rounding: see `silu_mul`.

    Returns:
        (..., H) tensor of the input dtype.
    """
    b = {k: to_mlx(v) for k, v in check_ffn(x, gate_w, up_w, down_w, biases, activation).items()}
    _require()
    xm = to_mlx(x)

    def linear(a, w, bias):
        y = a @ to_mlx(w).T
        return y if bias is None else y + bias

    g = linear(xm, gate_w, b.get("gate"))
    u = linear(xm, up_w, b.get("up"))
    h = _compiled_pair(check_activation(activation), bool(single_rounding))(g, u)
    return to_torch(linear(h, down_w, b.get("down")), x.device)
