"""``convert --to gguf --outtype q4_k_m`` against the two-step llama.cpp path, in one run.

The two-step path is what a llama.cpp user runs: convert_hf_to_gguf.py --outtype bf16, then llama-quantize on
that file (here ``llama_model_quantize``, the function the llama-quantize binary calls, through llama-cpp-python:
the binary is not in its wheel), then the bf16 file removed. ffn-tools runs the same quantizer on its own
converter file. Each path runs in its own process tree (alternating, best time and largest peak RSS of any
process kept), the outputs are compared byte for byte (ffn-tools' recipe passed to the reference as
llama-quantize's --override-kv would), and the ratios ffn-tools / two-step are printed against the targets
(time <= 0.7x, peak RSS <= 0.5x). The checkpoint is bench_gguf.py's (``--size small``: 0.2 GB; ``1g``: 1.3 GB).

    .venv/bin/python benchmarks/bench_kquant.py [--size 1g] [--outtype q4_k_m] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf import LLAMA_CPP, against, best_runs, bf16_source, finish  # noqa: E402
from bench_mlx import DATA  # noqa: E402

TARGETS = {"time": 0.7, "rss": 0.5}  # ffn-tools / two-step
# the two-step path in one process tree: convert_hf_to_gguf.py, llama_model_quantize (as llama-quantize, with the
# recipe as --override-kv), the intermediate removed
TWO_STEP = r"""
import ctypes, json, os, subprocess, sys
a = json.loads(sys.argv[1])
subprocess.run([sys.executable, a["converter"], a["src"], "--outfile", a["mid"], "--outtype", "bf16"], check=True,
               env={**os.environ, "PYTHONPATH": a["llama_cpp"]}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
code = subprocess.run([sys.executable, "-c", '''
import ctypes, json, sys
import llama_cpp
a = json.loads(sys.argv[1])
quiet = llama_cpp.llama_log_callback(lambda *x: None)  # kept alive: llama.cpp calls it
llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + a["ftype"])
kv = (llama_cpp.llama_model_kv_override * (len(a["kv"]) + 1))()
for o, (k, v) in zip(kv, a["kv"].items()):
    o.key, o.tag, o.value.val_str = k.encode(), llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, v.encode()
p.kv_overrides = ctypes.cast(kv, type(p.kv_overrides))
sys.exit(llama_cpp.llama_model_quantize(a["mid"].encode(), a["out"].encode(), ctypes.byref(p)))
''', sys.argv[1]]).returncode
os.unlink(a["mid"])
sys.exit(code)
"""


def main() -> None:
    from ffn_tools.converters.gguf import kquant

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("small", "1g"), default="1g")
    ap.add_argument("--outtype", nargs="+", default=["q4_k_m"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path, help="Also write the figures here.")
    args = ap.parse_args()
    src = bf16_source(args.size)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; input {src} ({size / 1e9:.2f} GB bf16)")
    out = DATA / "kquant-out"
    out.mkdir(parents=True, exist_ok=True)
    results, ok = {}, True
    for outtype in args.outtype:
        recipe = kquant.recipe(outtype, "bf16", None, None, None)
        ref_args = {"converter": str(LLAMA_CPP / "convert_hf_to_gguf.py"), "llama_cpp": str(LLAMA_CPP),
                    "src": str(src), "mid": str(out / "ref-bf16.gguf"), "out": str(out / "ref.gguf"),
                    "ftype": kquant.FTYPES[outtype], "kv": recipe}
        cmds = {"ffn": [str(Path(sys.executable).parent / "ffn-tools"), "-q", "convert", str(src), "--to", "gguf",
                        "-o", str(out / "ffn.gguf"), "--outtype", outtype, "--force"],
                "two-step": [sys.executable, "-c", TWO_STEP, json.dumps(ref_args)]}
        best = best_runs(cmds, args.repeat, out / "unused")
        results[outtype], met, line = against(best, "ffn", "two-step", TARGETS, f"{outtype:<7}", out)
        ok = ok and met
        print(line)
    finish(results, ok, args.json)


if __name__ == "__main__":
    main()
