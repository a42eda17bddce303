"""``verify`` on a ~1 GB bf16 checkpoint against its split version: FFN GEMM throughput vs plain torch matmul.

Builds (or reuses, under bench-data/) a Phi-3-shaped bf16 checkpoint with safetensors directly: d_model 2048,
d_ffn 5632, 12 layers, fused ``gate_up_proj``, embeddings (~0.96 GB), and its split version made with
``ffn_tools.gateup.split_gateup``. For each configuration (backends, tokens) it then times, alternating for
a few rounds (best of each):

    verify(A, B)          the library call the CLI makes, end to end: open, pair, read both checkpoints,
                          bit-exact check, A on the float64 reference, B on each backend, metrics
    GEMMs inside verify   the time verify spends in F.linear (the reference's and torch backends' GEMMs)
    plain torch matmuls   F.linear of exactly the GEMMs verify runs (x (T, H) by gate and up (I, H), then
                          (T, I) by down (H, I)), in the dtype each run computes in (float64 for the
                          reference, bfloat16 for B on a torch-GEMM backend), on weights already in memory

and prints the FFN GEMMs' achieved GFLOP/s (their FLOPs over each time) as a fraction of the plain
matmuls'. Target: >= 0.7 end to end. B on the reference reuses A's float64 output when the weights are
bit-identical (they are, for a split), so only A's reference run and B's non-reference runs count.

Default configurations: the reference alone at 256 and 1024 tokens (verify's own cost: reading two
checkpoints and the float64 reference), and reference + Triton at 256 tokens. On a CPU the Triton
activation runs in Triton's interpreter (numpy, about as slow per element as the bf16 GEMM around it), so
that line says what the interpreter costs, not what Triton does on a GPU. MLX and JAX run their own GEMMs
(MLX's CPU GEMM is ~10x slower than torch's); add them with --config reference,mlx,jax:256.

    .venv/bin/python benchmarks/bench_verify.py [--config reference:256 ...] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU-only machines

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

D, I, LAYERS, VOCAB = 2048, 5632, 12, 32064


def build(path: Path, layers: int = LAYERS) -> Path:
    """The fused bf16 checkpoint, written shard by shard with safetensors.torch.save_file (reused if there)."""
    if (path / "model.safetensors.index.json").is_file():
        return path
    import torch
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    groups = [list(range(k, min(k + 4, layers))) for k in range(0, layers, 4)]
    weight_map = {}
    for n, group in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        sd = {"model.embed_tokens.weight": w(VOCAB, D), "model.norm.weight": w(D)} if n == 0 else {}
        for layer in group:
            p = f"model.layers.{layer}."
            sd.update({p + "mlp.gate_up_proj.weight": w(2 * I, D), p + "mlp.down_proj.weight": w(D, I),
                       p + "input_layernorm.weight": w(D), p + "post_attention_layernorm.weight": w(D)})
        save_file(sd, tmp / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sd, name))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": D, "intermediate_size": I,
              "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 32,
              "vocab_size": VOCAB, "hidden_act": "silu", "dtype": "bfloat16", "tie_word_embeddings": True}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, path)
    return path


def matmul_seconds(tokens: int, dtype, ffns: int, reps: int = 2) -> float:
    """Time of ``ffns`` FFNs' three GEMMs as plain F.linear in ``dtype`` (two weight sets, alternating,
    so the weights come from memory as in verify, not from a warm cache). Best of ``reps``."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, D, generator=gen).to(dtype)
    sets = [[torch.randn(I, D, generator=gen).to(dtype), torch.randn(I, D, generator=gen).to(dtype),
             torch.randn(D, I, generator=gen).to(dtype)] for _ in range(2)]
    h = torch.randn(tokens, I, generator=gen).to(dtype)
    F.linear(x, sets[0][0])  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for k in range(ffns):
            g, u, d = sets[k % 2]
            F.linear(x, g), F.linear(x, u), F.linear(h, d)
        best = min(best, time.perf_counter() - t0)
    return best


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


class GemmTimer:
    """Wraps torch.nn.functional.linear (what the reference, the Triton backend and verify's fused path
    call) to add up the time verify spends inside its GEMMs."""

    def __init__(self):
        import torch.nn.functional as F

        self.F, self.orig, self.seconds = F, F.linear, 0.0

    def __enter__(self):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return self.orig(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        self.F.linear = timed
        return self

    def __exit__(self, *exc):
        self.F.linear = self.orig


def run_config(src: Path, split: Path, backends: list[str], tokens: int, rounds: int) -> dict:
    """Time verify(src, split) and the plain matmuls it runs; best of ``rounds``."""
    import torch

    from ffn_tools.api import verify
    from ffn_tools.verification.functional import SAME_AS_A

    verify(src, split, backends=backends, tokens=4, layers="0", load_check=False)  # imports, JIT caches
    walls, gemms, base = [], [], {torch.float64: float("inf"), torch.bfloat16: float("inf")}
    per_backend: dict[str, float] = {}
    for _ in range(rounds):
        for dt in base:
            base[dt] = min(base[dt], matmul_seconds(tokens, dt, LAYERS))
        with GemmTimer() as gt:
            t0 = time.perf_counter()
            report = verify(src, split, backends=backends, tokens=tokens, load_check=False)  # a split Phi-3:
            # not a form transformers loads (the load check's own cost is measured in scope_overhead)
            walls.append(time.perf_counter() - t0)
        gemms.append(gt.seconds)
        if not report.passed:
            raise SystemExit("verify failed on a correct split:\n" + "\n".join(report.lines()))
        for b in backends:
            s = sum(x.seconds for r in report.results for x in r.backends if x.backend == b)
            per_backend[b] = min(per_backend.get(b, float("inf")), s)
    # what ran, per FFN: A on the reference (float64), then B on each backend unless it reused A's output
    ran = {"A on reference": torch.float64}
    for b in backends:
        if {x.path for r in report.results for x in r.backends if x.backend == b} != {SAME_AS_A}:
            ran[f"B on {b}"] = torch.float64 if b == "reference" else torch.bfloat16
    per_run = 2 * tokens * D * I * 3 * LAYERS
    return {"backends": backends, "tokens": tokens, "ran": ran, "gflop": per_run * len(ran) / 1e9,
            "plain": sum(base[dt] for dt in ran.values()), "gemm": min(gemms), "wall": min(walls),
            "per_backend": {b: (per_backend[b], base[ran[f"B on {b}"]], per_run / 1e9)
                            for b in backends if f"B on {b}" in ran}}


def scope_overhead(src: Path, split: Path, tokens: int, rounds: int) -> tuple[float, float, float]:
    """Best wall time of verify with the FFNs alone (--ffn-only --no-load-check), with every tensor accounted
    for (the default outside comparison), and with the load check too (B is a split Phi-3: it fails that
    check, which is timed all the same)."""
    from ffn_tools.api import verify

    verify(src, split, backends=["reference"], tokens=4, layers="0")  # imports transformers once
    best = [float("inf")] * 3
    for _ in range(rounds):
        for k, kw in enumerate(({"ffn_only": True, "load_check": False}, {"load_check": False}, {})):
            t0 = time.perf_counter()
            verify(src, split, backends=["reference"], tokens=tokens, **kw)
            best[k] = min(best[k], time.perf_counter() - t0)
    return tuple(best)


def model_checks(src: Path, split: Path, rounds: int) -> float:
    """Best time of the checks of the model around the weights that verify runs beside them: both configs
    through transformers' config class, and the side files (tokenizer, generation_config)."""
    from ffn_tools.clients import runtime
    from ffn_tools.converters import open_any

    best = float("inf")
    with open_any(src) as ca, open_any(split) as cb:
        client = runtime(cb.format)
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            client.compare_config(ca, cb), client.compare_side_files(ca, cb)
            best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", dest="configs", metavar="BACKENDS:TOKENS",
                    help="e.g. reference:256 or reference,triton:256 (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data")
    args = ap.parse_args()
    configs = [(c.split(":")[0].split(","), int(c.split(":")[1]))
               for c in (args.configs or ["reference:256", "reference:1024", "reference,triton:256"])]

    import torch

    from ffn_tools.gateup import split_gateup

    src = build(args.data / "verify-phi3-12l")
    split = args.data / "verify-phi3-12l-split"
    if not (split / "model.safetensors.index.json").is_file():
        split_gateup(src, split, force=True)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"A: {src} ({size / 1e9:.2f} GB bf16, {LAYERS} FFNs of d_model {D}, d_ffn {I}, fused gate_up)")
    print(f"B: {split} (split_gateup: bit-identical FFNs, so B on the reference reuses A's output)")
    print(f"best of {args.rounds} rounds; {torch.get_num_threads()} torch threads; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"\n{'backends':<22}{'tokens':>7}{'GFLOP':>8}{'plain s':>9}{'GEMMs s':>9}{'verify s':>9}"
          f"{'GEMMs/plain':>13}{'verify/plain':>14}")
    results = []
    for backends, tokens in configs:
        r = run_config(src, split, backends, tokens, args.rounds)
        results.append(r)
        print(f"{','.join(backends):<22}{tokens:>7}{r['gflop']:>8.1f}{r['plain']:>9.2f}{r['gemm']:>9.2f}"
              f"{r['wall']:>9.2f}{r['plain'] / r['gemm']:>13.2f}{r['plain'] / r['wall']:>14.2f}", flush=True)
    print("\n(x/plain = achieved GFLOP/s as a fraction of plain torch matmuls of the same GEMMs; "
          "GEMMs = F.linear time inside verify)")
    for r in results:
        for b, (t, plain, gflop) in r["per_backend"].items():
            print(f"{','.join(r['backends'])}:{r['tokens']}: B on {b}, whole ffn() calls: {t:.2f} s, "
                  f"{gflop / t:.1f} GFLOP/s = {plain / t:.2f} of plain {_name(r['ran'][f'B on {b}'])} matmuls")
    verdicts = [f"{','.join(r['backends'])}:{r['tokens']} {r['plain'] / r['wall']:.2f} "
                f"{'met' if r['plain'] / r['wall'] >= 0.7 else 'NOT met'}" for r in results]
    print(f"target >= 0.7 end to end: {'; '.join(verdicts)}")
    ffn, outside, loads = scope_overhead(src, split, 256, args.rounds)
    print(f"\nscope (reference:256): FFNs only {ffn:.2f} s; + every tensor outside the FFNs {outside:.2f} s "
          f"({outside / ffn:.2f}x); + the load check {loads:.2f} s ({loads / ffn:.2f}x); target <= 1.2x")
    model = model_checks(src, split, args.rounds)
    print(f"model checks (config, side files): {model:.3f} s of verify's {loads:.2f} s: verify with them / "
          f"without {loads / (loads - model):.3f}x; target <= 1.2x")

if __name__ == "__main__":
    main()
