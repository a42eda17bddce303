"""Triton kernels for the gated activation `act(gate) * up`. Imported only by kernels.triton.

Both kernels run a 2D grid: axis 0 over tiles of BLOCK_M rows, axis 1 over tiles of BLOCK_N output
columns. Loads are contiguous along the columns (the compiler vectorises them when the pointers and row
strides are 16-byte aligned), every load is cast to float32 before any arithmetic (the interpreter's
bf16/fp16 arithmetic is not IEEE), and masks cover ragged row and column tails.

Numerics (ACT 0 = silu, 1 = gelu, 2 = gelu_tanh, 3 = relu2) follow PyTorch's CUDA kernels term for term:
    silu       x / (1 + exp(-x))                                 IEEE division (div_rn)
    gelu       x * 0.5 * (1 + erf(x * float32(1/sqrt 2)))
    gelu_tanh  0.5 * x * (1 + tanh(float32(sqrt 2/pi) * fma(float32(0.044715), x*x*x, x)))
    relu2      max(x, 0) * max(x, 0)                             exact but for the one rounding of the square
The GLU's data (kernels._surface.GLU) arrive as constexprs: silu's slope ALPHA (x / (1 + exp(-(ALPHA * x))), ALPHA
1.0 is exactly plain silu), CLAMP with LIMIT (gate clamped to <= LIMIT, up to [-LIMIT, LIMIT], by comparisons
that keep NaN), UP_OFFSET added to the clamped up (0.0: no add).
With NATIVE (compiled for CUDA) exp/erf/tanh are libdevice's __nv_expf/__nv_erff/__nv_tanhf, the same
functions CUDA's expf/erff/tanhf that PyTorch calls; `tl.exp` would lower to the approximate ex2.approx.
In the interpreter they are numpy's float32 functions (tanh via exp), and float32 -> bfloat16 rounding
is done on the bits, because the interpreter's own conversion truncates instead of rounding to nearest even.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ffn_tools.kernels._surface import GELU_SQRT1_2, GELU_TANH_BETA, GELU_TANH_KAPPA

# float32 constants exactly as PyTorch's gelu kernels round them (opmath_t = float).
SQRT1_2: tl.constexpr = tl.constexpr(GELU_SQRT1_2)
TANH_BETA: tl.constexpr = tl.constexpr(GELU_TANH_BETA)
TANH_KAPPA: tl.constexpr = tl.constexpr(GELU_TANH_KAPPA)


@triton.jit
def _round(y, out_ty: tl.constexpr, NATIVE: tl.constexpr):
    """float32 -> out_ty, round to nearest even (hardware cvt.rn on CUDA; emulated for bf16 when interpreted)."""
    if NATIVE:
        return y.to(out_ty)
    elif out_ty == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        rne = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rne = tl.where(y != y, 0x7FC0, rne)  # keep NaN a NaN (the add could carry it into the sign bit)
        return rne.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(out_ty)


@triton.jit
def _glu(a, b, out_ty: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, CLAMP: tl.constexpr,
         LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr, SINGLE_ROUNDING: tl.constexpr, NATIVE: tl.constexpr):
    """act(a) * b from float32 a, b, rounded to out_ty once or twice (see kernels.triton.silu_mul)."""
    if CLAMP:  # where, not minimum: NaN > LIMIT is False, so NaN stays NaN (as torch.clamp)
        a = tl.where(a > LIMIT, LIMIT, a)
        b = tl.where(b > LIMIT, LIMIT, tl.where(b < -LIMIT, -LIMIT, b))
    if UP_OFFSET != 0.0:
        b = b + UP_OFFSET
    if ACT == 0:
        if NATIVE:
            e = libdevice.exp(-(a * ALPHA))
        else:
            e = tl.exp(-(a * ALPHA))
        h = tl.math.div_rn(a, 1.0 + e)
    elif ACT == 1:
        if NATIVE:
            erf = libdevice.erf(a * SQRT1_2)
        else:
            erf = tl.erf(a * SQRT1_2)
        h = a * 0.5 * (1.0 + erf)
    elif ACT == 3:
        r = tl.maximum(a, 0.0)
        h = r * r
    else:
        inner = TANH_BETA * tl.fma(TANH_KAPPA, a * a * a, a)
        if NATIVE:
            t = libdevice.tanh(inner)
        else:
            e = tl.exp(-2.0 * tl.abs(inner))  # in (0, 1]: never overflows
            t = (1.0 - e) / (1.0 + e)
            t = tl.where(inner < 0, -t, t)
        h = 0.5 * a * (1.0 + t)
    if SINGLE_ROUNDING:
        y = h * b
    else:
        # Round the activation to the output dtype first, as eager `F.silu(g) * u` does.
        y = _round(h, out_ty, NATIVE).to(tl.float32) * b
    return _round(y, out_ty, NATIVE)


@triton.jit
def glu_pair_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_a,
    stride_b,
    stride_out,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    CLAMP: tl.constexpr,
    LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr,
    SINGLE_ROUNDING: tl.constexpr,
    NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[r, c] = act(a[r, c]) * b[r, c] for separate tensors or the two halves of a fused one."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK_N), BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    r64 = rows.to(tl.int64)[:, None]  # row * stride can pass 2**31 for large activations
    a = tl.load(a_ptr + r64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _glu(a, b, out_ptr.dtype.element_ty, ACT, ALPHA, CLAMP, LIMIT, UP_OFFSET, SINGLE_ROUNDING, NATIVE)
    tl.store(out_ptr + r64 * stride_out + cols[None, :], y, mask=mask)


@triton.jit
def glu_interleaved_kernel(
    x_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_out,
    GATE_FIRST: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    CLAMP: tl.constexpr,
    LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr,
    SINGLE_ROUNDING: tl.constexpr,
    NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[r, c] = act(x[r, 2c + g]) * x[r, 2c + 1 - g] with g = 0 for gate-first pairs, 1 for up-first."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (rows < n_rows)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    # One contiguous load of 2*BLOCK_N columns, then de-interleave in registers.
    cols2 = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
    cols2 = tl.max_contiguous(tl.multiple_of(cols2, 2 * BLOCK_N), 2 * BLOCK_N)
    pairs = tl.load(
        x_ptr + r64 * stride_x + cols2[None, :], mask=row_mask & (cols2 < 2 * n_cols)[None, :], other=0.0
    ).to(tl.float32)
    first, second = tl.split(tl.reshape(pairs, (BLOCK_M, BLOCK_N, 2)))
    if GATE_FIRST:
        a = first
        b = second
    else:
        a = second
        b = first
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y = _glu(a, b, out_ptr.dtype.element_ty, ACT, ALPHA, CLAMP, LIMIT, UP_OFFSET, SINGLE_ROUNDING, NATIVE)
    tl.store(out_ptr + r64 * stride_out + cols[None, :], y, mask=row_mask & (cols < n_cols)[None, :])
