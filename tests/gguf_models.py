"""Tiny real checkpoints with real tokenizers, and their GGUFs as llama.cpp's own converter writes them.

llama.cpp's converter, its ``conversion/`` package, vendored ``gguf-py`` and vocabularies
(``models/ggml-vocab-*.gguf``) are installed with the dev extra at ``sys.prefix/llama.cpp`` (``LLAMA_CPP``);
a test that needs them fails loudly when they are not there. A tiny model gets a real tokenizer offline from
one of those vocabularies (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, then ``save_pretrained``),
which the converter recognises; its vocabulary size is the tokenizer's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import tiny_models

LLAMA_CPP = Path(sys.prefix) / "llama.cpp"
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"
# tiny_models arch -> the vocabulary llama.cpp ships for its family
VOCABS = {"llama": "llama-spm", "mistral": "llama-spm", "mixtral": "llama-spm", "qwen2": "qwen2", "qwen3": "qwen2",
          "qwen3_moe": "qwen2", "phi3": "phi-3"}
VOCABS.update({"deepseek_v3": "llama-bpe", "deepseek_v2": "llama-bpe"})  # its pre-tokenizer the converter knows


def require_llama_cpp() -> Path:
    """``LLAMA_CPP``, asserting the dev install put llama.cpp's converter there."""
    assert CONVERTER.is_file(), (f"{CONVERTER} is missing: `make install` puts llama.cpp's converter and vocabularies "
                                 f"at sys.prefix/llama.cpp")
    return LLAMA_CPP


def build(arch: str, path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny ``arch`` checkpoint in ``path`` whose tokenizer is llama.cpp's vocabulary for its family."""
    from transformers import AutoTokenizer

    vocab = require_llama_cpp() / "models" / f"ggml-vocab-{VOCABS[arch]}.gguf"
    tok = AutoTokenizer.from_pretrained(vocab.parent, gguf_file=vocab.name)
    cfg_name, model_name, extra = tiny_models.ARCHS[arch]
    import transformers

    n = len(tok)
    ids = {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = getattr(transformers, cfg_name)(**{**tiny_models.COMMON, **extra, "vocab_size": n,
                                                **{k: v for k, v in ids.items() if v is not None}})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def convert_reference(model: Path, out: Path, outtype: str, *extra: str) -> Path:
    """``out``: ``model`` converted by llama.cpp's convert_hf_to_gguf.py (it puts its vendored gguf-py first
    on its own path)."""
    root = require_llama_cpp()
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(CONVERTER), str(model), "--outfile", str(out), "--outtype", outtype,
                        *extra], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
