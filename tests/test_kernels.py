"""Every kernel backend against the float64 reference, and the numerics each one promises.

Backends are skipped by capability only (Metal off Apple silicon); everything that can run here runs.
Inputs are random and never zero (gate ~ 3 N(0,1) with planted -100, -30, 30, 100 for the exp overflow and
saturation paths), sizes are odd (1, 7, 129, 1001 columns; 1 and 33 rows), outputs are NaN-poisoned
buffers passed through `out=` so an element a kernel fails to write fails the comparison.

Bit-exactness, stated per backend (see test_rounding_structure_is_exact and test_ulps_from_eager):
* Every backend's default output is *bit-exact* to round(round(act32(g)) * u) and its single-rounding output
  to round(act32(g) * u), where act32 is that backend's own float32 activation: the rounding structure of
  eager `F.silu(g) * u` holds exactly.
* Against eager `F.silu(g) * u` itself on the CPU, bits can differ only because each backend's float32
  exp/erf/tanh differ from PyTorch's: EAGER_ULPS_FP32 (float32: from the float64 result rounded once) /
  EAGER_ULPS_16BIT hold the bounds measured here
  (gelu forms for g >= -1: below, PyTorch's own CPU erf/tanh tail is thousands of ulp off and only the
  float64 reference is trusted). On CUDA the Triton kernel promises bit-exact equality with eager silu;
  benchmarks/gpu_kernels.py checks that on a GPU.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ffn_tools import kernels
from ffn_tools.kernels import reference
from ffn_tools.kernels.tolerances import compare, tolerance

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS = ("triton", "metal", "mlx", "jax")
LAYOUTS = (
    ("pair", "gate-up", False),
    ("fused", "gate-up", False),
    ("fused", "up-gate", False),
    ("fused", "gate-up", True),
    ("fused", "up-gate", True),
)
SHAPES = ((1, 7), (33, 129))  # the full dtype x activation x layout product runs on these
EXTRA_SHAPES = ((1, 1), (5, 1001))  # and silu on these (a jax compile per shape keeps the product small)
EAGER = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
         "relu2": lambda x: F.relu(x).square()}

# Max ulp distance from `act(g) * u` for float32, where |eager| >= 2**-100 (further down,
# each exp library handles float32 underflow differently; there the absolute difference must stay below
# 2**-100). The float32 exp/erf/tanh libraries differ (numpy for the Triton interpreter, MLX's own, XLA's)
# from PyTorch's; MLX's exp is the loosest at large |x|. gelu and gelu_tanh are compared for g >= -1 only:
# below, `1 + erf` / `1 + tanh` cancel and PyTorch's own CPU result is off by thousands of ulp (the float64
# reference checks that range). 16-bit dtypes: a float32 ulp can flip the first rounding, which moves the
# product by at most 2 ulp of the dtype, and at most 0.1% of the elements may differ at all (measured: no
# bfloat16 difference anywhere, float16 a few in 10**4).
# For float32 the distance is measured from the float64 result rounded once (``F64``), not from eager: eager's own
# float32 erf depends on the CPU's vector unit (torch's AVX2 gelu is 9 ulp off that rounding on these EPYCs, where
# the AVX-512 build that set the earlier eager bounds was closer), so a bound from eager moved with the machine.
# relu2 is the same float32 ops as eager and is compared with eager, bit for bit. Measured 2026-12-07 (AVX2): silu
# triton 3, mlx 59, jax 2; gelu 3, 8, 5; gelu_tanh 6, 5, 6; each bound one ulp above (the backends' own libm, numpy's
# and XLA's, may pick another vector path on another CPU).
F64 = {"silu": lambda x: F.silu(x.double()), "gelu": lambda x: F.gelu(x.double()),
       "gelu_tanh": lambda x: F.gelu(x.double(), approximate="tanh")}
EAGER_ULPS_FP32 = {
    "silu": {"triton": 4, "mlx": 60, "jax": 3},
    "gelu": {"triton": 4, "mlx": 9, "jax": 6},
    "gelu_tanh": {"triton": 7, "mlx": 6, "jax": 7},
    "relu2": {"triton": 0, "mlx": 0, "jax": 0},  # max and one multiply: the same float32 ops as eager
}
EAGER_ULPS_16BIT = 2
MAX_DIFFERING_FRACTION_16BIT = 1e-3


def _dtype_id(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def backend_params(names=BACKENDS):
    out = []
    for name in names:
        mod = kernels.get_backend(name)
        out.append(pytest.param(name, id=name, marks=pytest.mark.skipif(not mod.available(), reason=mod.why_unavailable())))
    return out


def make_inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(shape, generator=gen) * 3).to(dtype)
    u = torch.randn(shape, generator=gen).to(dtype)
    g = torch.where(g == 0, torch.full_like(g, 0.5), g)  # never zeros
    u = torch.where(u == 0, torch.full_like(u, -0.75), u)
    if shape[-1] >= 4:
        g[..., 0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0]).to(dtype)
    return g, u


def fuse(g, u, order, interleaved):
    """Build the fused (..., 2I) tensor independently of the kernels' own split code."""
    a, b = (g, u) if order == "gate-up" else (u, g)
    if interleaved:
        return torch.stack([a, b], dim=-1).reshape(*g.shape[:-1], 2 * g.shape[-1])
    return torch.cat([a, b], dim=-1)


def run_layout(mod, layout, g, u, out, **kw):
    kind, order, interleaved = layout
    if kind == "pair":
        return mod.silu_mul(g, u, out=out, **kw)
    return mod.silu_mul_fused(fuse(g, u, order, interleaved), order=order, interleaved=interleaved, out=out, **kw)


def ulp_key(t: torch.Tensor) -> torch.Tensor:
    """Integers ordered like the floats, so that |key(a) - key(b)| counts representable values between."""
    bits = t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16).long()
    magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def _layout_id(layout) -> str:
    return layout[0] if layout[0] == "pair" else f"{layout[1]}{'-il' if layout[2] else ''}"


# --- every backend against the float64 reference ---------------------------------------------------------


def _check_against_reference(mod, layout, shape, dtype, activation) -> None:
    g, u = make_inputs(shape, dtype)
    out = torch.full(shape, float("nan"), dtype=dtype)
    res = run_layout(mod, layout, g, u, out, activation=activation)
    assert res is out and res.dtype == dtype
    c = compare(out, reference.silu_mul(g, u, activation=activation), *tolerance(dtype))
    assert c.ok, f"{_layout_id(layout)} {shape}: {c.summary()}"


@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("backend", backend_params())
def test_activation_matches_reference(backend, dtype, activation):
    """Numerics: every activation in every dtype, through the separate and the fused kernel."""
    for layout in (LAYOUTS[0], LAYOUTS[4]):
        _check_against_reference(kernels.get_backend(backend), layout, SHAPES[1], dtype, activation)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("backend", backend_params())
def test_every_layout_and_shape_indexes_exactly_where_it_should(backend, layout):
    """Indexing: every layout on every shape (one row, one column, ragged tiles), in a float and a 16-bit
    dtype; a misplaced element fails the same comparison as a wrong value."""
    for shape in (*SHAPES, *EXTRA_SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            _check_against_reference(kernels.get_backend(backend), layout, shape, dtype, "silu")


@pytest.mark.parametrize("single_rounding", [False, True], ids=["two-roundings", "single-rounding"])
@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=_dtype_id)
@pytest.mark.parametrize("backend", backend_params())
def test_rounding_structure_is_exact(backend, dtype, activation, single_rounding):
    """Bit-exact: the backend rounds its own float32 activation exactly as promised (RNE, once or twice)."""
    mod = kernels.get_backend(backend)
    g, u = make_inputs((9, 257), dtype, seed=1)
    act32 = mod.silu_mul(g.float(), torch.ones(g.shape), activation=activation)  # x * 1 is exact
    if single_rounding:
        expected = (act32 * u.float()).to(dtype)
    else:
        expected = (act32.to(dtype).float() * u.float()).to(dtype)
    for layout in (LAYOUTS[0], LAYOUTS[2], LAYOUTS[3]):
        out = torch.full(g.shape, float("nan"), dtype=dtype)
        res = run_layout(mod, layout, g, u, out, activation=activation, single_rounding=single_rounding)
        assert torch.equal(res.view(torch.int16), expected.view(torch.int16)), layout


@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("backend", backend_params(("triton", "mlx", "jax")))
def test_ulps_from_eager(backend, dtype, activation):
    """Distance from eager `F.silu(g) * u` (and the gelu forms) in ulps of the dtype, g over [-90, 90]."""
    gen = torch.Generator().manual_seed(2)
    g = torch.cat([torch.linspace(-90, 90, 40_001), torch.randn(24_999, generator=gen) * 4]).view(200, 325)
    u = (torch.randn(200, 325, generator=gen) + 0.5).to(dtype)
    g = g.to(dtype)
    res = kernels.get_backend(backend).silu_mul(g, u, activation=activation)
    eager = EAGER[activation](g) * u
    domain = (g >= -1) if activation != "silu" else torch.ones_like(g, dtype=torch.bool)
    normal = eager.abs() >= 2.0**-100
    want = (F64[activation](g) * u.double()).float() if dtype == torch.float32 and activation in F64 else eager
    ulps = (ulp_key(res) - ulp_key(want)).abs()[domain & normal]
    bound = EAGER_ULPS_FP32[activation][backend] if dtype == torch.float32 else EAGER_ULPS_16BIT
    assert int(ulps.max()) <= bound, f"{int(ulps.max())} ulp > {bound}"
    tiny = (res.double() - eager.double()).abs()[domain & ~normal]
    assert float(tiny.max()) < 2.0**-100 if tiny.numel() else True
    if dtype != torch.float32:
        assert float((ulps > 0).double().mean()) <= MAX_DIFFERING_FRACTION_16BIT


@pytest.mark.parametrize("shape, bias", [((1, 32, 7), False), ((33, 48, 129), True)], ids=["T1xH32xI7", "T33xH48xI129-bias"])
@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("backend", backend_params())
def test_ffn_matches_reference(backend, dtype, activation, shape, bias):
    tokens, hidden, inter = shape
    gen = torch.Generator().manual_seed(hidden + inter)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_w = (torch.randn(inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    up_w = (torch.randn(inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down_w = (torch.randn(hidden, inter, generator=gen) / inter**0.5).to(dtype)
    biases = None
    if bias:
        biases = {k: (torch.randn(n, generator=gen) * 0.1).to(dtype) for k, n in (("gate", inter), ("up", inter), ("down", hidden))}
    mod = kernels.get_backend(backend)
    res = mod.ffn(x, gate_w, up_w, down_w, biases, activation=activation)
    assert res.dtype == dtype and res.shape == (tokens, hidden)
    ref = reference.ffn(x, gate_w, up_w, down_w, biases, activation=activation)
    c = compare(res, ref, *tolerance(dtype, "ffn"))
    assert c.ok, c.summary()
    # The tolerance is tight enough to catch swapped gate/up projections.
    swapped = reference.ffn(x, up_w, gate_w, down_w, biases, activation=activation)
    assert not compare(res, swapped, *tolerance(dtype, "ffn")).ok


# GPT-OSS's GLU (transformers' GptOssExperts: gate clamped <= 7, up to +-7, gate * sigmoid(1.702 gate) * (up + 1)),
# DeepSeek-V4's (the same clamps at 10 around silu) and a clamped, offset GeGLU: few cases, each on every layout
# and dtype, rather than a factor on the product above.
GLUS = {"gpt_oss": kernels.GLU("silu", 1.702, 7.0, 1.0), "deepseek_v4": kernels.GLU("silu", limit=10.0),
        "gelu_tanh_clamped": kernels.GLU("gelu_tanh", limit=2.5, up_offset=0.5)}


@pytest.mark.parametrize("glu", GLUS.values(), ids=GLUS)
@pytest.mark.parametrize("backend", backend_params())
def test_glu_variants_match_reference(backend, glu):
    """Each layout and dtype against the reference; a NaN gate or up stays NaN through the clamps."""
    mod = kernels.get_backend(backend)
    for dtype in DTYPES:
        g, u = make_inputs((33, 129), dtype, seed=8)
        u = u * 8  # up beyond +-limit too (the gate already is: 3 N(0, 1) and the planted +-30, +-100)
        g[1, :2], u[1, 2] = float("nan"), float("nan")
        ref = reference.silu_mul(g, u, activation=glu)
        ref[1, :3] = 0
        for layout in LAYOUTS:
            out = torch.full(g.shape, float("nan"), dtype=dtype)
            run_layout(mod, layout, g, u, out, activation=glu)
            assert out[1, :3].isnan().all(), f"{_layout_id(layout)} {dtype}: a NaN gate/up must stay NaN"
            out[1, :3] = 0
            c = compare(out, ref, *tolerance(dtype))
            assert c.ok, f"{_layout_id(layout)} {dtype}: {c.summary()}"


@pytest.mark.parametrize("glu", GLUS.values(), ids=GLUS)
@pytest.mark.parametrize("backend", backend_params())
def test_ffn_glu_variants_match_reference(backend, glu):
    """ffn() with each GLU on every dtype, with biases; the tolerance tells the GLU from its plain activation."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(17, 48, generator=gen) * 2
    gate_w, up_w = torch.randn(2, 65, 48, generator=gen).div(48**0.5).mul(2).unbind()  # pre-activations ~ 4 N(0, 1)
    down_w = torch.randn(48, 65, generator=gen) / 65**0.5
    biases = {"gate": torch.randn(65, generator=gen), "up": torch.randn(65, generator=gen),
              "down": torch.randn(48, generator=gen) * 0.1}
    for dtype in DTYPES:
        args = [t.to(dtype) for t in (x, gate_w, up_w, down_w)] + [{k: v.to(dtype) for k, v in biases.items()}]
        res = kernels.get_backend(backend).ffn(*args, activation=glu)
        assert res.dtype == dtype and res.shape == (17, 48)
        ref = reference.ffn(*args, activation=glu)
        atol, rtol = tolerance(dtype, "ffn")
        atol *= float(ref.pow(2).mean().sqrt())  # outputs are O(10) here, not O(1): atol relative to RMS, as verify's
        c = compare(res, ref, atol, rtol)
        assert c.ok, f"{dtype}: {c.summary()}"
        assert not compare(res, reference.ffn(*args, activation=glu.function), atol, rtol).ok


@pytest.mark.parametrize("backend", backend_params())
def test_ffn_keeps_leading_dims(backend):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 32, generator=gen).bfloat16()
    w = [(torch.randn(*s, generator=gen) / s[1] ** 0.5).bfloat16() for s in ((7, 32), (7, 32), (32, 7))]
    res = kernels.get_backend(backend).ffn(x, *w)
    assert res.shape == (2, 3, 32)
    assert compare(res, reference.ffn(x, *w), *tolerance(torch.bfloat16, "ffn")).ok


# --- the checks catch what they claim to catch ----------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("backend", backend_params())
def test_wrong_order_is_caught(backend, interleaved):
    g, u = make_inputs((3, 65), torch.bfloat16)
    res = kernels.get_backend(backend).silu_mul_fused(fuse(g, u, "gate-up", interleaved), order="up-gate", interleaved=interleaved)
    assert not compare(res, reference.silu_mul(g, u), *tolerance(torch.bfloat16)).ok


@pytest.mark.skipif(not kernels.get_backend("triton").available(), reason=kernels.get_backend("triton").why_unavailable())
def test_unwritten_tail_is_caught(monkeypatch):
    """Negative control: a launch grid that misses the ragged last tile leaves NaN, and the comparison fails."""
    kt = kernels.get_backend("triton")
    monkeypatch.setattr(kt, "_cdiv", lambda a, b: a // b)  # the classic bug: floor instead of ceil
    g, u = make_inputs((5, 100), torch.float16)
    out = torch.full(g.shape, float("nan"), dtype=g.dtype)
    kt.silu_mul(g, u, out=out, config=kt.LaunchConfig(2, 32, 1))
    assert out.isnan().any()
    assert not compare(out, reference.silu_mul(g, u), *tolerance(torch.float16)).ok


# --- Triton specifics: tiling, views, devices -----------------------------------------------------------

triton_only = pytest.mark.skipif(
    not kernels.get_backend("triton").available(), reason=kernels.get_backend("triton").why_unavailable()
)


@triton_only
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("config", [(1, 16), (4, 32), (8, 64)], ids=lambda c: f"{c[0]}x{c[1]}")
def test_triton_many_tiles_with_ragged_edges(layout, config):
    """Small forced tiles: many programs in both grid axes, with ragged last tiles in both."""
    kt = kernels.get_backend("triton")
    g, u = make_inputs((6, 67), torch.bfloat16, seed=4)
    out = torch.full(g.shape, float("nan"), dtype=g.dtype)
    run_layout(kt, layout, g, u, out, config=kt.LaunchConfig(*config, 1))
    expected = F.silu(g.float()).bfloat16().float() * u.float()  # reference rounding structure, torch's exp
    assert compare(out, reference.silu_mul(g, u), *tolerance(torch.bfloat16)).ok
    assert compare(out, expected.bfloat16(), 0, 2**-7).ok


@triton_only
def test_triton_strided_and_batched_inputs():
    kt = kernels.get_backend("triton")
    g, u = make_inputs((2, 3, 2 * 129), torch.float16, seed=6)
    gs, us = g[..., ::2], u[..., 1::2]  # non-unit column stride: copied to contiguous rows
    c = compare(kt.silu_mul(gs, us), reference.silu_mul(gs, us), *tolerance(torch.float16))
    assert c.ok, c.summary()
    gu = torch.cat([g, u], dim=-1)[:, 1:]  # (2, 2, 4*129) view with a gap between rows
    res = kt.silu_mul_fused(gu, interleaved=True)
    assert res.shape == (2, 2, 2 * 129)
    assert compare(res, reference.silu_mul_fused(gu, interleaved=True), *tolerance(torch.float16)).ok


@triton_only
def test_triton_launch_config_for_cuda(monkeypatch):
    kt = kernels.get_backend("triton")
    monkeypatch.setattr(kt, "INTERPRETED", False)
    for rows, cols in [(1, 1), (1, 14336), (512, 14336), (8192, 14336), (16384, 28672), (3, 1001)]:
        cfg = kt.launch_config(rows, cols)
        for v in (cfg.block_m, cfg.block_n):
            assert v & (v - 1) == 0
        assert cfg.block_m * cfg.block_n <= 4096 and cfg.num_warps in (4, 8)
        assert cfg.block_m <= max(1, 2 * rows) and cfg.block_n < 2 * max(cols, 1) or cfg.block_n == 1
    assert kt.launch_config(8192, 14336).block_m * kt.launch_config(8192, 14336).block_n == 4096


# --- reference, conversions, surface --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_reference_is_float64_math(dtype):
    g, u = make_inputs((3, 17), dtype)
    for act, fn in EAGER.items():
        res = reference.silu_mul(g, u, activation=act)
        assert res.dtype == torch.float64
        assert torch.equal(res, fn(g.double()) * u.double())
    for order in kernels.ORDERS:
        for il in (False, True):
            assert torch.equal(reference.silu_mul_fused(fuse(g, u, order, il), order=order, interleaved=il), F.silu(g.double()) * u.double())


@pytest.mark.parametrize("backend", backend_params(("mlx", "jax")))
def test_conversion_is_bit_exact(backend):
    """All 65536 bfloat16 and float16 bit patterns (NaN payloads included) survive the trip to and back."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    if backend == "mlx":
        from ffn_tools.kernels._mlx_io import to_mlx, to_torch

        there_and_back = lambda t: to_torch(to_mlx(t))  # noqa: E731
    else:
        kj = kernels.get_backend("jax")
        there_and_back = lambda t: kj._to_torch(kj._to_jax(t), t.device)  # noqa: E731
    for dtype in (torch.bfloat16, torch.float16):
        back = there_and_back(every.view(dtype))
        assert back.dtype == dtype and torch.equal(back.view(torch.int16), every)


@pytest.mark.parametrize("backend", backend_params(("reference", "triton", "mlx", "jax")))
def test_empty_inputs(backend):
    mod = kernels.get_backend(backend)
    g = torch.empty(0, 7, dtype=torch.bfloat16)
    assert mod.silu_mul(g, g).shape == (0, 7)
    assert mod.silu_mul_fused(torch.empty(0, 14, dtype=torch.bfloat16), interleaved=True).shape == (0, 7)


SURFACE = {
    "silu_mul": ["gate", "up", "activation", "single_rounding", "out"],
    "silu_mul_fused": ["gate_up", "order", "interleaved", "activation", "single_rounding", "out"],
    "ffn": ["x", "gate_w", "up_w", "down_w", "biases", "activation", "single_rounding"],
}


@pytest.mark.parametrize("backend", kernels.BACKENDS)
def test_same_surface_everywhere(backend):
    mod = kernels.get_backend(backend)
    for fn_name, params in SURFACE.items():
        sig = inspect.signature(getattr(mod, fn_name))
        assert list(sig.parameters)[: len(params)] == params, fn_name
        defaults = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
        assert defaults.get("activation") == "silu" and defaults.get("single_rounding") is False
    assert isinstance(mod.available(), bool)
    assert (mod.why_unavailable() == "") == mod.available()
    assert "\n" not in mod.why_unavailable()


@pytest.mark.parametrize("backend", kernels.BACKENDS)
def test_bad_arguments_are_rejected_with_a_reason(backend):
    """Checks run before any framework work, so they hold even where the backend is unavailable."""
    mod = kernels.get_backend(backend)
    g = torch.randn(2, 6)
    cases = [
        (lambda: mod.silu_mul(g, torch.randn(2, 5)), ValueError, "same shape"),
        (lambda: mod.silu_mul(g, g.half()), TypeError, "cast"),
        (lambda: mod.silu_mul(g.long(), g.long()), TypeError, "supported dtypes"),
        (lambda: mod.silu_mul(g, g, activation="relu"), ValueError, "gelu_tanh"),
        (lambda: mod.silu_mul(g, g, activation=kernels.GLU("relu")), ValueError, "gelu_tanh"),
        (lambda: mod.silu_mul(g, g, activation=kernels.GLU("gelu", alpha=1.702)), ValueError, "silu's sigmoid slope"),
        (lambda: mod.silu_mul(g, g, activation=kernels.GLU(limit=float("nan"))), ValueError, "finite"),
        (lambda: mod.ffn(torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6),
                         activation=kernels.GLU(limit=-1.0)), ValueError, ">= 0"),
        (lambda: mod.silu_mul_fused(torch.randn(2, 7)), ValueError, "even"),
        (lambda: mod.silu_mul_fused(g, order="gate-first"), ValueError, "up-gate"),
        (lambda: mod.silu_mul(g, g, out=torch.empty(2, 5)), ValueError, "expected"),
        (lambda: mod.ffn(torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)), ValueError, "(out, in)"),
        (lambda: mod.ffn(torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6), {"w1": g}), ValueError, "bias"),
    ]
    for call, exc, words in cases:
        with pytest.raises(exc, match=None) as info:
            call()
        assert words in str(info.value), str(info.value)


def test_get_backend_and_available_backends():
    with pytest.raises(ValueError, match="reference, triton, metal, mlx, jax"):
        kernels.get_backend("cuda")
    names = kernels.available_backends()
    assert names[0] == "reference" and set(names) <= set(kernels.BACKENDS)
    assert all(kernels.get_backend(n).available() for n in names)


def test_import_is_cheap_and_lazy():
    code = "import sys; from ffn_tools import kernels; print(sorted(m for m in ('triton', 'mlx', 'jax') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
