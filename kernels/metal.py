"""Metal backend: `mx.fast.metal_kernel` gated activations for Apple silicon, MLX matmuls for the FFN.

One thread per output element on a (columns, rows) grid; loads are converted to float, the math is float
(`metal::precise` exp/tanh, an erf with <= 1 ulp error written out below since Metal has none), and the
output type is the template parameter `T` (float, half or bfloat); ACT (0 silu, 1 gelu, 2 gelu_tanh, 3 relu2),
SINGLE_ROUNDING and GATE_FIRST are int template parameters. The GLU's numbers (kernels._surface.GLU) are a
float input `glu` = {alpha, limit, up_offset}, with the identities of each step where the GLU has none: alpha 1
(silu's `-(1 * x)` is exactly `-x`), limit +inf (the NaN-keeping comparisons then change nothing) and up_offset
-0.0 (`u + -0.0` is `u` for every u, -0.0 included). Outputs are initialised to NaN (`init_value`), so an
element the kernel fails to write can never pass verification.

Numerics (default): act in float rounded to `T`, then the product in float rounded to `T` (eager
`F.silu(g) * u`); template `SINGLE_ROUNDING=1` rounds once. The kernel bodies are module constants so
tests/test_kernels_metal_source.py can compile them as C++ on machines without Metal.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Mapping, Protocol, cast

import torch

from ffn_tools.kernels._mlx_io import mlx_dtype, to_mlx, to_torch
from ffn_tools.kernels._surface import GLU, check_activation, check_ffn, check_fused, check_order, check_out, check_pair, emit, one_line

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = [
    "HEADER",
    "glu_numbers",
    "SILU_MUL_SOURCE",
    "FUSED_HALVES_SOURCE",
    "FUSED_INTERLEAVED_SOURCE",
    "available",
    "why_unavailable",
    "silu_mul",
    "silu_mul_fused",
    "ffn",
]
EXTRA = "mlx"  # the ffn-tools extra that installs this backend's framework (None: torch alone)

HEADER = r"""
// ffn-tools: float math shared by every gated-activation variant. ACT: 0 silu, 1 gelu (erf), 2 gelu_tanh, 3 relu2.
// erf: Norbert Juffa's faithfully rounded erff (max error ~1 ulp), as also used by MLX.
inline float ffn_erf(float a) {
  float t = metal::abs(a);
  float s = a * a;
  float r;
  if (t > 0.927734375f) {
    float u;
    r = metal::fma(-1.72853470e-5f, t, 3.83197126e-4f);
    u = metal::fma(-3.88396438e-3f, t, 2.42546219e-2f);
    r = metal::fma(r, s, u);
    r = metal::fma(r, t, -1.06777877e-1f);
    r = metal::fma(r, t, -6.34846687e-1f);
    r = metal::fma(r, t, -1.28717512e-1f);
    r = metal::fma(r, t, -t);
    r = 1.0f - metal::precise::exp(r);
    r = metal::copysign(r, a);
  } else {
    r = -5.96761703e-4f;
    r = metal::fma(r, s, 4.99119423e-3f);
    r = metal::fma(r, s, -2.67681349e-2f);
    r = metal::fma(r, s, 1.12819925e-1f);
    r = metal::fma(r, s, -3.76125336e-1f);
    r = metal::fma(r, s, 1.28379166e-1f);
    r = metal::fma(r, a, a);
  }
  return r;
}

template <int ACT>
inline float ffn_act(float x, float alpha) {
  if (ACT == 0) {
    return x / (1.0f + metal::precise::exp(-(alpha * x)));
  } else if (ACT == 1) {
    return x * 0.5f * (1.0f + ffn_erf(x * 0.70710676908493042f));
  } else if (ACT == 3) {
    float r = x > 0.0f ? x : 0.0f;
    return r * r;
  } else {
    float inner = 0.79788458347320557f * metal::fma(0.044714998453855515f, x * x * x, x);
    return 0.5f * x * (1.0f + metal::precise::tanh(inner));
  }
}

// act(min(g, limit)) * (clamp(u, -limit, limit) + up_offset) rounded to T: twice (act to T, then the product)
// unless SINGLE_ROUNDING; the body passes its `glu` input {alpha, limit, up_offset}. Comparisons, not
// metal::min/max, clamp: NaN stays NaN (as torch.clamp).
template <typename T, int ACT, int SINGLE_ROUNDING>
inline T ffn_glu(float g, float u, float alpha, float limit, float up_offset) {
  g = g > limit ? limit : g;
  u = u > limit ? limit : (u < -limit ? -limit : u);
  u = u + up_offset;
  float h = ffn_act<ACT>(g, alpha);
  if (!SINGLE_ROUNDING) {
    h = static_cast<float>(static_cast<T>(h));
  }
  return static_cast<T>(h * u);
}
"""

SILU_MUL_SOURCE = r"""
  // inputs gate, up: (rows, n); output out: (rows, n). grid = (n, rows, 1).
  uint col = thread_position_in_grid.x;
  uint row = thread_position_in_grid.y;
  uint n_rows = uint(gate_shape[0]);
  uint n = uint(gate_shape[1]);
  if (col >= n || row >= n_rows) {
    return;
  }
  size_t i = size_t(row) * n + col;
  out[i] = ffn_glu<T, ACT, SINGLE_ROUNDING>(static_cast<float>(gate[i]), static_cast<float>(up[i]), glu[0], glu[1], glu[2]);
"""

FUSED_HALVES_SOURCE = r"""
  // input gate_up: (rows, 2n) = [gate | up] (GATE_FIRST) or [up | gate]; output out: (rows, n).
  uint col = thread_position_in_grid.x;
  uint row = thread_position_in_grid.y;
  uint n_rows = uint(gate_up_shape[0]);
  uint n = uint(gate_up_shape[1]) / 2;
  if (col >= n || row >= n_rows) {
    return;
  }
  size_t base = size_t(row) * (2 * size_t(n));
  size_t gi = base + (GATE_FIRST ? col : n + col);
  size_t ui = base + (GATE_FIRST ? n + col : col);
  out[size_t(row) * n + col] =
      ffn_glu<T, ACT, SINGLE_ROUNDING>(static_cast<float>(gate_up[gi]), static_cast<float>(gate_up[ui]), glu[0],
                                       glu[1], glu[2]);
"""

FUSED_INTERLEAVED_SOURCE = r"""
  // input gate_up: (rows, 2n) = g0 u0 g1 u1 ... (GATE_FIRST) or u0 g0 u1 g1 ...; output out: (rows, n).
  uint col = thread_position_in_grid.x;
  uint row = thread_position_in_grid.y;
  uint n_rows = uint(gate_up_shape[0]);
  uint n = uint(gate_up_shape[1]) / 2;
  if (col >= n || row >= n_rows) {
    return;
  }
  size_t pair = size_t(row) * (2 * size_t(n)) + 2 * size_t(col);
  size_t gi = pair + (GATE_FIRST ? 0 : 1);
  size_t ui = pair + (GATE_FIRST ? 1 : 0);
  out[size_t(row) * n + col] =
      ffn_glu<T, ACT, SINGLE_ROUNDING>(static_cast<float>(gate_up[gi]), static_cast<float>(gate_up[ui]), glu[0],
                                       glu[1], glu[2]);
"""

_SOURCES = {
    "silu_mul": (("gate", "up", "glu"), SILU_MUL_SOURCE),
    "fused_halves": (("gate_up", "glu"), FUSED_HALVES_SOURCE),
    "fused_interleaved": (("gate_up", "glu"), FUSED_INTERLEAVED_SOURCE),
}
_ACT_CODE = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu2": 3}
_THREADGROUP = 256


class _MetalKernel(Protocol):
    """What ``mx.fast.metal_kernel`` returns (mlx's stub says ``object``): called with keywords, gives the outputs."""

    def __call__(self, **kwargs: Any) -> list[mx.array]: ...


@functools.lru_cache(maxsize=None)
def why_unavailable() -> str:
    """"" when a Metal kernel runs here, otherwise a one-line reason (found by actually running one)."""
    try:
        import mlx.core as mx
    except ImportError as exc:
        return (f"mlx is not installed ({one_line(exc)}); Metal kernels need ffn-tools' {EXTRA} extra on Apple "
                "silicon")
    try:
        probe = cast(_MetalKernel, mx.fast.metal_kernel(
            name="ffn_tools_probe",
            input_names=["a"],
            output_names=["b"],
            source="b[thread_position_in_grid.x] = a[thread_position_in_grid.x] + 1;",
        ))
        (res,) = probe(
            inputs=[mx.array([1.0])],
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
        )
        mx.eval(res)
    except Exception as exc:
        prefix = "" if mx.metal.is_available() else "Metal needs Apple silicon: "
        return f"{prefix}mx.fast.metal_kernel raised {' '.join(str(exc).split())!r}"
    return ""


def available() -> bool:
    """True on Apple silicon with a working MLX Metal back-end."""
    return why_unavailable() == ""


@functools.lru_cache(maxsize=None)
def _kernel(variant: str) -> _MetalKernel:
    import mlx.core as mx

    inputs, source = _SOURCES[variant]
    return cast(_MetalKernel, mx.fast.metal_kernel(
        name=f"ffn_tools_{variant}", input_names=list(inputs), output_names=["out"], source=source, header=HEADER
    ))


def _require() -> None:
    why = why_unavailable()
    if why:
        raise RuntimeError(f"The Metal backend is unavailable: {why}")


def glu_numbers(glu: GLU) -> list[float]:
    """The kernels' float input `glu`: {alpha, limit, up_offset}, each step's identity where the GLU has none."""
    return [float(glu.alpha), float("inf") if glu.limit is None else float(glu.limit), float(glu.up_offset) or -0.0]


def _run(variant: str, arrays: list, n_rows: int, n: int, dtype: torch.dtype, glu: GLU, single, **tmpl):
    """Launch one variant over the (n, n_rows) grid and return the (n_rows, n) mlx output."""
    import mlx.core as mx

    mdt = mlx_dtype(dtype)
    # Flags are int template parameters (0/1): MLX prints template values as integers.
    template = [("T", mdt), ("ACT", _ACT_CODE[glu.function]), ("SINGLE_ROUNDING", int(bool(single)))]
    template += [(k, int(v)) for k, v in tmpl.items()]
    (res,) = _kernel(variant)(
        inputs=[*arrays, mx.array(glu_numbers(glu), dtype=mx.float32)],
        template=template,
        grid=(n, n_rows, 1),
        threadgroup=(min(_THREADGROUP, n), 1, 1),
        output_shapes=[(n_rows, n)],
        output_dtypes=[mdt],
        init_value=float("nan"),
    )
    return res


def _empty_or(shape, dtype, device, fn):
    if 0 in shape:
        return torch.empty(shape, dtype=dtype, device=device)
    return fn()


def silu_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act(gate) * up` with a Metal kernel (float math, output type `T`).

    Default rounding: act in float rounded to the dtype, then the product in float rounded again (eager
    `F.silu(g) * u`); `single_rounding=True` rounds once.

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
    n = gate.shape[-1]

    def run():
        g2, u2 = to_mlx(gate).reshape(-1, n), to_mlx(up).reshape(-1, n)
        res = _run("silu_mul", [g2, u2], g2.shape[0], n, gate.dtype, glu, single_rounding)
        return to_torch(res, gate.device).view(gate.shape)

    return emit(_empty_or(tuple(gate.shape), gate.dtype, gate.device, run), out)


def silu_mul_fused(
    gate_up: torch.Tensor,
    *,
    order: str = "gate-up",
    interleaved: bool = False,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act(gate) * up` read straight from a fused (..., 2I) activation by a Metal kernel.

    Args:
        gate_up: (..., 2I): halves `[gate | up]` / `[up | gate]`, or interleaved pairs with `interleaved=True`.
        order: "gate-up" or "up-gate" (template `GATE_FIRST`).
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
    shape = (*gate_up.shape[:-1], n)
    check_out(out, shape, gate_up.dtype, gate_up.device)
    _require()
    variant = "fused_interleaved" if interleaved else "fused_halves"

    def run():
        x2 = to_mlx(gate_up).reshape(-1, 2 * n)
        res = _run(variant, [x2], x2.shape[0], n, gate_up.dtype, glu, single_rounding, GATE_FIRST=gate_first)
        return to_torch(res, gate_up.device).view(shape)

    return emit(_empty_or(shape, gate_up.dtype, gate_up.device, run), out)


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
    """`down(act(gate(x)) * up(x))`: MLX matmuls on the GPU, the Metal activation kernel between them.

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
    b = check_ffn(x, gate_w, up_w, down_w, biases, activation)
    _require()
    b = {k: to_mlx(v) for k, v in b.items()}
    hidden, inter = down_w.shape
    x2 = to_mlx(x).reshape(-1, hidden)

    def linear(a, w, bias):
        y = a @ to_mlx(w).T
        return y if bias is None else y + bias

    g = linear(x2, gate_w, b.get("gate"))
    u = linear(x2, up_w, b.get("up"))
    rows = x2.shape[0]
    glu = check_activation(activation)
    h = _run("silu_mul", [g, u], rows, inter, x.dtype, glu, single_rounding) if rows and inter else g * 0
    return to_torch(linear(h, down_w, b.get("down")), x.device).view(*x.shape[:-1], hidden)
