"""What ``verify --generate`` adds to ``verify`` on the tests' tiny models, per correct conversion, in one run.

A is the tests' tiny bf16 Llama with a real sentencepiece tokenizer and a chat template (``tests/gguf_models``);
B its MLX bf16, 4-bit MLX, GGUF q8_0 and Flax conversions. Each pair is verified without and with --generate
(alternating, best of ``--repeat``, in this process: the imports are paid once, as in a session running
several), and the seconds --generate adds are printed with the ratio to verify alone and the issue's bar (<= 10 s
added per pair), plus the verdict and the floor it was held against. The added time is three model loads
(A, B and the floor) and their forward passes, and for MLX/GGUF/Flax the floor's re-derivation by ``convert``.

    .venv/bin/python benchmarks/bench_generate.py [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

BAR = 10.0  # seconds --generate may add per pair on the tiny models (issue 35)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
PAIRS = {"mlx bf16": ("mlx", {}), "mlx 4-bit": ("mlx", {"quantize": True}),
         "gguf q8_0": ("gguf", {"outtype": "q8_0"}), "flax": ("flax", {"dtype": "float32"})}


def main() -> None:
    import torch

    import gguf_models
    from ffn_tools import api

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, help="Also write the figures here.")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    try:
        a = gguf_models.build("llama", work / "a", dtype=torch.bfloat16)
        cfg = json.loads((a / "tokenizer_config.json").read_text())
        (a / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
        api.verify(a, a, generate=True)  # imports and first loads paid before anything is timed
        rows = {}
        for label, (to, options) in PAIRS.items():
            b = work / (label.replace(" ", "-") + (".gguf" if to == "gguf" else ""))
            api.convert(a, to, b, **options)
            plain, gen, report = [], [], None
            for _ in range(args.repeat):
                t = time.perf_counter()
                api.verify(a, b)
                plain.append(time.perf_counter() - t)
                t = time.perf_counter()
                report = api.verify(a, b, generate=True)
                gen.append(time.perf_counter() - t)
            assert report is not None and report.generation is not None
            g = report.generation
            added = min(gen) - min(plain)
            rows[label] = {"verify_s": min(plain), "with_generate_s": min(gen), "added_s": added,
                           "ratio": min(gen) / min(plain), "passed": report.passed, "floor": g.floor,
                           "kl_ab_mean": g.stats["kl_ab_mean"], "floor_kl_ab_mean": g.floor_stats.get("kl_ab_mean")}
            print(f"{label:<10} verify {min(plain):5.2f} s, with --generate {min(gen):5.2f} s: +{added:5.2f} s "
                  f"({min(gen) / min(plain):4.2f}x; bar +{BAR:.0f} s: {'met' if added <= BAR else 'MISSED'}); "
                  f"{'PASS' if report.passed else 'FAIL'}, KL(A||B) mean {g.stats['kl_ab_mean']:.3g} against a floor "
                  f"of {g.floor_stats.get('kl_ab_mean', float('nan')):.3g} ({g.floor})")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
