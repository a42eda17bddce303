"""Triton backend: a fused gated-activation kernel on CUDA, or through Triton's interpreter on the CPU.

Without a CUDA device this module sets `TRITON_INTERPRET=1` (unless already set) *before* importing
triton, so the same kernels run on CPU tensors through the interpreter. With CUDA the kernels are compiled
natively; CPU inputs are then moved to the GPU and the result is returned on the input's device.

Numerics of `silu_mul` / `silu_mul_fused` (default): inputs are loaded and cast to float32, the activation
is computed in float32 and rounded to the input dtype, then multiplied by `up` in float32 and rounded again,
exactly the two roundings of eager `F.silu(g) * u` (the product of two 16-bit floats is exact in float32,
so the second rounding is the correctly rounded product). On CUDA the float32 activation uses libdevice's
expf/erff/tanhf and IEEE division, the same functions PyTorch's CUDA kernels call, so the result is meant
to be bit-identical to eager (benchmarks/gpu_kernels.py checks it). In the interpreter, exp/erf come from
numpy; they differ from PyTorch's CPU exp by a few float32 ulp (see tests/test_kernels.py for the bounds).
`single_rounding=True` keeps `act(g) * u` in float32 and rounds once.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Mapping, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ffn_tools.kernels._surface import GLU, check_activation, check_ffn, check_fused, check_order, check_out, check_pair, one_line

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
"""True when kernels run through Triton's interpreter (decided once, at import)."""

_ACT_CODE = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu2": 3}

__all__ = [
    "INTERPRETED",
    "LaunchConfig",
    "available",
    "why_unavailable",
    "launch_config",
    "silu_mul",
    "silu_mul_fused",
    "ffn",
]
EXTRA = "cuda"  # the ffn-tools extra that installs this backend's framework (None: torch alone)


class LaunchConfig(NamedTuple):
    """Tile of one program: BLOCK_M rows x BLOCK_N output columns, and warps per program."""

    block_m: int
    block_n: int
    num_warps: int


@functools.lru_cache(maxsize=None)
def _load() -> tuple[object | None, str]:
    try:
        import triton  # noqa: F401  (the real package: this module is kernels.triton)
    except ImportError as exc:
        return None, f"triton is not installed ({one_line(exc)}); it comes with ffn-tools' {EXTRA} extra"
    if not INTERPRETED and not torch.cuda.is_available():
        return None, "no CUDA device and the Triton interpreter is off (TRITON_INTERPRET is not 1)"
    try:
        import ffn_tools.kernels._triton_kernels as _triton_kernels
    except Exception as exc:  # a broken triton install says so instead of failing a whole verify run
        return None, f"the Triton kernels failed to load: {one_line(exc)}"
    return _triton_kernels, ""


def available() -> bool:
    """True when triton imports and either CUDA is present or the interpreter is on."""
    return _load()[0] is not None


def why_unavailable() -> str:
    """"" when available, otherwise a one-line reason."""
    return _load()[1]


def _kernels():
    mod, why = _load()
    if mod is None:
        raise RuntimeError(f"The Triton backend is unavailable: {why}")
    return mod


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_config(n_rows: int, n_cols: int) -> LaunchConfig:
    """Default tiling for an (n_rows, n_cols) output.

    On CUDA: tiles of 4096 elements (8 warps, 16 per thread = two 16-byte vectors per operand for 16-bit
    dtypes) for large activations, 1024 (4 warps) for small ones so that enough programs fill the SMs.
    In the interpreter every program is a Python iteration, so tiles are as large as practical.
    """
    if INTERPRETED:
        block_n = min(_pow2(n_cols), 2048)
        return LaunchConfig(max(1, min(_pow2(n_rows), 16384 // block_n)), block_n, 1)
    tile = 4096 if n_rows * n_cols >= (1 << 22) else 1024
    block_n = min(_pow2(n_cols), 2048, tile)
    block_m = max(1, min(_pow2(n_rows), tile // block_n))
    return LaunchConfig(block_m, block_n, 8 if block_m * block_n >= 4096 else 4)


def _exec_device(t: torch.Tensor) -> torch.device:
    """Where the kernel runs: the tensor's device, or CUDA for CPU tensors when compiled for CUDA."""
    if t.is_cuda or INTERPRETED:
        return t.device
    return torch.device("cuda")


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """(rows, n_cols) view with unit column stride (copies only when no such view exists)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, n_cols)
    except RuntimeError:  # leading dims not collapsible into one stride
        return t.contiguous().view(-1, n_cols)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch(kind, args, n_rows, n_cols, glu: GLU, single_rounding, config, **extra):
    if n_rows == 0 or n_cols == 0:
        return
    kern = _kernels()
    cfg = config or launch_config(n_rows, n_cols)
    grid = (_cdiv(n_rows, cfg.block_m), _cdiv(n_cols, cfg.block_n))
    fn = kern.glu_pair_kernel if kind == "pair" else kern.glu_interleaved_kernel
    device = args[0].device
    ctx: contextlib.AbstractContextManager[Any]
    if INTERPRETED:
        # exp(-x) overflowing to inf for x < -88 is intended (x / inf = -0, as in eager); numpy would warn.
        ctx = np.errstate(over="ignore")
    elif device.type == "cuda":
        ctx = torch.cuda.device(device)  # launch on the tensors' GPU, not the current one
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        fn[grid](
            *args,
            **extra,
            ACT=_ACT_CODE[glu.function],
            ALPHA=float(glu.alpha),
            CLAMP=glu.limit is not None,
            LIMIT=float(glu.limit or 0.0),
            UP_OFFSET=float(glu.up_offset),
            SINGLE_ROUNDING=bool(single_rounding),
            NATIVE=not INTERPRETED,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
        )


def _result_buffer(shape, dtype, out: torch.Tensor | None, exec_dev: torch.device) -> torch.Tensor:
    if out is not None and out.device == exec_dev:
        return out
    return torch.empty(shape, dtype=dtype, device=exec_dev)


def _finish(res: torch.Tensor, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if out is not None:
        if res.data_ptr() != out.data_ptr():
            out.copy_(res)
        return out
    return res.to(device)


def silu_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
    out: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """`act(gate) * up` with the Triton kernel.

    Default rounding: act computed in float32 and rounded to the dtype, then the product computed in
    float32 and rounded (eager `F.silu(g) * u`). `single_rounding=True`: one rounding at the end.

    Args:
        gate: (..., I) float32/float16/bfloat16.
        up: (..., I) same shape and dtype.
        activation: "silu", "gelu" (erf), "gelu_tanh", "relu2", or a GLU (clamp limit, alpha, up offset).
        single_rounding: round once instead of twice.
        out: optional contiguous (..., I) buffer of the input dtype; every element is written.
        config: tiling override (tests and tuning); default `launch_config(rows, I)`.

    Returns:
        (..., I) tensor of the input dtype on the input's device.
    """
    check_pair(gate, up)
    glu = check_activation(activation)
    check_out(out, tuple(gate.shape), gate.dtype, gate.device)
    n = gate.shape[-1]
    dev = _exec_device(gate)
    g2, u2 = _rows(gate.to(dev), n), _rows(up.to(dev), n)
    res = _result_buffer(gate.shape, gate.dtype, out, dev)
    o2 = res.view(-1, n)
    _launch(
        "pair",
        (g2, u2, o2, g2.shape[0], n, g2.stride(0), u2.stride(0), o2.stride(0)),
        g2.shape[0], n, glu, single_rounding, config,
    )
    return _finish(res, out, gate.device)


def silu_mul_fused(
    gate_up: torch.Tensor,
    *,
    order: str = "gate-up",
    interleaved: bool = False,
    activation: str | GLU = "silu",
    single_rounding: bool = False,
    out: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """`act(gate) * up` read straight from a fused (..., 2I) activation.

    Halves `[gate | up]` ("gate-up") / `[up | gate]` ("up-gate") run the pair kernel on two strided views;
    `interleaved=True` (g0, u0, g1, u1, ... or u0, g0, ...) runs a kernel that loads 2*BLOCK_N contiguous
    columns and de-interleaves them in registers. Rounding as in `silu_mul`.

    Args:
        gate_up: (..., 2I) float32/float16/bfloat16.
        order: "gate-up" or "up-gate".
        interleaved: adjacent-column pairs instead of halves.
        activation: "silu", "gelu", "gelu_tanh", "relu2" or a GLU.
        single_rounding: round once instead of twice.
        out: optional contiguous (..., I) buffer.
        config: tiling override; BLOCK_N counts output columns.

    Returns:
        (..., I) tensor of the input dtype.
    """
    gate_first = check_order(order)
    n = check_fused(gate_up)
    glu = check_activation(activation)
    shape = (*gate_up.shape[:-1], n)
    check_out(out, shape, gate_up.dtype, gate_up.device)
    dev = _exec_device(gate_up)
    x2 = _rows(gate_up.to(dev), 2 * n)
    res = _result_buffer(shape, gate_up.dtype, out, dev)
    o2 = res.view(-1, n)
    rows = x2.shape[0]
    if interleaved:
        _launch(
            "interleaved",
            (x2, o2, rows, n, x2.stride(0), o2.stride(0)),
            rows, n, glu, single_rounding, config, GATE_FIRST=gate_first,
        )
    else:
        first, second = x2[:, :n], x2[:, n:]
        g2, u2 = (first, second) if gate_first else (second, first)
        _launch(
            "pair",
            (g2, u2, o2, rows, n, g2.stride(0), u2.stride(0), o2.stride(0)),
            rows, n, glu, single_rounding, config,
        )
    return _finish(res, out, gate_up.device)


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
    """`down(act(gate(x)) * up(x))`: torch matmuls in the input dtype, the Triton activation between them.

    Args:
        x: (..., H).
        gate_w, up_w: (I, H), PyTorch (out, in).
        down_w: (H, I).
        biases: optional dict with any of "gate" (I,), "up" (I,), "down" (H,).
        activation: "silu", "gelu", "gelu_tanh", "relu2" or a GLU.
        single_rounding: see `silu_mul`.

    Returns:
        (..., H) tensor of the input dtype on the input's device.
    """
    b = check_ffn(x, gate_w, up_w, down_w, biases, activation)
    dev = _exec_device(x)
    b = {k: v.to(dev) for k, v in b.items()}
    xd = x.to(dev)
    g = F.linear(xd, gate_w.to(dev), b.get("gate"))
    u = F.linear(xd, up_w.to(dev), b.get("up"))
    h = silu_mul(g, u, activation=activation, single_rounding=single_rounding)
    return F.linear(h, down_w.to(dev), b.get("down")).to(x.device)
