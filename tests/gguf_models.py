"""Tiny real checkpoints with real tokenizers, and their GGUFs as llama.cpp's own converter writes them.

llama.cpp's converter, its ``conversion/`` package, vendored ``gguf-py`` and vocabularies
(``models/ggml-vocab-*.gguf``) are installed with the dev extra at ``sys.prefix/llama.cpp`` (``LLAMA_CPP``);
a test that needs them fails loudly when they are not there. A tiny model's tokenizer is the smallest real one
its family's converter accepts: a sentencepiece model trained here on a few lines of text (``TEXT``: 384 pieces,
``sentencepiece_tokenizer``) with the family's special pieces, loaded by the family's transformers tokenizer, for
the families whose converter reads ``tokenizer.model`` (Llama, Mistral, Mixtral, Phi-3, Gemma 2/3); else one of
those vocabularies (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, then ``save_pretrained``), whose
pre-tokenizer the converter recognises (``VOCABS``). The real vocabulary of a family (Llama's 32,000-token
sentencepiece, Qwen's 151,936-token byte-level BPE, Llama 3's 128,256) only where a test checks the tokenizer
(``REAL_VOCAB``): the rest of a tiny model is a few MB, such a vocabulary's embedding and tokenizer files tens, and
every conversion and verify reads them.

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
# A fixture's name is a tiny_models arch, or one of these: the arch with the real vocabulary of its family, for the
# tests that check the tokenizer
REAL_VOCAB = {"llama-spm": "llama", "deepseek_v3-llama-bpe": "deepseek_v3", "gemma2-identity": "gemma2"}
# name -> the vocabulary llama.cpp ships for its family: Llama's sentencepiece (32,000 tokens), Qwen's byte-level
# BPE (151,936) and Llama 3's (128,256) where a test checks the tokenizer; else the smallest vocabulary the
# family's converter accepts. Qwen3-MoE's and DeepSeek's converters read only a byte-level BPE whose
# pre-tokenizer they recognise: GPT-2's (50,257 tokens). Qwen2 keeps Qwen's: transformers gives a qwen2 model
# type its own tokenizer class, whose pre-tokenizer (digits one by one) the converter recognises only with Qwen's
# vocabulary. The rest read a sentencepiece model trained here (``SENTENCEPIECE``: 384 pieces).
VOCABS = {"llama-spm": "llama-spm", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3_moe": "gpt-2", "deepseek_v3": "gpt-2",
          "deepseek_v2": "gpt-2", "deepseek_v3-llama-bpe": "llama-bpe"}
# name -> (transformers tokenizer class, sentencepiece special pieces: the family's ids; Gemma's tokenizer also
# wants a <mask>, which the converter takes only from the sentencepiece model)
SENTENCEPIECE = {  # name -> (transformers tokenizer, trainer's special pieces, the tokenizer's settings)
    "phi3": ("LlamaTokenizer", dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1), {"add_bos_token": True}),
    "gemma2": ("GemmaTokenizer", dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                                      bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=["<mask>"]),
               {"add_bos_token": True}),  # as Gemma's own tokenizer_config.json (llama.cpp adds it too)
}
SENTENCEPIECE["gemma3"] = SENTENCEPIECE["gemma2"]
# Gemma 2's tokenizer as its publisher's normalizes (identity, spaces kept, no dummy prefix), without <mask> (which
# llama.cpp's converter stores as a normal token): what a GGUF round trip can give back whole
SENTENCEPIECE["gemma2-identity"] = (SENTENCEPIECE["gemma2"][0], {
    **{k: v for k, v in SENTENCEPIECE["gemma2"][1].items() if k != "user_defined_symbols"},
    "normalization_rule_name": "identity", "remove_extra_whitespaces": False, "add_dummy_prefix": False},
    {**SENTENCEPIECE["gemma2"][2], "mask_token": None})  # (GemmaTokenizer would add a <mask> past the model's pieces)
# Llama 2's ids and tokenizer.json (sentencepiece's normalizer: ``llama2_normalizer``), as Phi-3 ships them; the
# Llama family's model also as Llama 2's normalizes (identity, spaces kept), which the converter writes for llama.cpp
LLAMA2 = ("phi3", "llama", "mistral", "mixtral")
SENTENCEPIECE.update(dict.fromkeys(LLAMA2[1:], ("LlamaTokenizer", dict(
    unk_id=0, bos_id=1, eos_id=2, pad_id=-1, normalization_rule_name="identity", remove_extra_whitespaces=False),
    {"add_bos_token": True})))
TEXT = ("The quick brown fox jumps over the lazy dog. A checkpoint holds tensors and a tokenizer.",
        "Feed-forward layers compute down(silu(gate(x)) * up(x)). Numbers 0123456789 and , . ; : ! ?",
        "llama.cpp reads GGUF files; transformers reads safetensors. Gemma, Phi and Qwen are families.")


def require_llama_cpp() -> Path:
    """``LLAMA_CPP``, asserting the dev install put llama.cpp's converter there."""
    assert CONVERTER.is_file(), (f"{CONVERTER} is missing: `make install` puts llama.cpp's converter and vocabularies "
                                 f"at sys.prefix/llama.cpp")
    return LLAMA_CPP


def build(name: str, path: Path, dtype: torch.dtype = torch.float32, **shape) -> Path:
    """A tiny checkpoint of ``name`` (a tiny_models arch, or one of ``REAL_VOCAB``) in ``path`` whose tokenizer
    is a llama.cpp vocabulary (``VOCABS``), or a sentencepiece model trained for it (``SENTENCEPIECE``);
    ``shape``: config values over the tiny ones."""
    from transformers import AutoTokenizer

    if name in SENTENCEPIECE:
        tok = sentencepiece_tokenizer(name, path)
        if name in LLAMA2:
            llama2_normalizer(tok)
        if name in LLAMA2[1:]:  # a llama model type's LlamaTokenizer rebuilds its own Metaspace when it loads:
            # tokenizer.json as the real llama-spm fixture's is, read as it is (TokenizersBackend)
            tok = transformers_fast(tok)
    else:
        vocab = require_llama_cpp() / "models" / f"ggml-vocab-{VOCABS[name]}.gguf"
        tok_files = vocab_files(vocab)
        tok = AutoTokenizer.from_pretrained(tok_files)
    cfg_name, model_name, extra = tiny_models.ARCHS[REAL_VOCAB.get(name, name)]
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
    if name in SENTENCEPIECE:
        tok.save_pretrained(path)
    else:  # the files as the GGUF-read tokenizer saved them (reloaded, Qwen's gains an NFC normalizer)
        for f in tok_files.iterdir():
            shutil.copy(f, path / f.name)
    if VOCABS.get(name) == "llama-spm":  # the sentencepiece-trained families have none
        llama2_sentencepiece(tok, vocab, path)
    return path


def transformers_fast(tok):
    """``tok``'s tokenizers object in transformers' generic fast tokenizer, with its special tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, bos_token=tok.bos_token,
                                   eos_token=tok.eos_token, unk_token=tok.unk_token, add_bos_token=True)


def vocab_files(vocab: Path) -> Path:
    """A directory with the tokenizer files (``save_pretrained``) of the transformers tokenizer that llama.cpp's
    vocabulary ``vocab`` makes: read from the GGUF once per test run as convert reads it (``header_reader``: 2 s for
    Qwen's 151,936 tokens, 15 s through gguf-py's own parse; 1 s for Llama's) into the run's shared directory (``$FFN_TOOLS_TEST_SHARED``, set by conftest), reused after (the
    same files; loading them takes under a second)."""
    from transformers import AutoTokenizer

    from ffn_tools.converters.gguf.sidefiles import header_reader

    def make(tmp: Path) -> None:
        with header_reader():  # what convert reads a GGUF's tokenizer with
            AutoTokenizer.from_pretrained(vocab.parent, gguf_file=vocab.name).save_pretrained(tmp)

    shared = os.environ.get("FFN_TOOLS_TEST_SHARED")
    if not shared:  # outside pytest (a benchmark, a script): no cache
        out = Path(tempfile.mkdtemp(prefix=f"{vocab.stem}-"))
        make(out / "tok")
        return out / "tok"
    from helpers import once

    return once(Path(shared) / f"tokenizer-{vocab.stem}", make)


def sentencepiece_tokenizer(name: str, path: Path):
    """A real sentencepiece BPE model (384 pieces, 256 of them byte fallback) trained on ``TEXT`` with the
    special ids of ``name``'s family, as ``path/tokenizer.model``, loaded by the family's transformers tokenizer
    (which ``build`` saves beside it: tokenizer.json, tokenizer_config.json)."""
    import sentencepiece
    import transformers

    cls, ids, settings = SENTENCEPIECE[name]
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

    def convert(self, argv: list[str], log: Path, script: Path | None = None) -> int:
        """``script`` (default: convert_hf_to_gguf.py) run on ``argv``, forked; its exit status."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log), **({"script": str(script)} if script else {})})
                              + "\n")
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
