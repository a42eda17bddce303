"""JAX backend: a `jax.jit` FFN (XLA fuses the activation into one loop) and jit'd activations.

Numerics (default): the activation is computed in float32 and rounded to the input dtype, then multiplied
by `up` in float32 and rounded again, as eager `F.silu(g) * u` (explicit converts, which XLA keeps). XLA's
float32 exp/erf/tanh differ from PyTorch's by a few ulp (bounds in tests/test_kernels.py). Matmuls
accumulate in float32 at HIGHEST precision and round once to the input dtype. `single_rounding=True`:
`act(g) * u` in float32, one rounding. Tensors cross via numpy exactly (bfloat16 as ml_dtypes.bfloat16).
"""

from __future__ import annotations

import functools
from typing import Mapping

import numpy as np
import torch

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
EXTRA = "flax"  # the ffn-tools extra that installs this backend's framework (None: torch alone)


@functools.lru_cache(maxsize=None)
def why_unavailable() -> str:
    """"" when jax and ml_dtypes import and jax can run a jit'd function, otherwise a one-line reason."""
    try:
        import jax
        import jax.numpy as jnp
        import ml_dtypes  # noqa: F401  (bfloat16 for numpy)
    except ImportError as exc:
        return f"jax is not installed ({one_line(exc)}); it comes with ffn-tools' {EXTRA} extra"
    try:
        jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(1)))
    except Exception as exc:
        return f"jax cannot run a jit'd function: {one_line(exc)}"
    return ""


def available() -> bool:
    """True when jax (with ml_dtypes) is installed and works."""
    return why_unavailable() == ""


def _to_jax(t: torch.Tensor):
    """``t`` as a JAX array: its memory shared through DLPack where JAX takes it (a CPU tensor: a weight is
    not copied, which for a large FFN is its size again; JAX does not write to its inputs and the tensor
    outlives the call), else a copy."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    t = t.detach().cpu().contiguous()
    try:
        return jax.dlpack.from_dlpack(t)
    except Exception:  # noqa: BLE001 - a dtype or alignment DLPack does not carry: copy instead
        pass
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    return jnp.asarray(t.numpy())


def _to_torch(a, device: torch.device) -> torch.Tensor:
    import ml_dtypes

    arr = np.array(a)  # a writable host copy
    if arr.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(arr).to(device)


@functools.lru_cache(maxsize=None)
def _fns():
    """Build the jit'd functions once (jax is imported only here)."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32

    def act32(x, function, alpha):
        if function == "silu":
            return x / (1.0 + jnp.exp(-(x * alpha)))
        if function == "gelu":
            return x * 0.5 * (1.0 + jax.lax.erf(x * GELU_SQRT1_2))
        if function == "relu2":
            r = jnp.maximum(x, 0.0)
            return r * r
        return 0.5 * x * (1.0 + jnp.tanh(GELU_TANH_BETA * (x + GELU_TANH_KAPPA * (x * x * x))))

    def glu(g, u, activation: GLU, single_rounding):
        dtype = g.dtype
        g, u = g.astype(f32), u.astype(f32)
        if activation.limit is not None:  # where, not jnp.minimum/clip: NaN stays NaN (as torch.clamp)
            lim = activation.limit
            g = jnp.where(g > lim, f32(lim), g)
            u = jnp.where(u > lim, f32(lim), jnp.where(u < -lim, f32(-lim), u))
        if activation.up_offset:
            u = u + f32(activation.up_offset)
        h = act32(g, activation.function, f32(activation.alpha))
        if not single_rounding:
            h = h.astype(dtype).astype(f32)  # eager's first rounding
        return (h * u).astype(dtype)

    def fused(gate_up, activation, single_rounding, gate_first, interleaved):
        n = gate_up.shape[-1] // 2
        if interleaved:
            first, second = gate_up[..., 0::2], gate_up[..., 1::2]
        else:
            first, second = gate_up[..., :n], gate_up[..., n:]
        g, u = (first, second) if gate_first else (second, first)
        return glu(g, u, activation, single_rounding)

    def linear(a, w, b):
        y = jnp.matmul(a, w.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
        if b is not None:
            y = y + b.astype(f32)
        return y.astype(a.dtype)

    def ffn(x, gate_w, up_w, down_w, biases, activation, single_rounding):
        g = linear(x, gate_w, biases.get("gate"))
        u = linear(x, up_w, biases.get("up"))
        return linear(glu(g, u, activation, single_rounding), down_w, biases.get("down"))

    return (
        jax.jit(glu, static_argnames=("activation", "single_rounding")),
        jax.jit(fused, static_argnames=("activation", "single_rounding", "gate_first", "interleaved")),
        jax.jit(ffn, static_argnames=("activation", "single_rounding")),
    )


def _require() -> None:
    why = why_unavailable()
    if why:
        raise RuntimeError(f"The JAX backend is unavailable: {why}")


def silu_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act(gate) * up` with a jit'd JAX function.

    Default rounding: act in float32 rounded to the dtype, then the product in float32 rounded again
    (eager `F.silu(g) * u`); `single_rounding=True` rounds once.

    Args:
        gate: (..., I) float32/float16/bfloat16.
        up: (..., I), same shape and dtype.
        activation: "silu", "gelu", "gelu_tanh", "relu2" or a GLU (clamp limit, alpha, up offset).
        single_rounding: round once instead of twice.
        out: optional contiguous (..., I) buffer (the result is copied into it).

    Returns:
        (..., I) tensor of the input dtype on the input's device.
    """
    check_pair(gate, up)
    glu = check_activation(activation)
    check_out(out, tuple(gate.shape), gate.dtype, gate.device)
    _require()
    res = _fns()[0](_to_jax(gate), _to_jax(up), activation=glu, single_rounding=bool(single_rounding))
    return emit(_to_torch(res, gate.device), out)


def silu_mul_fused(
    gate_up: torch.Tensor,
    *,
    order: str = "gate-up",
    interleaved: bool = False,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act(gate) * up` from a fused (..., 2I) activation; the split is part of the jit'd function.

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
    res = _fns()[1](
        _to_jax(gate_up),
        activation=glu,
        single_rounding=bool(single_rounding),
        gate_first=gate_first,
        interleaved=bool(interleaved),
    )
    return emit(_to_torch(res, gate_up.device), out)


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
    """`down(act(gate(x)) * up(x))` as one jit'd function.

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
    b = {k: _to_jax(v) for k, v in check_ffn(x, gate_w, up_w, down_w, biases, activation).items()}
    _require()
    res = _fns()[2](
        _to_jax(x),
        _to_jax(gate_w),
        _to_jax(up_w),
        _to_jax(down_w),
        b,
        activation=check_activation(activation),
        single_rounding=bool(single_rounding),
    )
    return _to_torch(res, x.device)
