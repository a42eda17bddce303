"""``--dry-run``'s estimates against the real runs they predict, in one run.

For each size given to ``--gb`` it builds (under bench-data/, reused) bench_scale.py's synthetic Phi-3-mini-shaped
bf16 checkpoint (shards of at most 2 GB), reads it once (page cache warm, as for every run after), then for each
command:

    split   ``split-gateup`` (byte-range copies: the speed of the disk)
    cast    ``convert --to torch --dtype float16`` (every tensor computed)
    mlx4    ``convert --to mlx -q`` (4-bit quantization, worker processes)

runs ``ffn-tools -q CMD --dry-run --json`` (the estimate: a sample of the dry run's own plan streamed in that
process, ``ffn_tools.estimate``) and then the real ``ffn-tools -q CMD`` ``--repeat`` times in fresh processes, timed
(the median: what an estimate predicts is a run, and the runs of one command spread by a third here, with the
kernel's page-cache work), its peak RSS from ``os.wait4`` (the largest process of its tree, as the estimate measures
the dry run's), its output's bytes counted; and prints each
estimate over the measured value (target: within 0.8-1.2 for output bytes, temporary disk, peak RSS and time).

Every run, the estimate's included, starts ``--settle`` seconds after the previous output was removed and synced. On
a virtual machine whose balloon reports free pages to its host (this one: ``bench_scale.page_reporting()``), the host
takes back memory freed a few seconds ago, and the next write into the page cache faults every page in again on the
host: 4 GB written with ``dd`` took 2.3 s right after an ``rm`` of 4 GB, 6.0 s 5 s after, and 12.1 s 20 s after. A
run's time then depends on how long ago the last one ended; settled, every run (and the sample) writes as a run on
an idle machine does (docs/performance.md#dry-run-estimates).

    .venv/bin/python benchmarks/bench_estimate.py --gb 1 4 [--commands split cast mlx4] [--repeat 3] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale  # noqa: E402

FFN = str(Path(sys.executable).parent / "ffn-tools")
DATA = bench_scale.ROOT / "bench-data"
COMMANDS = {
    "split": lambda src, out: ["split-gateup", str(src), "-o", str(out)],
    "cast": lambda src, out: ["convert", str(src), "--to", "torch", "--dtype", "float16", "-o", str(out)],
    "mlx4": lambda src, out: ["convert", str(src), "--to", "mlx", "-q", "-o", str(out)],
}
BAND = (0.8, 1.2)


def run_rss(cmd: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS in bytes (wait4's: the largest process of its tree) and stdout of ``cmd`` in a fresh
    process (``bench_scale.timed``)."""
    dt, mb, out = bench_scale.timed(cmd)
    return dt, int(mb * 2**20), out


def size_of(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--commands", nargs="+", choices=sorted(COMMANDS), default=list(COMMANDS))
    ap.add_argument("--keep", action="store_true", help="keep the built checkpoints")
    ap.add_argument("--repeat", type=int, default=3, help="real runs per command (their median time is compared)")
    ap.add_argument("--settle", type=float, default=None, help=bench_scale.SETTLE_HELP)
    args = ap.parse_args()
    wait = bench_scale.settle_seconds(args.settle)
    print(f"free page reporting: {'on' if bench_scale.page_reporting() else 'off'}; settling {wait:.0f} s before each "
          "run", flush=True)
    rows = []
    for gb in args.gb:
        layers = bench_scale.layers_for("phi3", gb)
        src = DATA / f"estimate-phi3-{layers}l"
        # built in a child: this process stays small (Linux carries a parent's RSS into its children's ru_maxrss)
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                        f"import bench_scale; bench_scale.build(bench_scale.Path({str(src)!r}), 'phi3', {layers})"],
                       check=True)
        bench_scale._warm(src)
        for name in args.commands:
            out = DATA / f"estimate-out-{name}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [FFN, "-q", *COMMANDS[name](src, out)]
            bench_scale.settle(wait)  # every run starts with no earlier run's writes still going to the disk
            _, _, text = run_rss([*cmd, "--dry-run", "--json"])
            est = json.loads(text)["estimate"]
            if not est["made"]:
                raise SystemExit(f"{name}: no estimate ({est['why']})")
            times, rss = [], 0
            for _ in range(args.repeat):  # this machine's runs: their median time (the run an estimate predicts;
                shutil.rmtree(out, ignore_errors=True)  # the same 4 GB cast took 11.9 to 19.2 s), the largest RSS
                bench_scale.settle(wait)
                t, r, _ = run_rss(cmd)
                times.append(t)
                rss = max(rss, r)
            dt = statistics.median(times)
            got = {"output_bytes": size_of(out), "temporary_disk": size_of(out), "peak_rss": rss, "seconds": dt}
            ratios = {k: est[k] / got[k] for k in got}
            rows.append((gb, name, est, got, ratios))
            shutil.rmtree(out, ignore_errors=True)
            print(f"{size_of(src) / 1e9:5.2f} GB {name:6s} " + "  ".join(
                f"{k} {est[k] / (1e6 if k != 'seconds' else 1):.1f}/{got[k] / (1e6 if k != 'seconds' else 1):.1f}"
                f"={ratios[k]:.2f}" for k in got) + f"  (real runs {min(times):.1f}-{max(times):.1f} s; sample "
                f"{est['sample']['reads'] / 1e6:.0f} MB, start-up {est['sample']['startup_seconds']:.1f} s, waiting on "
                f"the disk {est['sample'].get('waits_on_disk', 0):.1f} s)", flush=True)
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
    within = [all(BAND[0] <= r <= BAND[1] for r in ratios.values()) for *_, ratios in rows]
    worst = max((abs(r - 1), k, name, gb) for gb, name, _, _, ratios in rows for k, r in ratios.items())
    print(f"estimates within {BAND[0]}-{BAND[1]} of the real run: {sum(within)} of {len(within)} runs "
          f"(worst: {worst[1]} of {worst[2]} at {worst[3]} GB, off by {worst[0]:.0%})")


if __name__ == "__main__":
    main()
