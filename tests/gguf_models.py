"""Tiny real checkpoints with real tokenizers, and their GGUFs as llama.cpp's own converter writes them.

llama.cpp's converter, its ``conversion/`` package, vendored ``gguf-py`` and vocabularies
(``models/ggml-vocab-*.gguf``) are installed with the dev extra at ``sys.prefix/llama.cpp`` (``LLAMA_CPP``);
a test that needs them fails loudly when they are not there. A tiny model gets a real tokenizer offline from
one of those vocabularies (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, then ``save_pretrained``),
which the converter recognises; its vocabulary size is the tokenizer's. Families whose converter reads a
sentencepiece ``tokenizer.model`` (Phi-3, Gemma 2/3) get one trained here on a few lines of text
(``sentencepiece_tokenizer``: 384 pieces), with the family's special pieces, loaded by the family's transformers
tokenizer. A large real vocabulary (Qwen's, Llama 3's) only where a test checks the tokenizer (``VOCABS``): the
rest of a tiny model is a few MB, a 150K-token vocabulary's embedding and tokenizer files are tens.

convert_hf_to_gguf.py runs from one process per test process that imported its modules once
(``converter_server``), each conversion a fork of it: the converter's own file, without 3 s of imports each.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import tiny_models

LLAMA_CPP = Path(sys.prefix) / "llama.cpp"
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"
# tiny_models arch -> the vocabulary llama.cpp ships for its family, where the tokenizer is what a test checks
# (Llama's sentencepiece; Qwen's byte-level BPE, 151,936 tokens), else the smallest one its converter accepts:
# Qwen3-MoE's and DeepSeek-V2's converters read a byte-level BPE whose pre-tokenizer they recognise, GPT-2's
# (50,257 tokens). Qwen2 keeps Qwen's: transformers gives a qwen2 model type its own tokenizer class, whose
# pre-tokenizer (digits one by one) the converter recognises only with Qwen's vocabulary.
VOCABS = {"llama": "llama-spm", "mistral": "llama-spm", "mixtral": "llama-spm", "qwen2": "qwen2", "qwen3": "qwen2",
          "qwen3_moe": "gpt-2"}
# tiny_models arch -> (transformers tokenizer class, sentencepiece special pieces: the family's ids; Gemma's
# tokenizer also wants a <mask>, which the converter takes only from the sentencepiece model)
SENTENCEPIECE = {  # arch -> (transformers tokenizer, trainer's special pieces, the tokenizer's settings)
    "phi3": ("LlamaTokenizer", dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1), {"add_bos_token": True}),
    "gemma2": ("GemmaTokenizer", dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                                      bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=["<mask>"]),
               {"add_bos_token": True}),  # as Gemma's own tokenizer_config.json (llama.cpp adds it too)
}
SENTENCEPIECE["gemma3"] = SENTENCEPIECE["gemma2"]
TEXT = ("The quick brown fox jumps over the lazy dog. A checkpoint holds tensors and a tokenizer.",
        "Feed-forward layers compute down(silu(gate(x)) * up(x)). Numbers 0123456789 and , . ; : ! ?",
        "llama.cpp reads GGUF files; transformers reads safetensors. Gemma, Phi and Qwen are families.")
# DeepSeek-V3 on Llama 3's vocabulary: the GGUF -> torch test checks its tokenizer
VOCABS.update({"deepseek_v3": "llama-bpe", "deepseek_v2": "gpt-2"})


def require_llama_cpp() -> Path:
    """``LLAMA_CPP``, asserting the dev install put llama.cpp's converter there."""
    assert CONVERTER.is_file(), (f"{CONVERTER} is missing: `make install` puts llama.cpp's converter and vocabularies "
                                 f"at sys.prefix/llama.cpp")
    return LLAMA_CPP


def build(arch: str, path: Path, dtype: torch.dtype = torch.float32, **shape) -> Path:
    """A tiny ``arch`` checkpoint in ``path`` whose tokenizer is llama.cpp's vocabulary for its family, or a
    sentencepiece model trained for it (``SENTENCEPIECE``); ``shape``: config values over the tiny ones."""
    from transformers import AutoTokenizer

    if arch in SENTENCEPIECE:
        tok = sentencepiece_tokenizer(arch, path)
        if arch == "phi3":  # Phi-3 ships Llama 2's tokenizer.json
            llama2_normalizer(tok)
    else:
        vocab = require_llama_cpp() / "models" / f"ggml-vocab-{VOCABS[arch]}.gguf"
        tok_files = vocab_files(vocab)
        tok = AutoTokenizer.from_pretrained(tok_files)
    cfg_name, model_name, extra = tiny_models.ARCHS[arch]
    import transformers

    n = len(tok)
    ids = {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = getattr(transformers, cfg_name)(**{**tiny_models.COMMON, **extra, **shape, "vocab_size": n,
                                                **{k: v for k, v in ids.items() if v is not None}})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    if arch in SENTENCEPIECE:
        tok.save_pretrained(path)
    else:  # the files as the GGUF-read tokenizer saved them (reloaded, Qwen's gains an NFC normalizer)
        for f in tok_files.iterdir():
            shutil.copy(f, path / f.name)
    if VOCABS.get(arch) == "llama-spm":  # the sentencepiece-trained families have none
        llama2_sentencepiece(tok, vocab, path)
    return path


def vocab_files(vocab: Path) -> Path:
    """A directory with the tokenizer files (``save_pretrained``) of the transformers tokenizer that llama.cpp's
    vocabulary ``vocab`` makes: read from the GGUF once per test run (15 s for Qwen's 151,936 tokens, 3 s for
    Llama's) into the run's shared directory (``$FFN_TOOLS_TEST_SHARED``, set by conftest), reused after (the
    same files; loading them takes under a second)."""
    from transformers import AutoTokenizer

    def make(tmp: Path) -> None:
        AutoTokenizer.from_pretrained(vocab.parent, gguf_file=vocab.name).save_pretrained(tmp)

    shared = os.environ.get("FFN_TOOLS_TEST_SHARED")
    if not shared:  # outside pytest (a benchmark, a script): no cache
        out = Path(tempfile.mkdtemp(prefix=f"{vocab.stem}-"))
        make(out / "tok")
        return out / "tok"
    from helpers import once

    return once(Path(shared) / f"tokenizer-{vocab.stem}", make)


def sentencepiece_tokenizer(arch: str, path: Path):
    """A real sentencepiece BPE model (384 pieces, 256 of them byte fallback) trained on ``TEXT`` with the
    special ids of ``arch``'s family, as ``path/tokenizer.model``, loaded by the family's transformers tokenizer
    (which ``build`` saves beside it: tokenizer.json, tokenizer_config.json)."""
    import sentencepiece
    import transformers

    cls, ids, settings = SENTENCEPIECE[arch]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(TEXT * 20), model_writer=model, vocab_size=384,
                                             model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                             num_threads=1, minloglevel=2, **ids)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(model.getvalue())
    return getattr(transformers, cls).from_pretrained(path, **settings)


def convert_reference(model: Path, out: Path, outtype: str, *extra: str) -> Path:
    """``out``: ``model`` converted by llama.cpp's convert_hf_to_gguf.py (it puts its vendored gguf-py first
    on its own path), run by this process's converter server (``converter_server``)."""
    log = out.with_name(out.name + ".log")
    code = _server().convert([str(model), "--outfile", str(out), "--outtype", outtype, *extra], log)
    assert code == 0, f"convert_hf_to_gguf.py exited {code}: " + log.read_text()[-3000:]
    log.unlink()
    return out


class _Server:
    """A ``converter_server`` process (with llama.cpp's tree on its path), started at the first conversion."""

    def __init__(self):
        root = require_llama_cpp()
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("converter_server.py")),
                                      str(CONVERTER)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        atexit.register(self.close)

    def close(self) -> None:
        """End the server (its input closed, it exits) and reap it."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait()

    def convert(self, argv: list[str], log: Path) -> int:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the converter server exited ({self.proc.poll()})"
        return json.loads(line)["code"]


_SERVER: list[_Server] = []


def _server() -> _Server:
    if not _SERVER or _SERVER[0].proc.poll() is not None:
        _SERVER[:] = [_Server()]
    return _SERVER[0]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def llama2_sentencepiece(tok, vocab: Path, path: Path) -> None:
    """Give the model in ``path`` the two tokenizer files a Llama 2 checkpoint ships, built from the sentencepiece
    vocabulary ``vocab`` (llama.cpp's ``ggml-vocab-llama-spm.gguf``) by the code GGUF -> torch writes them with
    (``converters.gguf.sidefiles``): ``tokenizer.model``, a sentencepiece ``ModelProto`` of its tokens, scores and
    token types with Llama 2's specs, which convert_hf_to_gguf.py reads (``_set_vocab_sentencepiece``), and
    ``tokenizer.json`` as Llama 2's tokenizes (``tok``, transformers' GGUF reading, with sentencepiece's
    normalizer: ▁ always prepended, spaces replaced, no pre-tokenizer; the reader's Metaspace prepends only
    where the text does not start with a space, unlike sentencepiece and llama.cpp)."""
    from ffn_tools.converters.gguf.header import Reader
    from ffn_tools.converters.gguf.reader import field_values
    from ffn_tools.converters.gguf.sidefiles import sentencepiece_model

    (path / "tokenizer.model").write_bytes(sentencepiece_model(field_values(Reader(vocab))))
    llama2_normalizer(tok)
    tok.save_pretrained(path)


def llama2_normalizer(tok) -> None:
    """Llama 2's tokenizer.json normalizer on ``tok`` (▁ always prepended, spaces replaced, no pre-tokenizer), as
    sentencepiece and llama.cpp tokenize; transformers' own Metaspace prepends ▁ only where the text does not
    start with a space."""
    from ffn_tools.converters.gguf.sidefiles import spm_normalizer

    spm_normalizer(tok.backend_tokenizer)
