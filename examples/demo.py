"""The ffn-tools demo: a tiny real Phi-3 checkpoint, split, fused back, converted, checked.

Builds the checkpoint with transformers' own Phi3Config + save_pretrained (no downloads), then runs the
ffn-tools command line on it exactly as a user would, printing each command first. Run: ``make demo``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

BIN = Path(sys.executable).parent / "ffn-tools"


def run(*args: str, expect: int = 0) -> None:
    print(f"\n$ ffn-tools {' '.join(args)}", flush=True)
    code = subprocess.run([str(BIN), *args]).returncode
    if code != expect:
        raise SystemExit(f"demo: expected exit status {expect}, got {code}")
    if expect:  # a FAIL the demo sets out to show: said to be one, so that nobody reads it as the demo breaking
        print(f"(exit status {code}: the failure this step of the demo shows)")


def swap_gate_up(src: Path, dst: Path) -> None:
    """A broken copy of a Phi-3: in every layer's fused gate_up_proj the gate and up halves trade places."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(src / "model.safetensors")
    for name in [n for n in t if n.endswith("mlp.gate_up_proj.weight")]:
        gate, up = t[name].chunk(2)
        t[name] = torch.cat([up, gate]).contiguous()
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})


def main() -> None:
    from transformers import Phi3Config, Phi3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar for one tiny file

    work = Path(tempfile.mkdtemp(prefix="ffn-tools-demo-"))
    try:
        config = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
        torch.manual_seed(0)
        Phi3ForCausalLM(config).to(torch.bfloat16).save_pretrained(work / "phi3")
        print(f"built a tiny bf16 Phi-3 in {work / 'phi3'} with transformers")
        run("inspect", str(work / "phi3"))
        run("split-gateup", str(work / "phi3" / "model.safetensors"), "--dry-run")
        print("\nA file inside a checkpoint directory is split into a sibling directory (phi3-split/), with the "
              "config and tokenizer: a second weight file beside the input would break it for loaders.")
        run("split-gateup", str(work / "phi3" / "model.safetensors"), "--load-check")
        run("fuse-gateup", str(work / "phi3-split"), "-o", str(work / "phi3-fused"), "--load-check")
        run("extract", str(work / "phi3"), "-o", str(work / "phi3-ffn"), "--layers", "1")
        run("convert", "--hf-path", str(work / "phi3"), "--mlx-path", str(work / "phi3-mlx-q4"), "-q", "--q-bits", "4",
            "--q-group-size", "32")
        run("convert", str(work / "phi3-split"), "--to", "flax", "-o", str(work / "phi3-flax"))
        print("\nThe split Phi-3 keeps Phi-3's config.json: its FFN weights are exact, but transformers would load it "
              "with fresh FFNs, and verify says so (it is a form for MLX- or llama.cpp-style consumers).")
        run("verify", str(work / "phi3"), str(work / "phi3-split"), "--backend", "reference", expect=1)
        run("verify", str(work / "phi3"), str(work / "phi3-split"), "--no-load-check")
        run("verify", str(work / "phi3"), str(work / "phi3-fused"), "--backend", "reference")
        run("verify", str(work / "phi3"), str(work / "phi3-mlx-q4"), "--backend", "reference", "--backend", "mlx")
        run("verify", str(work / "phi3"), str(work / "phi3-flax"), "--backend", "reference", "--backend", "jax")
        print("\nEvery output carries a receipt (the command, its options, every source and output file's BLAKE3 "
              "digest): an output checked against it, without the source.")
        run("verify", "--receipt", str(work / "phi3-mlx-q4"))
        print("\nNow a conversion that silently swaps gate and up: it loads, but verify catches it.")
        swap_gate_up(work / "phi3", work / "phi3-swapped")
        run("verify", str(work / "phi3"), str(work / "phi3-swapped"), "--backend", "reference", expect=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
