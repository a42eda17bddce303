"""Kernel benchmarks: what the fused activation buys on the CPU (MLX) and on a CUDA GPU (Triton).

CPU, always:
    MLX `mx.compile`d activation vs the same function run eagerly, and torch eager `F.silu(g) * u` vs the
    float64 reference (what verification costs), as time ratios.
Device, on a CUDA GPU (bf16, (tokens, d_ffn) in (1, 14336), (512, 14336), (8192, 14336), (16384, 28672)):
    Triton `kernels.triton.silu_mul` vs eager `F.silu(g) * u` vs `torch.compile` of it, timed with
    triton.testing.do_bench (L2 flushed before every run, median), with achieved GB/s (gate + up read, out
    written) and the fraction of the bandwidth of a device-to-device `dst.copy_(src)` moving the same
    bytes, measured in the same run. `--sweep` also times a few tilings of the Triton kernel.
    Targets on an H200: >= 85% of copy bandwidth at the large shapes, >= 1.7x eager. (At equal bandwidth
    efficiency the ceiling is 10/6 = 1.67x: eager moves 10 bytes per bf16 element, the fused kernel 6.)
Without a GPU everything runs at tiny sizes (the Triton rows go through the interpreter, so their times
mean nothing; this keeps the script itself tested) and finishes in a few seconds.

    .venv/bin/python benchmarks/bench_kernels.py [--tiny] [--full] [--sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from ffn_tools.kernels import get_backend  # noqa: E402

GPU_SHAPES = [(1, 14336), (512, 14336), (8192, 14336), (16384, 28672)]
TINY_SHAPES = [(1, 1000), (7, 1024)]
CPU_SHAPES = [(1, 14336), (64, 14336), (512, 14336)]
SWEEP = [(1, 1024, 4), (1, 2048, 4), (1, 2048, 8), (2, 2048, 8), (1, 4096, 8), (4, 1024, 8), (1, 4096, 16)]


def _time_host(fn, min_time: float = 0.05, min_reps: int = 3) -> float:
    """Median wall time of fn() in µs (fn must block until its result exists)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times) * 1e6


def _time_cuda(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def cpu_bench(shapes) -> list[dict]:
    """MLX compiled vs eager and torch eager vs the float64 reference, bf16 silu."""
    rows = []
    ref = get_backend("reference")
    kmlx = get_backend("mlx")
    for tokens, d_ffn in shapes:
        gen = torch.Generator().manual_seed(0)
        g = (torch.randn(tokens, d_ffn, generator=gen) * 3).bfloat16()
        u = torch.randn(tokens, d_ffn, generator=gen).bfloat16()
        row = {"shape": (tokens, d_ffn)}
        row["torch_eager_us"] = _time_host(lambda: F.silu(g) * u)
        row["reference_f64_us"] = _time_host(lambda: ref.silu_mul(g, u))
        if kmlx.available():
            import mlx.core as mx

            from ffn_tools.kernels._mlx_io import to_mlx

            gm, um = to_mlx(g), to_mlx(u)
            compiled = kmlx._compiled_pair("silu", False)
            row["mlx_eager_us"] = _time_host(lambda: mx.eval(kmlx._glu(gm, um, "silu", False)))
            row["mlx_compiled_us"] = _time_host(lambda: mx.eval(compiled(gm, um)))
        rows.append(row)
    return rows


def device_bench(shapes, device: torch.device, sweep: bool = False, compile_: bool = True) -> list[dict]:
    """Triton silu_mul vs eager vs torch.compile vs copy, bf16, on `device` (CUDA, or CPU via the interpreter)."""
    kt = get_backend("triton")
    timer = _time_cuda if device.type == "cuda" else _time_host
    compiled = None
    if compile_:
        try:
            compiled = torch.compile(lambda a, b: F.silu(a) * b, dynamic=False)
        except Exception as exc:  # torch.compile needs a working inductor toolchain
            print(f"torch.compile unavailable: {exc}", file=sys.stderr)
    rows = []
    for tokens, d_ffn in shapes:
        gen = torch.Generator().manual_seed(0)
        g = (torch.randn(tokens, d_ffn, generator=gen) * 3).bfloat16().to(device)
        u = torch.randn(tokens, d_ffn, generator=gen).bfloat16().to(device)
        out = torch.empty_like(g)
        moved = 3 * g.numel() * g.element_size()  # gate + up read, out written
        src = torch.empty(moved // 2, dtype=torch.uint8, device=device)  # a copy reads and writes: same bytes
        dst = torch.empty_like(src)
        row = {"shape": (tokens, d_ffn), "bytes": moved}
        row["copy_us"] = timer(lambda: dst.copy_(src))
        row["eager_us"] = timer(lambda: F.silu(g) * u)
        if kt.available():
            row["triton_us"] = timer(lambda: kt.silu_mul(g, u, out=out))
            row["triton_config"] = tuple(kt.launch_config(tokens, d_ffn))
        if compiled is not None:
            try:
                compiled(g, u)
                row["compile_us"] = timer(lambda: compiled(g, u))
            except Exception as exc:
                print(f"torch.compile failed for {tokens}x{d_ffn}: {type(exc).__name__}: {exc}", file=sys.stderr)
        if sweep and kt.available():
            row["sweep"] = {
                cfg: timer(lambda c=cfg: kt.silu_mul(g, u, out=out, config=kt.LaunchConfig(*c))) for cfg in SWEEP
            }
        rows.append(row)
        del g, u, out, src, dst
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_cpu(rows: list[dict]) -> None:
    print("CPU, bf16 silu(g) * u")
    print(f"{'tokens x d_ffn':>16} {'torch eager µs':>15} {'f64 ref µs':>11} {'ref/eager':>10} "
          f"{'mlx eager µs':>13} {'mlx compiled µs':>16} {'eager/compiled':>15}")
    for r in rows:
        shape = "%dx%d" % r["shape"]
        mlx = "%13.1f %16.1f %14.2fx" % (r["mlx_eager_us"], r["mlx_compiled_us"], r["mlx_eager_us"] / r["mlx_compiled_us"]) \
            if "mlx_compiled_us" in r else f"{'mlx unavailable':>46}"
        print(f"{shape:>16} {r['torch_eager_us']:15.1f} {r['reference_f64_us']:11.1f} "
              f"{r['reference_f64_us'] / r['torch_eager_us']:9.2f}x {mlx}")


def print_device(rows: list[dict], device: torch.device) -> None:
    note = "" if device.type == "cuda" else "  (CPU: Triton via the interpreter, times are not meaningful)"
    print(f"\n{device.type.upper()}, bf16 silu(g) * u: µs (median), GB/s, fraction of copy bandwidth{note}")
    print("GB/s counts the bytes each implementation moves: 6 per element fused, 10 for eager's two kernels.")
    print(f"{'tokens x d_ffn':>16} {'impl':>14} {'µs':>10} {'GB/s':>8} {'of copy':>8} {'vs eager':>9}")
    for r in rows:
        shape = "%dx%d" % r["shape"]
        copy_bw = r["bytes"] / r["copy_us"] / 1e3
        for name, key in (("copy", "copy_us"), ("eager", "eager_us"), ("torch.compile", "compile_us"), ("triton", "triton_us")):
            if key not in r:
                continue
            traffic = r["bytes"] * (10 / 6 if name == "eager" else 1)  # eager writes and re-reads silu(g)
            bw = traffic / r[key] / 1e3
            speedup = "" if name == "copy" else f"{r['eager_us'] / r[key]:8.2f}x"
            print(f"{shape:>16} {name:>14} {r[key]:10.1f} {bw:8.0f} {bw / copy_bw:7.0%} {speedup:>9}")
        if "triton_config" in r:
            print(f"{'':>16} {'':>14} triton tiling (block_m, block_n, warps) = {r['triton_config']}")
        for cfg, us in sorted(r.get("sweep", {}).items(), key=lambda kv: kv[1]):
            print(f"{'':>16} {'sweep':>14} {us:10.1f} {r['bytes'] / us / 1e3:8.0f} "
                  f"{r['bytes'] / us / 1e3 / copy_bw:7.0%}  config {cfg}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="Tiny sizes everywhere (automatic without a GPU).")
    p.add_argument("--full", action="store_true", help="Full sizes for the CPU part even without a GPU.")
    p.add_argument("--sweep", action="store_true", help="Also time a few Triton tilings per shape.")
    p.add_argument("--no-compile", action="store_true", help="Skip torch.compile.")
    p.add_argument("--json", type=Path, help="Also write the raw numbers to this file.")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    tiny = args.tiny or (not cuda and not args.full)
    cpu_rows = cpu_bench(TINY_SHAPES if tiny else CPU_SHAPES)
    print_cpu(cpu_rows)
    device = torch.device("cuda" if cuda else "cpu")
    dev_rows = device_bench(
        GPU_SHAPES if cuda and not args.tiny else TINY_SHAPES,
        device,
        sweep=args.sweep,
        compile_=cuda and not args.no_compile,
    )
    print_device(dev_rows, device)
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_rows, "device": device.type, "rows": dev_rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
