"""One run on a CUDA machine: the Triton kernels' correctness checks, then the GPU benchmark.

    python benchmarks/gpu_kernels.py [--skip-bench] [--strict-perf] [--timeout 540]

Needs torch with CUDA and triton (`pip install -e '.[cuda]'`). TRITON_INTERPRET is removed from the
environment first: these checks are about the compiled kernels.

Hard checks (FAIL, exit status 1):
  * silu_mul / silu_mul_fused (both halves orders, interleaved both orders) for float32/float16/bfloat16 and
    silu/gelu/gelu_tanh, odd sizes, one and many rows, against the float64 reference within the tolerance
    table, into NaN-poisoned outputs (an unwritten element fails);
  * silu bit-exact against eager `F.silu(g) * u` on CUDA (same libdevice expf, IEEE division, same two
    roundings), default and single-rounding (`(F.silu(g.float()) * u.float()).to(dtype)`);
  * forced small tilings (ragged tiles in both grid axes) and row offsets past 2**31 elements;
  * CPU tensors on a CUDA machine come back on the CPU with the same bits;
  * ffn against the reference, and bit-exact against the eager composition for silu.
Soft checks (WARN): gelu / gelu_tanh bit-exactness against eager (expected: same libdevice erff/tanhf and
the same fma contraction as nvcc, but not promised), and the performance targets (>= 85% of copy
bandwidth at the large shapes, >= 1.7x eager; FAIL with --strict-perf).
A watchdog ends the process (status 2) if the whole run exceeds --timeout seconds.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from pathlib import Path

DRY_RUN = "--dry-run-cpu" in sys.argv
if not DRY_RUN:
    os.environ.pop("TRITON_INTERPRET", None)  # before anything imports triton

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from ffn_tools import kernels  # noqa: E402
from ffn_tools.kernels.tolerances import compare, tolerance  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTS = ("silu", "gelu", "gelu_tanh")
EAGER = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
LAYOUTS = (("pair", "gate-up", False), ("fused", "gate-up", False), ("fused", "up-gate", False),
           ("fused", "gate-up", True), ("fused", "up-gate", True))
DEV = torch.device("cpu" if DRY_RUN else "cuda")


class Results:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []  # (group, status, detail)

    def add(self, group: str, ok: bool, detail: str, soft: bool = False) -> None:
        self.rows.append((group, "PASS" if ok else ("WARN" if soft else "FAIL"), detail))

    def summary(self) -> int:
        groups: dict[str, dict[str, int]] = {}
        for group, status, _ in self.rows:
            groups.setdefault(group, {"PASS": 0, "WARN": 0, "FAIL": 0})[status] += 1
        print("\n=== summary ===")
        for group, c in groups.items():
            state = "FAIL" if c["FAIL"] else ("WARN" if c["WARN"] else "PASS")
            print(f"{state:4}  {group:44} pass {c['PASS']:3}  warn {c['WARN']:3}  fail {c['FAIL']:3}")
        bad = [r for r in self.rows if r[1] != "PASS"]
        for group, status, detail in bad[:25]:
            print(f"  {status} {group}: {detail}")
        if len(bad) > 25:
            print(f"  ... and {len(bad) - 25} more")
        n_fail = sum(1 for r in self.rows if r[1] == "FAIL")
        print(f"\n{'FAIL' if n_fail else 'PASS'}: {len(self.rows) - n_fail}/{len(self.rows)} checks passed"
              f" ({sum(1 for r in self.rows if r[1] == 'WARN')} warnings)")
        return 1 if n_fail else 0


def inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(shape, generator=gen) * 3).to(dtype)
    u = torch.randn(shape, generator=gen).to(dtype)
    g = torch.where(g == 0, torch.full_like(g, 0.5), g)
    u = torch.where(u == 0, torch.full_like(u, -0.75), u)
    if shape[-1] >= 4:
        g[..., 0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0]).to(dtype)
    return g.to(DEV), u.to(DEV)


def fuse(g, u, order, interleaved):
    a, b = (g, u) if order == "gate-up" else (u, g)
    if interleaved:
        return torch.stack([a, b], dim=-1).reshape(*g.shape[:-1], 2 * g.shape[-1])
    return torch.cat([a, b], dim=-1)


def run(kt, layout, g, u, **kw):
    out = torch.full(g.shape, float("nan"), dtype=g.dtype, device=g.device)
    kind, order, il = layout
    if kind == "pair":
        res = kt.silu_mul(g, u, out=out, **kw)
    else:
        res = kt.silu_mul_fused(fuse(g, u, order, il), order=order, interleaved=il, out=out, **kw)
    assert res is out
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    diff = a.contiguous().view(view) != b.contiguous().view(view)
    n = int(diff.sum())
    if not n:
        return True, "bit-exact"
    i = diff.flatten().nonzero()[0].item()
    return False, f"{n} of {a.numel()} differ; first: {a.flatten()[i].item()!r} vs eager {b.flatten()[i].item()!r}"


def lid(layout) -> str:
    return layout[0] if layout[0] == "pair" else f"{layout[1]}{'/interleaved' if layout[2] else '/halves'}"


def check_activations(kt, ref, res: Results) -> None:
    cases = [(dt, act, lay, (33, 1001)) for dt in DTYPES for act in ACTS for lay in LAYOUTS]
    cases += [(dt, "silu", lay, shape) for dt in DTYPES for lay in (LAYOUTS[0], LAYOUTS[2], LAYOUTS[3])
              for shape in ((1, 1), (1, 7), (2, 14337), (4, 14336))]
    for dt, act, lay, shape in cases:
        name = f"{str(dt)[6:]} {act} {lid(lay)} {shape[0]}x{shape[1]}"
        g, u = inputs(shape, dt)
        out = run(kt, lay, g, u, activation=act)
        c = compare(out, ref.silu_mul(g, u, activation=act), *tolerance(dt))
        res.add("activation vs float64 reference", c.ok, f"{name}: {c.summary()}")
        ok, detail = bits_equal(out, EAGER[act](g) * u)
        res.add(f"{act} bit-exact vs eager", ok, f"{name}: {detail}", soft=act != "silu" or DRY_RUN)
    for dt in (torch.float16, torch.bfloat16):
        for act in ACTS:
            g, u = inputs((33, 1001), dt, seed=1)
            out = run(kt, LAYOUTS[3], g, u, activation=act, single_rounding=True)
            ok, detail = bits_equal(out, (EAGER[act](g.float()) * u.float()).to(dt))
            res.add(f"{act} single-rounding bit-exact", ok, f"{str(dt)[6:]}: {detail}", soft=act != "silu" or DRY_RUN)


def check_tiling_and_offsets(kt, ref, res: Results) -> None:
    g, u = inputs((13, 131), torch.bfloat16, seed=2)
    for cfg in ((1, 16, 4), (4, 32, 4), (2, 64, 8), (16, 256, 4)):
        for lay in LAYOUTS:
            out = run(kt, lay, g, u, config=kt.LaunchConfig(*cfg))
            ok, detail = bits_equal(out, F.silu(g) * u)
            res.add("forced tilings (ragged tiles)", ok, f"{cfg} {lid(lay)}: {detail}", soft=DRY_RUN)
    # gate_up (33000, 2 * 32768) bf16: the last rows start past 2**31 elements (4.3 GB input).
    rows, n = (5, 64) if DRY_RUN else (33000, 32768)
    gen = torch.Generator(device=DEV).manual_seed(3)
    gu = torch.randn(rows, 2 * n, device=DEV, generator=gen, dtype=torch.bfloat16)
    for il in (False, True):
        out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        kt.silu_mul_fused(gu, interleaved=il, out=out)
        for sl in (slice(0, 2), slice(rows - 3, rows)):
            part = gu[sl]
            g, u = (part[:, 0::2], part[:, 1::2]) if il else (part[:, :n], part[:, n:])
            ok, detail = bits_equal(out[sl], F.silu(g) * u)
            res.add("row offsets past 2**31", ok, f"{'interleaved' if il else 'halves'} rows {sl.start}..{sl.stop}: {detail}",
                    soft=DRY_RUN)
        res.add("row offsets past 2**31", not out.isnan().any().item(), "no element left unwritten")
        del out
    del gu
    if not DRY_RUN:
        torch.cuda.empty_cache()


def check_cpu_tensors(kt, ref, res: Results) -> None:
    g, u = inputs((5, 1001), torch.bfloat16, seed=4)
    cpu = kt.silu_mul(g.cpu(), u.cpu())
    ok, detail = bits_equal(cpu, kt.silu_mul(g, u).cpu())
    res.add("CPU tensors on a CUDA machine", ok and cpu.device.type == "cpu", detail)


def check_ffn(kt, ref, res: Results) -> None:
    tokens, hidden, inter = 17, 256, 1001
    for dt in DTYPES:
        for act in ACTS:
            gen = torch.Generator().manual_seed(hidden + inter)
            x = torch.randn(tokens, hidden, generator=gen).to(dt).to(DEV)
            gw = (torch.randn(inter, hidden, generator=gen) / hidden**0.5).to(dt).to(DEV)
            uw = (torch.randn(inter, hidden, generator=gen) / hidden**0.5).to(dt).to(DEV)
            dw = (torch.randn(hidden, inter, generator=gen) / inter**0.5).to(dt).to(DEV)
            b = {k: (torch.randn(n, generator=gen) * 0.1).to(dt).to(DEV) for k, n in (("gate", inter), ("down", hidden))}
            out = kt.ffn(x, gw, uw, dw, b, activation=act)
            c = compare(out, ref.ffn(x, gw, uw, dw, b, activation=act), *tolerance(dt, "ffn"))
            res.add("ffn vs float64 reference", c.ok, f"{str(dt)[6:]} {act}: {c.summary()}")
            eager = F.linear(EAGER[act](F.linear(x, gw, b["gate"])) * F.linear(x, uw), dw, b["down"])
            ok, detail = bits_equal(out, eager)
            res.add(f"ffn {act} bit-exact vs eager composition", ok, f"{str(dt)[6:]}: {detail}", soft=act != "silu" or DRY_RUN)


def benchmark(res: Results, strict: bool) -> None:
    import bench_kernels

    shapes = bench_kernels.TINY_SHAPES if DRY_RUN else bench_kernels.GPU_SHAPES
    rows = bench_kernels.device_bench(shapes, DEV, sweep=True, compile_=not DRY_RUN)
    bench_kernels.print_device(rows, DEV)
    for r in rows:
        if "triton_us" not in r:
            res.add("performance targets", False, f"{r['shape']}: Triton did not run")
            continue
        copy_bw = r["bytes"] / r["copy_us"]
        frac = (r["bytes"] / r["triton_us"]) / copy_bw
        speedup = r["eager_us"] / r["triton_us"]
        best_cfg, best_us = min(r["sweep"].items(), key=lambda kv: kv[1])
        print(f"{r['shape']}: default tiling {r['triton_config']} {r['triton_us']:.1f} µs; "
              f"best swept {best_cfg} {best_us:.1f} µs ({r['triton_us'] / best_us:.2f}x of best)")
        if r["shape"][0] >= 8192:
            res.add("performance targets", frac >= 0.85, f"{r['shape']}: {frac:.0%} of copy bandwidth (target 85%)",
                    soft=DRY_RUN or not strict)
        res.add("performance targets", speedup >= 1.7, f"{r['shape']}: {speedup:.2f}x eager (target 1.7x)",
                soft=DRY_RUN or not strict)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skip-bench", action="store_true", help="Only the correctness checks.")
    p.add_argument("--strict-perf", action="store_true", help="Missed performance targets fail the run.")
    p.add_argument("--timeout", type=float, default=540, help="Watchdog: end the process after this many seconds.")
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="Exercise this script without a GPU (Triton interpreter, small sizes; bit-exactness and "
                        "timings are then only reported, not checked).")
    args = p.parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)  # cannot hang, even inside a CUDA call
    res = Results()
    if not DRY_RUN and not torch.cuda.is_available():
        print("FAIL: torch.cuda.is_available() is False; this script checks the compiled CUDA kernels.")
        return 1
    kt = kernels.get_backend("triton")
    ref = kernels.get_backend("reference")
    name = "CPU dry run" if DRY_RUN else torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}, interpreted={kt.INTERPRETED}")
    if not kt.available() or (kt.INTERPRETED and not DRY_RUN):
        print(f"FAIL: Triton backend not usable natively: {kt.why_unavailable() or 'TRITON_INTERPRET is set'}")
        return 1
    import triton

    print(f"triton {triton.__version__}")
    for step in (check_activations, check_tiling_and_offsets, check_cpu_tensors, check_ffn):
        t0 = time.perf_counter()
        try:
            step(kt, ref, res)
        except Exception as exc:  # one broken step must not hide the others
            res.add(step.__name__, False, f"raised {type(exc).__name__}: {exc}")
        print(f"{step.__name__}: {time.perf_counter() - t0:.1f} s")
    if not args.skip_bench:
        t0 = time.perf_counter()
        try:
            benchmark(res, args.strict_perf)
        except Exception as exc:
            res.add("benchmark", False, f"raised {type(exc).__name__}: {exc}")
        print(f"benchmark: {time.perf_counter() - t0:.1f} s")
    return res.summary()


if __name__ == "__main__":
    sys.exit(main())
