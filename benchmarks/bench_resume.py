"""--resume after SIGKILL at random points, and what the resume ledger costs an uninterrupted run, in one run.

Input: the 1.1 GB bf16 Llama-shaped checkpoint of bench_mlx.py (built under bench-data/ if missing). The command
is ``fuse-gateup`` (byte-range copies: the cheapest command, so the ledger's share is largest) and, with
``--mlx``, ``convert --to mlx -q`` (4-bit: each shard costs quantization, which a resume does not redo).

1. Cost of the ledger: the command into one output file's worth of shards (``--max-shard-size`` above the model:
   one shard, never hashed) against the same into ``--shard`` MB shards (each finished shard hashed, SHA-256, by a
   background thread while the next is written), best of ``--repeat``, both against ``cp -r``.
2. Kills: ``--kills`` times, a run is started, SIGKILLed (``kill -9``) after a random delay within the full run's
   time, then continued with ``--resume``, possibly killed again (half the time), until done. Every output is
   compared, file for file, byte for byte, with the uninterrupted run's; the time of the runs that finished the
   job after a kill is printed against a full run (what resuming saved).

    .venv/bin/python benchmarks/bench_resume.py [--kills 10] [--shard 100] [--repeat 3] [--mlx] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mlx  # noqa: E402
from bench_mlx import DATA, measure  # noqa: E402

SRC = DATA / "llama-1g-bf16"
FFN = str(Path(sys.executable).parent / "ffn-tools")
CP = shutil.which("cp") or "/bin/cp"


def digest(d: Path) -> dict[str, str]:
    out = {}
    for p in sorted(d.iterdir()):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        out[p.name] = h.hexdigest()
    return out


def command(kind: str, out: Path, shard_mb: int) -> list[str]:
    args = ["fuse-gateup", str(SRC)] if kind == "fuse" else ["convert", str(SRC), "--to", "mlx", "-q"]
    return [FFN, "-q", *args, "-o", str(out), "--max-shard-size", f"{shard_mb}MB"]


def run_killed(cmd: list[str], delay: float) -> bool:
    """Run ``cmd``; SIGKILL it after ``delay`` seconds. True if it was killed (False: it finished first)."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        p.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        p.wait()
        return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--shard", type=int, default=100, help="Output shard size, MB.")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mlx", action="store_true", help="Also convert --to mlx -q (4-bit).")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not SRC.exists():
        bench_mlx.build(SRC)
    work = DATA / "resume-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    rng = random.Random(args.seed)
    size = sum(p.stat().st_size for p in SRC.iterdir())
    print(f"input: {SRC} ({size / 1e9:.2f} GB); output shards of {args.shard} MB; seed {args.seed}")
    for kind in ["fuse", *(["mlx"] if args.mlx else [])]:
        ref, out = work / f"{kind}-ref", work / f"{kind}-out"
        copy = [CP, "-r", "--reflink=never", str(SRC), str(work / "cp")]  # the bytes copied, not a clone
        cp = min(measure(copy, work / "cp")[0] for _ in range(args.repeat))
        one = min(measure(command(kind, ref, 100_000), ref)[0] for _ in range(args.repeat))
        full = min(measure(command(kind, ref, args.shard), ref)[0] for _ in range(args.repeat))
        want = digest(ref)
        print(f"\n{kind}: cp -r {cp:.2f} s; one shard (no ledger hashing) {one:.2f} s = {one / cp:.2f}x cp; "
              f"{sum(n.endswith('.safetensors') for n in want)} shards (each hashed) {full:.2f} s = "
              f"{full / cp:.2f}x cp: the ledger costs "
              f"{full / one:.2f}x")
        same, finishing = 0, []
        for k in range(args.kills):
            shutil.rmtree(out, ignore_errors=True)
            delay = rng.uniform(0.05, 0.95) * full
            killed = run_killed(command(kind, out, args.shard), delay)
            runs = 0
            while not out.exists():  # --resume, killed again half the time, until it finishes
                cmd = [*command(kind, out, args.shard), "--resume"]
                if rng.random() < 0.5 and not run_killed(cmd, rng.uniform(0.05, 0.95) * full):
                    break
                if not out.exists():
                    t0 = time.perf_counter()
                    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    if r.returncode:
                        sys.exit(f"--resume failed: {r.stderr}")
                    finishing.append(time.perf_counter() - t0)
                runs += 1
            ok = digest(out) == want
            same += ok
            print(f"  kill {k + 1}: at {delay:.2f} s ({'killed' if killed else 'finished first'}), {runs} resumed "
                  f"run(s): {'byte-identical' if ok else 'DIFFERS'}")
        print(f"{kind}: {same} of {args.kills} byte-identical to the uninterrupted run"
              + (f"; a finishing --resume took {sum(finishing) / len(finishing) / full:.2f}x a full run on average"
                 if finishing else ""))
        if same != args.kills:
            sys.exit(1)
    shutil.rmtree(work, ignore_errors=True)
    print(f"\n(hashing a shard: SHA-256 at ~{hash_rate() / 1e9:.1f} GB/s on this machine, off the writing thread)")


def hash_rate() -> float:
    data = os.urandom(64 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return len(data) / (time.perf_counter() - t0)


if __name__ == "__main__":
    main()
