"""``--ray`` on a 3-node local Ray cluster against one process, in one run: verify of a pair and fuse-gateup.

Builds (under bench-data/, reused with --keep) bench_scale.py's synthetic Phi-3-mini-shaped bf16 checkpoint A of
``--gb`` GB (shards of at most 2 GB) and its split B (``split-gateup``), reads both once (page cache warm), starts a
``ray.cluster_utils.Cluster`` of 3 nodes (a head and two workers, ``--cpus`` CPUs each: each its own raylet and
worker processes) and times, alternating, in fresh processes:

    verify   ``ffn-tools -q verify A B --no-load-check --json`` (every default), one process, then with
             ``--ray=ADDRESS``: the two reports must be equal but for the backends' wall times
    fuse     ``ffn-tools -q fuse-gateup B -o OUT`` (byte-range copies, the output sharded like B), one process,
             then with ``--ray=ADDRESS``: the two outputs must be byte-identical, file for file

and prints each Ray time over the one-process time (the bar, for verify of a pair of 8 GB or more: at most 1.2x, the
engine's overhead; two cores cannot show a speed-up: three nodes on two cores share them).

    .venv/bin/python benchmarks/bench_ray.py --gb 8 [--rounds 2] [--cpus 1] [--commands verify fuse] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale  # noqa: E402
from bench_resume import digest  # noqa: E402

from ffn_tools.verification.report import without_times  # noqa: E402

FFN = str(Path(sys.executable).parent / "ffn-tools")
DATA = bench_scale.ROOT / "bench-data"
BAR = 1.2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=1, help="CPUs each of the 3 nodes declares")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--commands", nargs="+", choices=("verify", "fuse"), default=["verify", "fuse"])
    args = ap.parse_args()
    layers = bench_scale.layers_for("phi3", args.gb)
    a = DATA / f"scale-phi3-{layers}l"
    b = a.with_name(a.name + "-split")
    py = sys.executable
    subprocess.run([py, bench_scale.__file__, "--build-only", str(a), "--shape", "phi3", "--layers", str(layers)],
                   check=True)
    if not (b / "config.json").is_file():
        subprocess.run([FFN, "-q", "split-gateup", str(a), "-o", str(b), "--force"], check=True)
    bench_scale._warm(a), bench_scale._warm(b)
    size = sum(f.stat().st_size for f in a.glob("*.safetensors")) / 1e9

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.cpus, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=args.cpus)
    cluster.wait_for_nodes()
    ray = f"--ray={cluster.address}"
    out1, outr = DATA / "ray-one" / "fused", DATA / "ray-many" / "fused"
    runs = {"verify": [FFN, "-q", "verify", str(a), str(b), "--no-load-check", "--json"],
            "fuse": [FFN, "-q", "fuse-gateup", str(b), "--force"]}
    runs = {k: v for k, v in runs.items() if k in args.commands}
    best: dict[tuple[str, bool], float] = {}
    texts: dict[tuple[str, bool], str] = {}
    try:
        for _ in range(args.rounds):
            for name, cmd in runs.items():
                for distributed in (False, True):
                    full = [*cmd, *(["-o", str(outr if distributed else out1)] if name == "fuse" else []),
                            *([ray] if distributed else [])]
                    dt, _, text = bench_scale.timed(full)  # a verify that does not pass fails the benchmark
                    best[(name, distributed)] = min(best.get((name, distributed), float("inf")), dt)
                    texts[(name, distributed)] = text
    finally:
        cluster.shutdown()
    if "verify" in runs:
        one_report, ray_report = (json.loads(texts[("verify", d)]) for d in (False, True))
        print(f"verify reports equal but for wall times: {without_times(one_report) == without_times(ray_report)} "
              f"({one_report['summary'][:60]})")
    if "fuse" in runs:
        print(f"fuse outputs byte-identical: {digest(out1) == digest(outr)}")
    for name in runs:
        one, many = best[(name, False)], best[(name, True)]
        print(f"{size:.2f} GB a side, {name}: one process {one:.1f} s, 3-node Ray {many:.1f} s = {many / one:.2f}x"
              + (f" (bar <= {BAR}x)" if name == "verify" else ""))
    for d in (out1.parent, outr.parent):
        shutil.rmtree(d, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(a), shutil.rmtree(b)


if __name__ == "__main__":
    main()
