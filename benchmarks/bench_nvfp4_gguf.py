"""An NVFP4 checkpoint into GGUF from its codes against dequantizing it and quantizing again through bf16, in one run.

The input is bench_gguf.py's Llama (``--size 1g``: 1.3 GB in bf16) with every Linear but lm_head quantized to
ModelOpt NVFP4 here (round to nearest: a per-tensor scale_2, an F8_E4M3 scale per 16 values, E2M1 codes; what
the benchmark measures is the conversion, not the quantizer). Each path runs in its own process (alternating, best
time and largest peak RSS kept):

- ffn-tools    ``convert --to gguf``: the NVFP4 blocks and scales moved as they are (``converters/gguf/kept.py``)
- requantize   ``convert --to gguf --outtype q4_0`` and ``q4_k_m``: dequantized, a bf16 GGUF, llama.cpp's quantizer
               (llama.cpp's quantizer has no NVFP4 output: the nearest 4-bit types it writes)
- converter    convert_hf_to_gguf.py, which repacks ModelOpt NVFP4 itself (for reference; the same tensors)

and prints the ratios (target: the requantize paths >= 5x ffn-tools' time).

    .venv/bin/python benchmarks/bench_nvfp4_gguf.py [--size 1g] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf import LLAMA_CPP, best_runs, bf16_source, finish  # noqa: E402
from bench_mlx import DATA  # noqa: E402

TARGET = 5.0  # requantizing through bf16 / ffn-tools from codes


def nvfp4(src: Path, out: Path) -> None:
    """``src`` (bf16) with every Linear but lm_head as ModelOpt NVFP4, written to ``out``."""
    import torch
    from safetensors.torch import load_file, save_file

    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    for f in sorted(tmp.glob("*.safetensors")):
        sd = load_file(f)
        for name in [n for n in sd if n.endswith("_proj.weight")]:
            w = sd.pop(name).float()
            rows, cols = w.shape
            scale_2 = (w.abs().amax() / (6 * 448)).clamp(min=1e-12)
            g = w.reshape(rows, cols // 16, 16)
            scale = (g.abs().amax(-1) / 6 / scale_2).clamp(max=448).to(torch.float8_e4m3fn)
            x = g / (scale.float() * scale_2).clamp(min=1e-30)[..., None]
            place = (x.abs()[..., None] - e2m1).abs().argmin(-1)  # nearest E2M1 magnitude
            code = (place + 8 * (x < 0)).to(torch.uint8).reshape(rows, cols)
            sd[name] = code[:, 0::2] | (code[:, 1::2] << 4)
            sd[name.replace(".weight", ".weight_scale")] = scale
            sd[name.replace(".weight", ".weight_scale_2")] = scale_2.reshape(())
        save_file(sd, f, metadata={"format": "pt"})
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                  "exclude_modules": ["lm_head"]}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("small", "1g"), default="1g")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path, help="Also write the figures here.")
    args = ap.parse_args()
    bf16 = bf16_source(args.size)
    src = DATA / f"llama-{args.size}-nvfp4-modelopt"
    if not src.exists():
        print(f"quantizing {src} ...", flush=True)
        nvfp4(bf16, src)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; input {src} ({size / 1e9:.2f} GB, "
          f"NVFP4 and its bf16 embeddings)")
    out = DATA / "nvfp4-out"
    out.mkdir(parents=True, exist_ok=True)
    ffn = str(Path(sys.executable).parent / "ffn-tools")
    cmds = {"ffn-tools": [ffn, "-q", "convert", str(src), "--to", "gguf", "-o", str(out / "codes.gguf"), "--force"],
            "requantize q4_0": [ffn, "-q", "convert", str(src), "--to", "gguf", "-o", str(out / "q4_0.gguf"),
                                "--outtype", "q4_0", "--force"],
            "requantize q4_k_m": [ffn, "-q", "convert", str(src), "--to", "gguf", "-o", str(out / "q4_k_m.gguf"),
                                  "--outtype", "q4_k_m", "--force"],
            "converter": ["/usr/bin/env", f"PYTHONPATH={LLAMA_CPP}", sys.executable,
                          str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(src), "--outfile", str(out / "ref.gguf")]}
    best = best_runs(cmds, args.repeat, out / "unused")
    base = best["ffn-tools"][0]
    results = {t: {"seconds": b[0], "peak_rss": b[1], "x_ffn_tools": b[0] / base} for t, b in best.items()}
    ok = all(results[t]["x_ffn_tools"] >= TARGET for t in results if t.startswith("requantize"))
    for t, b in best.items():
        print(f"{t:<18} {b[0]:7.1f} s {b[1] / 2**20:7.0f} MiB  {b[0] / base:5.2f}x ffn-tools' time")
    print(f"requantizing through bf16 >= {TARGET}x ffn-tools' time: {'met' if ok else 'MISSED'}")
    finish(results, ok, args.json)


if __name__ == "__main__":
    main()
