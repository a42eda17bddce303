"""``convert --to gguf`` against llama.cpp's own convert_hf_to_gguf.py on the same checkpoint, in one run.

Builds a Llama-shaped bf16 checkpoint with one of llama.cpp's vocabularies under bench-data/ once (``--size``:
``small``, ~0.2 GB, runs in about a minute on 2 cores; ``1g``, the 1.3 GB benchmark model (32000 tokens);
``llama3-1b``, Llama-3.2-1B's shape, 2.5 GB, its 128256-token vocabulary, embedding tied; ``8g``, Llama-3-8B's
layers and vocabulary with 14 layers, 8.2 GB in 2 shards, written a tensor at a time), runs each tool in
its own process for each outtype (alternating, best time and largest RSS kept), checks the two outputs are the
same file, and prints wall time and peak RSS (the process and its children), and the ratios
ffn-tools / convert_hf_to_gguf.py against the targets (time <= 0.5x, peak RSS <= 0.2x).

    .venv/bin/python benchmarks/bench_gguf.py [--size small|1g|llama3-1b|8g] [--outtype bf16 q8_0] [--repeat 1]

At 8 GB and more the targets are issue 34's: time <= 0.6x, ffn-tools' peak RSS <= 1 GiB.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mlx import DATA, measure  # noqa: E402
from bench_mlx import build as build_streamed  # noqa: E402

LLAMA_CPP = Path(sys.prefix) / "llama.cpp"
SIZES = {"small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4),
         "1g": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=32,
                    num_key_value_heads=4),
         "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, tie_word_embeddings=True),
         "8g": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=14, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256)}
VOCABS = {"llama3-1b": "llama-bpe", "8g": "llama-bpe"}  # else llama-spm
STREAMED = ("8g",)  # built a tensor at a time (bench_mlx.build), not as a model in memory
TARGETS = {"time": 0.5, "rss": 0.2}  # ffn-tools / convert_hf_to_gguf.py (the first GGUF issue's)
# issue 34's, at 8 GB and more (--size 8g): time <= 0.6x, ffn-tools' peak RSS <= 1 GiB
LARGE_TARGETS = {"time": 0.6, "rss": None}
RSS_MAX = 1 << 30


def build(path: Path, shape: dict, vocab_name: str, streamed: bool = False) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vocab = LLAMA_CPP / "models" / f"ggml-vocab-{vocab_name}.gguf"
    tok = AutoTokenizer.from_pretrained(vocab.parent, gguf_file=vocab.name)
    if streamed:
        build_streamed(path, {**shape, "vocab_size": len(tok)}, tok.save_pretrained)
        return
    config = LlamaConfig(**{"tie_word_embeddings": False, **shape}, vocab_size=len(tok), max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)


def best_runs(cmds: dict[str, list[str]], repeat: int, scratch: Path, before=None) -> dict[str, tuple[float, int]]:
    """Each command run ``repeat`` times, the tools alternating (``before(tool)`` first, if given): tool -> (best
    wall seconds, largest peak RSS in bytes)."""
    runs: dict[str, list] = {t: [] for t in cmds}
    for _ in range(repeat):
        for tool, cmd in cmds.items():
            if before is not None:
                before(tool)
            runs[tool].append(measure(cmd, scratch))
    return {t: (min(r[0] for r in rs), max(r[1] for r in rs)) for t, rs in runs.items()}


def against(best: dict, ours: str, theirs: str, targets: dict[str, float], label: str,
            out: Path) -> tuple[dict, bool, str]:
    """The figures of ``ours`` against ``theirs`` (times, RSS, their ratios, whether ``out``'s ffn.gguf and ref.gguf
    are the same file), whether every target is met and the file the same, and the line that says so."""
    same = filecmp.cmp(out / "ffn.gguf", out / "ref.gguf", shallow=False)
    ratio = {"time": best[ours][0] / best[theirs][0], "rss": best[ours][1] / best[theirs][1]}
    met = {k: ratio[k] <= targets[k] if targets[k] is not None else best[ours][1] <= RSS_MAX for k in targets}
    rss_target = f"{targets['rss']}x" if targets["rss"] is not None else "1 GiB for ffn-tools"
    line = (f"{label} ffn-tools {best[ours][0]:6.1f} s {best[ours][1] / 2**20:7.0f} MiB | {theirs} "
            f"{best[theirs][0]:6.1f} s {best[theirs][1] / 2**20:7.0f} MiB | time {ratio['time']:.2f}x "
            f"(target <= {targets['time']}x{'' if met['time'] else ', MISSED'}), RSS {ratio['rss']:.2f}x "
            f"(target <= {rss_target}{'' if met['rss'] else ', MISSED'}); same file: {same}")
    figures = {ours: best[ours], theirs: best[theirs], "ratio": ratio, "same_file": same}
    return figures, same and all(met.values()), line


def finish(results: dict, ok: bool, path: Path | None) -> None:
    """Write the figures to ``path`` (``--json``) and exit 0 where every target was met, else 1."""
    if path:
        path.write_text(json.dumps(results, indent=2))
    sys.exit(0 if ok else 1)


def bf16_source(size: str) -> Path:
    """The bf16 Llama of ``size`` with llama.cpp's sentencepiece vocabulary, built under bench-data/ once."""
    src = DATA / f"llama-{size}-bf16-spm"
    if not src.exists():
        print(f"building {src} ...", flush=True)
        build(src, SIZES[size], "llama-spm")
    return src


def commands(src: Path, outtype: str, out: Path) -> dict[str, list[str]]:
    py = sys.executable
    return {"ffn": [str(Path(py).parent / "ffn-tools"), "-q", "convert", str(src), "--to", "gguf", "-o",
                    str(out / "ffn.gguf"), "--outtype", outtype],
            "llama.cpp": ["/usr/bin/env", f"PYTHONPATH={LLAMA_CPP}", py, str(LLAMA_CPP / "convert_hf_to_gguf.py"),
                          str(src), "--outfile", str(out / "ref.gguf"), "--outtype", outtype]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=tuple(SIZES), default="small")
    ap.add_argument("--outtype", nargs="+", default=["bf16", "q8_0"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path, help="Also write the figures here.")
    args = ap.parse_args()
    vocab = VOCABS.get(args.size, "llama-spm")
    src = DATA / (f"llama-{args.size}-bf16-spm" if vocab == "llama-spm" else f"llama-{args.size}-bf16")
    if not src.exists():
        print(f"building {src} ...", flush=True)
        build(src, SIZES[args.size], vocab, args.size in STREAMED)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; input {src} ({size / 1e9:.2f} GB bf16)")
    results, ok = {}, True
    for outtype in args.outtype:
        out = DATA / "gguf-out"
        out.mkdir(parents=True, exist_ok=True)
        cmds = commands(src, outtype, out)

        def clear(tool: str) -> None:  # the output of the tool about to run
            (out / ("ffn.gguf" if tool == "ffn" else "ref.gguf")).unlink(missing_ok=True)

        best = best_runs(cmds, args.repeat, out / "unused", clear)
        targets = LARGE_TARGETS if size >= 8e9 else TARGETS
        results[outtype], met, line = against(best, "ffn", "llama.cpp", targets, f"{outtype:<5}", out)
        ok = ok and met
        print(line)
    finish(results, ok, args.json)


if __name__ == "__main__":
    main()
