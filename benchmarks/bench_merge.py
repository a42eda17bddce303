"""Merging a LoRA into the 1.1 GB bf16 Llama-shaped checkpoint of bench_mlx.py: `ffn-tools merge` against `cp -r`
of the base and against PEFT's own path (PeftModel.from_pretrained on the loaded base, merge_and_unload,
save_pretrained), with a rank-16 float32 adapter on every FFN projection and q/v (as PEFT saves one).

The merge's peak RSS is held against the base's largest tensor: the bar is O(largest tensor), so the script prints
the RSS of the merge above that of the same command merging a LoRA of one small tensor (the same imports: torch,
click, safetensors; the same copy of every other tensor), in units of the largest tensor, and measures it again on
a base three times as deep (3.3 GB, the same tensor shapes): flat, it does not grow with the model. Each command runs in its own process;
the best wall time of ``--repeat`` runs and the largest peak RSS are kept; the base is read once first. The merged
output is checked against ``ffn-tools verify BASE+ADAPTER MERGED`` (exit 0).

    .venv/bin/python benchmarks/bench_merge.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dcp import SRC, best, run_dir  # noqa: E402

TARGETS = {"cp": 1.2, "rss": 6.0, "flat": 1.1}  # merge / cp time; (merge RSS - a one-tensor merge's RSS) / largest
# tensor (the adapter's own factors included: 24 MiB here); RSS at 3.3 GB / RSS at 1.1 GB
RANK = 16

PEFT = """
import sys, warnings, torch
warnings.simplefilter("ignore")
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
"""


def make_adapter(base: Path, out: Path, one: bool = False) -> None:
    """A PEFT adapter (float32 factors, rank RANK) on every FFN projection and q/v of ``base``, written by
    ffn-tools' PEFT writer (tests/test_adapters.py holds it to PEFT's own files), in a process of its own: the
    commands measured are forked from this one, and a child's peak RSS counts what it inherits before exec."""
    subprocess.run([sys.executable, __file__, "--make-adapter", str(base), str(out), *(["--one"] if one else [])],
                   check=True)


def _make_adapter(base: Path, out: Path, one: bool) -> None:
    import torch

    from ffn_tools.adapters.formats import get
    from ffn_tools.adapters.model import Adapter, Lora
    from ffn_tools.io.readers import open_checkpoint

    torch.manual_seed(0)
    loras = {}
    with open_checkpoint(base) as ckpt:
        for n in ckpt:
            if n.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "q_proj.weight",
                           "v_proj.weight")):
                o, i = ckpt.info(n).shape
                loras[n] = Lora(n, torch.randn(RANK, i) / i ** 0.5, torch.randn(o, RANK) * 0.01, 2.0, 32.0)
                if one and n.endswith("q_proj.weight"):
                    loras = {n: loras[n]}
                    break
    get("peft").write(Adapter(out, "peft", loras), out)


def deeper(times: int) -> Path:
    """bench_mlx's 1.1 GB Llama with ``times`` as many layers (the same tensor shapes), built once."""
    import bench_mlx

    path = SRC.parent / f"llama-1g-x{times}-bf16"
    if not path.exists():
        print(f"building {path} ...", flush=True)
        bench_mlx.SHAPE = {**bench_mlx.SHAPE, "num_hidden_layers": bench_mlx.SHAPE["num_hidden_layers"] * times}
        bench_mlx.build(path)
    return path


def largest_tensor(base: Path) -> int:
    from ffn_tools.io.safetensors_format import read_header  # the headers alone: no torch in this process

    return max(e.end - e.start for f in base.glob("*.safetensors") for e in read_header(f)[0].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--make-adapter", nargs=2, metavar=("BASE", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_adapter:
        _make_adapter(Path(args.make_adapter[0]), Path(args.make_adapter[1]), args.one)
        return
    py, tool = sys.executable, str(Path(sys.executable).parent / "ffn-tools")
    out, cp = run_dir("bench-merge-out", args.repeat)
    adapter = out / "lora"
    make_adapter(SRC, adapter)
    make_adapter(SRC, out / "one", one=True)
    start = best([py, "-c", "import torch"], out / "none", args.repeat)
    small = best([tool, "-q", "merge", str(SRC), str(out / "one"), "-o", str(out / "small")], out / "small", args.repeat)
    ours = best([tool, "-q", "merge", str(SRC), str(adapter), "-o", str(out / "merged")], out / "merged", args.repeat)
    peft = best([py, "-c", PEFT, str(SRC), str(adapter), str(out / "peft")], out / "peft", 1)
    verdict = subprocess.run([tool, "-q", "verify", f"{SRC}+{adapter}", str(out / "merged"), "--json"],
                             capture_output=True, text=True)
    passed = verdict.returncode == 0 and json.loads(verdict.stdout)["passed"]
    big = largest_tensor(SRC)
    rc, rr = ours[0] / cp[0], (ours[1] - small[1]) / big
    print(f"cp -r            {cp[0]:6.2f} s {cp[1] / 2**20:6.0f} MiB")
    print(f"import torch     {start[0]:6.2f} s {start[1] / 2**20:6.0f} MiB (what either side pays before any work)")
    print(f"merge of 1 LoRA  {small[0]:6.2f} s {small[1] / 2**20:6.0f} MiB (the same command's imports and copies)")
    print(f"ffn-tools merge  {ours[0]:6.2f} s {ours[1] / 2**20:6.0f} MiB | vs cp {rc:.2f}x (target <= {TARGETS['cp']}) "
          f"| RSS above the 1-LoRA merge {rr:.2f}x the largest tensor ({big / 2**20:.0f} MiB; target <= "
          f"{TARGETS['rss']})")
    print(f"PEFT merge       {peft[0]:6.2f} s {peft[1] / 2**20:6.0f} MiB | ffn-tools / PEFT: time "
          f"{ours[0] / peft[0]:.2f}x, RSS {ours[1] / peft[1]:.2f}x")
    print("verify BASE+ADAPTER MERGED: " + ("PASS" if passed else f"FAIL {verdict.stdout[-500:]}"))
    deep = deeper(3)
    make_adapter(deep, out / "deep-lora")
    far = best([tool, "-q", "merge", str(deep), str(out / "deep-lora"), "-o", str(out / "deep")], out / "deep", 1)
    flat = far[1] / ours[1]
    print(f"3.3 GB base      {far[0]:6.2f} s {far[1] / 2**20:6.0f} MiB | RSS / the 1.1 GB merge's {flat:.2f}x "
          f"(target <= {TARGETS['flat']}) | time {far[0] / ours[0]:.2f}x")
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    ok = passed and rc <= TARGETS["cp"] and rr <= TARGETS["rss"] and flat <= TARGETS["flat"]
    print("all targets met" if ok else "TARGET MISSED")


if __name__ == "__main__":
    main()
