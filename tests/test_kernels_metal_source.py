"""The Metal kernel bodies of kernels/metal.py, compiled as C++ with g++ and run on the CPU.

Metal cannot run off Apple silicon, so the real Metal tests in tests/test_kernels.py are skipped here. This
file takes the *same* strings (`HEADER`, `SILU_MUL_SOURCE`, `FUSED_HALVES_SOURCE`,
`FUSED_INTERLEAVED_SOURCE`), wraps each body in a function whose signature is generated the way MLX's
`metal_kernel` generates it (inputs in order, the float32 `glu` numbers {alpha, limit, up_offset} last,
`<name>_shape` only when the body mentions it, `thread_position_in_grid` as a uint3, template parameters
T/ACT/SINGLE_ROUNDING/GATE_FIRST instantiated with integers as MLX prints them), and compiles that with a small shim header: `metal::` math mapped to
<cmath> float functions, `float16_t` = `_Float16`, and a `bfloat16_t` emulated on 16 bits whose conversion
from float rounds to nearest even like Metal's `bfloat`. A driver runs the body once per thread over a grid
padded beyond the array in both directions, into an output poisoned with NaN.

What this proves: the bodies' indexing (row/column arithmetic, the halves offsets, the interleaved pair
addressing for both orders), the bounds masks (padded threads write nothing), that every output element is
written, the float math (activation formulas, erf polynomial and constants, two-rounding vs single-rounding
structure through `T`, the GLU's clamps, silu slope and up offset, NaN kept through the clamps), for float,
half and bfloat on odd sizes, one row and many rows.

What it does not prove: that Apple's Metal compiler accepts the source (MSL-only syntax, address spaces,
availability of `metal::precise::*` and `bfloat` on old OS versions), that MLX's generated header and
template instantiation match this emulation exactly, anything about GPU execution (threadgroup sizes,
dispatch, memory), Metal's own exp/tanh accuracy (here they are glibc's), or that Metal's compiler keeps the
clamps' NaN behaviour (this compiles without fast-math). Those need a Mac: the
capability-skipped tests in tests/test_kernels.py run the real kernels there.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from ffn_tools import kernels
from ffn_tools.kernels import GLU, metal, reference
from ffn_tools.kernels._surface import check_activation
from ffn_tools.kernels.tolerances import compare, tolerance

GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ is not installed")

SHIM = r"""
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
typedef unsigned int uint;
struct uint3 { uint x, y, z; };
namespace metal {
inline float abs(float x) { return std::fabs(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float copysign(float a, float b) { return std::copysign(a, b); }
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float tanh(float x) { return std::tanh(x); }
}  // namespace precise
}  // namespace metal
typedef _Float16 float16_t;  // IEEE binary16 like Metal's half; float -> _Float16 rounds to nearest even
struct bfloat16_t {          // Metal's bfloat: the high 16 bits of a float, rounded to nearest even
  uint16_t bits;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = uint16_t((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = uint16_t(u >> 16);
  }
  explicit operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
"""

DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

constexpr size_t GUARD = 64;

template <typename T> T poison() {
  T v; float nan = NAN; v = static_cast<T>(nan); return v;
}

template <typename T, int ACT, int SR, int GF>
void launch(int variant, int rows, int n, int gx, int gy, const T* a, const T* b, const float* glu, T* out) {
  int shape_pair[2] = {rows, n};
  int shape_fused[2] = {rows, 2 * n};
  // Last thread first: a masked thread that writes into a neighbour's element is not silently repaired.
  for (int y = gy - 1; y >= 0; --y)
    for (int x = gx - 1; x >= 0; --x) {
      uint3 tid = {uint(x), uint(y), 0u};
      if (variant == 0) silu_mul<T, ACT, SR>(a, shape_pair, b, glu, out, tid);
      else if (variant == 1) fused_halves<T, ACT, SR, GF>(a, shape_fused, glu, out, tid);
      else fused_interleaved<T, ACT, SR, GF>(a, shape_fused, glu, out, tid);
    }
}

template <typename T>
int run(int variant, int act, int sr, int gf, int rows, int n, int gx, int gy, const float* glu, const char* in,
        const char* outp) {
  size_t n_in = size_t(rows) * n * 2;  // gate and up, or gate_up
  // Both buffers end in GUARD poisoned elements: an out-of-bounds read yields NaN in the output and an
  // out-of-bounds write shows as a changed guard (the output file includes the guard).
  std::vector<T> buf(n_in + GUARD, poison<T>()), out(size_t(rows) * n + GUARD, poison<T>());
  FILE* f = std::fopen(in, "rb");
  if (!f || std::fread(buf.data(), sizeof(T), n_in, f) != n_in) return 2;
  std::fclose(f);
  const T* a = buf.data();
  const T* b = buf.data() + size_t(rows) * n;
#define L(A, S, G) launch<T, A, S, G>(variant, rows, n, gx, gy, a, b, glu, out.data())
#define LG(A, S) if (gf) L(A, S, 1); else L(A, S, 0)
#define LS(A) if (sr) { LG(A, 1); } else { LG(A, 0); }
  if (act == 0) { LS(0) } else if (act == 1) { LS(1) } else if (act == 2) { LS(2) } else { LS(3) }
  f = std::fopen(outp, "wb");
  std::fwrite(out.data(), sizeof(T), out.size(), f);
  std::fclose(f);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "cvt") {  // float32 file -> bfloat16 bits, then half bits
    FILE* f = std::fopen(argv[2], "rb");
    std::vector<float> x;
    float v;
    while (std::fread(&v, 4, 1, f) == 1) x.push_back(v);
    std::fclose(f);
    f = std::fopen(argv[3], "wb");
    for (float e : x) { bfloat16_t b(e); std::fwrite(&b, 2, 1, f); }
    for (float e : x) { float16_t h = static_cast<float16_t>(e); std::fwrite(&h, 2, 1, f); }
    std::fclose(f);
    return 0;
  }
  if (argc != 15) return 1;
  int v[9];
  for (int i = 0; i < 9; ++i) v[i] = std::atoi(argv[i + 1]);
  float glu[3];  // the kernels' `glu` input {alpha, limit, up_offset}, as float32 bit patterns (hex)
  for (int i = 0; i < 3; ++i) {
    uint32_t bits = uint32_t(std::strtoul(argv[i + 10], nullptr, 16));
    std::memcpy(&glu[i], &bits, 4);
  }
  // variant dtype act single gate_first rows n grid_x grid_y alpha limit up_offset in out
  switch (v[1]) {
    case 0: return run<float>(v[0], v[2], v[3], v[4], v[5], v[6], v[7], v[8], glu, argv[13], argv[14]);
    case 1: return run<float16_t>(v[0], v[2], v[3], v[4], v[5], v[6], v[7], v[8], glu, argv[13], argv[14]);
    default: return run<bfloat16_t>(v[0], v[2], v[3], v[4], v[5], v[6], v[7], v[8], glu, argv[13], argv[14]);
  }
}
"""

GUARD = 64  # poisoned elements after each buffer, as in the driver
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
VARIANTS = {  # (variant code, input names, body, gate_first template parameter?)
    "pair": (0, "silu_mul", ("gate", "up", "glu"), metal.SILU_MUL_SOURCE),
    "halves": (1, "fused_halves", ("gate_up", "glu"), metal.FUSED_HALVES_SOURCE),
    "interleaved": (2, "fused_interleaved", ("gate_up", "glu"), metal.FUSED_INTERLEAVED_SOURCE),
}


def mlx_like_function(name: str, inputs: tuple[str, ...], body: str, gate_first: bool) -> str:
    """A C++ function around `body`, with the parameters MLX's metal_kernel would generate for it."""
    params = []
    for inp in inputs:
        params.append(f"const {'float' if inp == 'glu' else 'T'}* {inp}")  # glu: a float32 array
        if f"{inp}_shape" in body:  # MLX passes <name>_shape only when the source mentions it
            params.append(f"const int* {inp}_shape")
        assert f"{inp}_strides" not in body and f"{inp}_ndim" not in body, "extend the emulation"
    params.append("T* out")
    params.append("uint3 thread_position_in_grid")
    tmpl = "typename T, int ACT, int SINGLE_ROUNDING" + (", int GATE_FIRST" if gate_first else "")
    return f"template <{tmpl}>\nvoid {name}({', '.join(params)}) {{\n{body}\n}}\n"


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> str:
    src = SHIM + metal.HEADER
    for _, name, inputs, body in VARIANTS.values():
        src += mlx_like_function(name, inputs, body, gate_first=name != "silu_mul")
    src += DRIVER
    d = tmp_path_factory.mktemp("metal_shim")
    (d / "harness.cpp").write_text(src)
    exe = d / "harness"
    proc = subprocess.run(
        [GXX, "-std=c++17", "-O1", "-ffp-contract=off", "-Wall", "-Wno-unused-function", "-o", str(exe), str(d / "harness.cpp")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"g++ rejected the Metal kernel source:\n{proc.stderr[-4000:]}"
    return str(exe)


def _bits(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype != torch.float32 else t).numpy().tobytes()


def _from_bits(raw: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    np_dtype = np.float32 if dtype == torch.float32 else np.int16
    t = torch.from_numpy(np.frombuffer(raw, dtype=np_dtype).copy())
    return (t if dtype == torch.float32 else t.view(dtype)).view(shape)


def run_body(harness, tmp_path, layout, gate, up, activation, single_rounding=False, order="gate-up", grid=None):
    """Run one kernel body over a padded grid; returns the (rows, n) output. ``activation``: a name or a GLU."""
    rows, n = gate.shape
    code, _, _, _ = VARIANTS[layout]
    gate_first = order == "gate-up"
    if layout == "pair":
        payload = torch.cat([gate.flatten(), up.flatten()])
    else:
        a, b = (gate, up) if gate_first else (up, gate)
        fused = torch.cat([a, b], dim=1) if layout == "halves" else torch.stack([a, b], dim=2).reshape(rows, 2 * n)
        payload = fused.flatten()
    gx, gy = grid or (n + 5, rows + 3)  # padded: threads past the array must write nothing
    glu = check_activation(activation)
    act = metal._ACT_CODE[glu.function]
    inp, outp = tmp_path / "in.bin", tmp_path / "out.bin"
    inp.write_bytes(_bits(payload))
    numbers = torch.tensor(metal.glu_numbers(glu), dtype=torch.float32).view(torch.int32).tolist()
    args = [code, DTYPE_CODE[gate.dtype], act, int(single_rounding), int(gate_first), rows, n, gx, gy,
            *(f"{b & 0xFFFFFFFF:x}" for b in numbers)]
    proc = subprocess.run([harness, *map(str, args), str(inp), str(outp)], capture_output=True)
    assert proc.returncode == 0, proc.stderr
    res = _from_bits(outp.read_bytes(), gate.dtype, (rows * n + GUARD,))
    assert res[rows * n :].isnan().all(), "the kernel wrote past the end of its output"
    return res[: rows * n].view(rows, n)


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(shape, generator=gen) * 3).to(dtype)
    u = torch.randn(shape, generator=gen).to(dtype)
    g = torch.where(g == 0, torch.full_like(g, 0.5), g)  # never zeros
    u = torch.where(u == 0, torch.full_like(u, -0.75), u)
    if shape[1] >= 4:  # exp overflow / saturation paths
        g[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0]).to(dtype)
    return g, u


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = [("pair", "gate-up"), ("halves", "gate-up"), ("halves", "up-gate"), ("interleaved", "gate-up"), ("interleaved", "up-gate")]


def _body_against_reference(harness, tmp_path, layout, shape, dtype, activation) -> None:
    gate, up = _inputs(shape, dtype)
    res = run_body(harness, tmp_path, layout[0], gate, up, activation, order=layout[1])
    c = compare(res, reference.silu_mul(gate, up, activation=activation), *tolerance(dtype))
    assert c.ok, f"{'-'.join(layout)} {shape}: {c.summary()}"


@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_body_matches_reference(harness, tmp_path, dtype, activation):
    """Numerics: every activation in every dtype, through the pair and an interleaved body."""
    for layout in (LAYOUTS[0], LAYOUTS[4]):
        _body_against_reference(harness, tmp_path, layout, (7, 129), dtype, activation)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(l))
def test_every_body_layout_indexes_exactly_where_it_should(harness, tmp_path, layout):
    """Indexing: every layout and order on one row, one column and ragged shapes, in float32 and bfloat16."""
    for shape in ((1, 1), (1, 7), (7, 129), (5, 1001)):
        for dtype in (torch.float32, torch.bfloat16):
            _body_against_reference(harness, tmp_path, layout, shape, dtype, "silu")


@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_body_rounding_structure_is_exact(harness, tmp_path, dtype, activation):
    """Default: T(float(T(act(g))) * u); SINGLE_ROUNDING: T(act(g) * u), from the body's own float act."""
    gate, up = _inputs((9, 257), dtype, seed=3)
    act32 = run_body(harness, tmp_path, "pair", gate.float(), torch.ones(gate.shape), activation)
    two = run_body(harness, tmp_path, "interleaved", gate, up, activation)
    one = run_body(harness, tmp_path, "halves", gate, up, activation, single_rounding=True)
    assert torch.equal(two.view(torch.int16), (act32.to(dtype).float() * up.float()).to(dtype).view(torch.int16))
    assert torch.equal(one.view(torch.int16), (act32 * up.float()).to(dtype).view(torch.int16))


def test_shim_types_round_to_nearest_even(harness, tmp_path):
    """The emulated bfloat and the _Float16 half must convert from float exactly as torch does (RNE)."""
    ties = [1.0 + k * 2.0**-8 for k in range(1, 8)] + [1.0 + k * 2.0**-11 for k in range(1, 8)]
    special = [0.0, -0.0, float("inf"), -float("inf"), 3.4e38, 65504.0, 65520.0, 1e-40, -1e-45, 5.96e-8]
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.tensor(ties + special), torch.randn(4000, generator=gen) * 100]).float()
    x = torch.cat([x, -x])
    (tmp_path / "x.bin").write_bytes(x.numpy().tobytes())
    proc = subprocess.run([harness, "cvt", str(tmp_path / "x.bin"), str(tmp_path / "y.bin")], capture_output=True)
    assert proc.returncode == 0, proc.stderr
    y = torch.from_numpy(np.frombuffer((tmp_path / "y.bin").read_bytes(), dtype=np.int16).copy())
    assert torch.equal(y[: len(x)], x.bfloat16().view(torch.int16))
    assert torch.equal(y[len(x) :], x.half().view(torch.int16))


def test_unwritten_elements_are_caught(harness, tmp_path):
    """Negative control: a grid one column short leaves NaN poison, which the comparison rejects."""
    gate, up = _inputs((3, 129), torch.bfloat16)
    res = run_body(harness, tmp_path, "halves", gate, up, "silu", grid=(128, 3))
    assert res[:, -1].isnan().all() and not res[:, :-1].isnan().any()
    assert not compare(res, reference.silu_mul(gate, up), *tolerance(torch.bfloat16)).ok


def test_swapped_order_is_caught(harness, tmp_path):
    """Negative control: reading an up-first tensor as gate-first must fail the comparison."""
    gate, up = _inputs((4, 65), torch.float32)
    res = run_body(harness, tmp_path, "interleaved", up, gate, "silu", order="gate-up")
    assert not compare(res, reference.silu_mul(gate, up), *tolerance(torch.float32)).ok


# GPT-OSS's GLU (transformers' GptOssExperts: alpha 1.702, limit 7, (up + 1)), DeepSeek-V4's (clamps only), and a
# clamped GeGLU: each on every layout and dtype, one shape; inputs spread wide enough to cross the limits.
GLUS = {"gpt_oss": GLU("silu", 1.702, 7.0, 1.0), "deepseek_v4": GLU("silu", limit=10.0),
        "gelu_tanh_clamped": GLU("gelu_tanh", limit=2.5, up_offset=0.5)}


@pytest.mark.parametrize("glu", GLUS.values(), ids=GLUS)
def test_body_runs_the_glu_variants(harness, tmp_path, glu):
    for dtype in DTYPES:
        gate, up = _inputs((3, 129), dtype, seed=7)
        gate, up = gate * 3, up * 8  # |up| beyond the limits too
        gate[1, :2], up[1, 2] = float("nan"), float("nan")
        ref = reference.silu_mul(gate, up, activation=glu)
        for layout, order in LAYOUTS:
            res = run_body(harness, tmp_path, layout, gate, up, glu, order=order)
            assert res[1, :3].isnan().all(), f"{layout}-{order} {dtype}: a NaN gate/up must stay NaN"
            res[1, :3], want = 0, ref.clone()
            want[1, :3] = 0
            c = compare(res, want, *tolerance(dtype))
            assert c.ok, f"{layout}-{order} {dtype}: {c.summary()}"
