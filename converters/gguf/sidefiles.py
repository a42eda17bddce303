"""The files transformers and mlx_lm read beside the weights, rebuilt from a GGUF's metadata for ``convert x.gguf
--to torch|mlx``: the tokenizer from ``tokenizer.ggml.*`` and generation_config.json from its token ids.

The tokenizer is transformers' own GGUF tokenizer reader (``from_pretrained(..., gguf_file=...)``) saved by
``save_pretrained``, with one repair. A sentencepiece vocabulary (``tokenizer.ggml.model`` "llama") stores no
merges: transformers derives them, ranked by ``tokenizer.ggml.scores``. llama.cpp's convert_hf_to_gguf.py,
given a checkpoint with tokenizer.json and no tokenizer.model, writes LlamaHfVocab's placeholder score -1000
for every token, so every merge ties and transformers ranks them by piece length: measured on a tiny Llama with
llama.cpp's llama-spm vocabulary, 241 of 244 single-spaced prose snippets then tokenize differently from the
source. A BPE vocabulary lists each merged token after its parts, in merge order (tokenizers' trainer appends
them so; sentencepiece's BPE scores fall with the id), so when the scores carry no rank the merges are ranked by
token position instead: 0 of the 244 differ, only runs of spaces can (the source may rank its whitespace pieces
apart, which the GGUF no longer says). The summary says when this was done.

Tokens transformers' reader adds that the GGUF does not have are left out (``rebuilt_tokens.invented``): its
byte-level builder is GPT-2's tokenizer class, whose default special token ``<|endoftext|>`` it appends after the
last id of a vocabulary without one (Llama 3's 128,256 tokens become 128,257, one more than the model's embedding
rows). A padding token the vocabulary holds as an ordinary token stays one (``rebuilt_tokens.ordinary_pad``).

generation_config.json is what transformers writes for a model built from the config (``GenerationConfig.
from_model_config``): bos/eos/pad ids from ``tokenizer.ggml.*_token_id``, so generate() stops at the GGUF's eos;
with the sampling settings the GGUF stores (``general.sampling.*``: what llama.cpp samples with by default, written
by convert_hf_to_gguf.py from the source's generation_config.json, ``SAMPLING``) and ``do_sample: true``, as
llama.cpp samples with them (transformers uses them only when sampling).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ffn_tools.errors import FFNToolsError
from ffn_tools.io import nogc
from ffn_tools.io.store import Checkpoint

from .rebuilt_tokens import repaired

# GGUF architectures transformers' GGUF model loader refuses ("not supported yet"), which AutoTokenizer asks
# first: their tokenizer is read by the fast tokenizer itself (the class AutoTokenizer gives DeepSeek's models).
GENERIC_TOKENIZER = frozenset({"deepseek2"})
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # what generation_config.json takes from the config
RERANKED = ("tokenizer.json: the GGUF stores no merge ranks ({why}), so its {n} merges are ranked by token "
            "position (a BPE vocabulary lists merged tokens in merge order); runs of spaces may tokenize "
            "differently from the model the GGUF was made from")


def side_files(ckpt: Checkpoint) -> tuple[dict[str, str | bytes], list[str]]:
    """The tokenizer files and generation_config.json for ``ckpt`` (a GGUF), name -> text, and what the
    summary says about them."""
    files, changes = tokenizer_files(ckpt)
    fields = getattr(ckpt, "fields", {})
    sampling = sampling_settings(fields)
    gen = generation_config(ckpt.config or {}, sampling)
    if gen is not None:
        files["generation_config.json"] = gen
        changes.append("generation_config.json written from the GGUF's token ids "
                       f"({', '.join(k for k in TOKEN_IDS if k in (ckpt.config or {}))}) as transformers does")
        if sampling:
            changes.append(f"generation_config.json: {', '.join(f'{k} {v}' for k, v in sampling.items())} from the "
                           "GGUF's general.sampling.*, and do_sample true: llama.cpp samples with them")
    else:
        changes.append("no generation_config.json: the GGUF names no bos, eos or padding token")
    return files, changes


def tokenizer_files(ckpt: Checkpoint) -> tuple[dict[str, str | bytes], list[str]]:
    """The GGUF's tokenizer as the files transformers saves, name -> text (empty when it has none), and what
    the summary says about them."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    fields = getattr(ckpt, "fields", {})
    if "tokenizer.ggml.tokens" not in fields:
        return {}, ["no tokenizer files: the GGUF has no tokenizer.ggml.tokens"]
    path = Path(ckpt.files[0])
    reader = PreTrainedTokenizerFast if fields.get("general.architecture") in GENERIC_TOKENIZER else AutoTokenizer
    opened = (getattr(ckpt, "readers", None) or [None])[0]  # the file's header, parsed when it was opened
    with header_reader(opened), nogc.paused():  # 2.1M values of a 128K-token vocabulary made into Python objects
        tok = reader.from_pretrained(path.parent, gguf_file=path.name)
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        files: dict[str, str | bytes] = {p.name: p.read_text("utf-8") for p in Path(d).iterdir() if p.is_file()}
        said = generic_class(Path(d), files, fields)
    changes = ["tokenizer files written from the GGUF's tokenizer.ggml.* by transformers' GGUF reader", *said]
    changes += repaired(files, fields)  # invented tokens left out, an ordinary padding token made ordinary
    why = ranks_lost(fields)
    if why and "tokenizer.json" in files:
        files["tokenizer.json"], n = rank_by_position(str(files["tokenizer.json"]))
        changes.append(RERANKED.format(why=why, n=n))
    if fields.get("tokenizer.ggml.model") == "llama" and "tokenizer.json" in files:
        changes += sentencepiece_files(fields, files)
    return files, changes


@contextmanager
def header_reader(opened: Any = None) -> Iterator[None]:
    """transformers' GGUF reader parses the file faster meanwhile, to the same values:

    - where it asks gguf-py for the file ``opened`` (a ``header.Reader`` in read mode) already holds, with that
      reader: its header is not parsed again (a Llama 3 GGUF's tokenizer read in 6.8 s of CPU instead of 9.3:
      ``load_gguf_checkpoint`` parses the whole header for the config it makes beside the tokenizer);
    - where it reads through gguf-py (``load_gguf_checkpoint`` imports ``gguf.GGUFReader`` when it runs), with
      ``header.Reader``: the same fields and parts (tests/test_gguf.py checks them equal on real files), a Llama 3
      vocabulary's in 0.5 s instead of 7.8 s (reading the tokenizer of a 128K-token GGUF took transformers 10.5 s);
    - where it has its own reader (``transformers.integrations.gguf.reader``, transformers 5), over a plain
      ``ndarray`` view of its memory map rather than the ``np.memmap`` itself: each of the 400K strings of a Llama 3
      vocabulary is a slice, and a memmap's slice runs Python code (``__array_finalize__``): 0.60 s -> 0.24 s;
    - each value of those fields (``load_gguf_checkpoint``'s ``_gguf_parse_value``: a string made bytes one
      numpy scalar at a time, through a Python list) by ``_parse_value``: the same values, a Llama 3
      vocabulary's tokenizer read in 5.9 s of CPU instead of 7.9.
    """
    import gguf
    import numpy as np

    from .header import Reader

    try:
        from transformers.integrations.gguf import reader as hf_reader
        own: Any = hf_reader
    except ImportError:
        own = None
    hf_gguf: Any = None
    try:
        from transformers import modeling_gguf_pytorch_utils

        hf_gguf = modeling_gguf_pytorch_utils
    except ImportError:
        pass
    parse = getattr(hf_gguf, "_gguf_parse_value", None)
    mapped = getattr(own, "_mapped", None)
    was = gguf.GGUFReader
    same = _file(getattr(opened, "path", None)) if getattr(opened, "mode", None) == "r" else None

    def reader(path, mode="r"):  # what transformers asks of gguf-py's class: the same, from a subclass of it
        return opened if mode == "r" and same is not None and _file(path) == same else Reader(path, mode)

    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    if mapped is not None:
        own._mapped = lambda path: mapped(path).view(np.ndarray)  # the view holds the map open (its base)
    if parse is not None:
        hf_gguf._gguf_parse_value = lambda value, types: _parse_value(value, types, parse)
    try:
        yield
    finally:
        gguf.GGUFReader = was  # type: ignore[misc]
        if mapped is not None:
            own._mapped = mapped
        if parse is not None:
            hf_gguf._gguf_parse_value = parse


def _file(path) -> tuple | None:
    """Which file ``path`` is (device and inode), or None."""
    try:
        st = os.stat(path)
    except (OSError, TypeError):
        return None
    return st.st_dev, st.st_ino


_INTEGERS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})  # GGUF's integer value types, as transformers reads them


def _parse_value(value, types, parse):
    """transformers' ``_gguf_parse_value(value, types)`` (``parse``) for a field's part ``value``: a string or
    an integer, or an array's, made as it makes them (``int(value[0])``; the bytes decoded as UTF-8), whose
    string is one ``tobytes`` rather than a list of numpy scalars; any other value by ``parse`` itself."""
    if type(types) is list and (len(types) == 1 or len(types) == 2 and types[0] == 9):
        kind = types[-1]
        if kind == 8:
            return value.tobytes().decode()
        if kind in _INTEGERS:
            return int(value[0])
    return parse(value, types)


def sentencepiece_files(fields: dict, files: dict[str, str | bytes]) -> list[str]:
    """A sentencepiece vocabulary's two files as a Llama 2 checkpoint ships them, into ``files``:
    tokenizer.json with sentencepiece's normalizer (``spm_normalizer``: transformers' GGUF reader writes a
    Metaspace pre-tokenizer, which prepends ▁ only where the text does not start with a space, so " Hello"
    tokenized otherwise than by llama.cpp and the source), and tokenizer.model (``sentencepiece_model``:
    what convert_hf_to_gguf.py reads back). Returns what the summary says."""
    from tokenizers import Tokenizer

    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    tok = Tokenizer.from_str(str(files["tokenizer.json"]))
    spm_normalizer(tok, prefix)
    files["tokenizer.json"] = tok.to_str(pretty=True)
    said = [f"tokenizer.json: sentencepiece's normalizer ({'▁ prepended, ' if prefix else ''}spaces as ▁, as llama.cpp "
            "tokenizes), not the Metaspace pre-tokenizer transformers' GGUF reader writes"]
    try:
        files["tokenizer.model"] = sentencepiece_model(fields)
    except ImportError:
        return [*said, "no tokenizer.model: writing one needs the sentencepiece package (pip install sentencepiece)"]
    return [*said, "tokenizer.model: a sentencepiece model of the GGUF's pieces, scores and types (BPE, Llama 2's "
                   "specs)"]


def spm_normalizer(tok, prefix: bool = True) -> None:
    """Sentencepiece's (Llama 2's tokenizer.json's) normalizer on a ``tokenizers.Tokenizer``: ▁ prepended
    (``prefix``, the GGUF's add_space_prefix), spaces replaced by ▁, no pre-tokenizer, and the decoder that
    undoes it."""
    from tokenizers import decoders, normalizers

    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if prefix else [])])


def sentencepiece_model(fields: dict) -> bytes:
    """tokenizer.model for a GGUF's sentencepiece vocabulary: a sentencepiece ``ModelProto`` of its tokens,
    scores and token types (numbered alike in both), with Llama 2's specs (BPE, byte fallback where the
    vocabulary has byte pieces, digits split, spaces as ▁, a dummy prefix where add_space_prefix says) and
    its unk/bos/eos ids.

    Raises:
        ImportError: no sentencepiece package.
    """
    import importlib

    pb: Any = importlib.import_module("sentencepiece.sentencepiece_model_pb2")  # protobuf-generated: no stubs

    tokens, scores, types = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    proto = pb.ModelProto()
    for piece, score, kind in zip(tokens, scores, types):
        proto.pieces.add(piece=piece, score=score, type=kind)
    ids = {k: fields.get(f"tokenizer.ggml.{k}_token_id", -1) for k in ("unknown", "bos", "eos")}
    proto.trainer_spec.MergeFrom(pb.TrainerSpec(
        model_type=pb.TrainerSpec.BPE, vocab_size=len(tokens), byte_fallback=6 in types, split_digits=True,
        allow_whitespace_only_pieces=True, unk_id=ids["unknown"], bos_id=ids["bos"], eos_id=ids["eos"], pad_id=-1))
    proto.normalizer_spec.MergeFrom(pb.NormalizerSpec(
        name="identity", add_dummy_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", True)),
        remove_extra_whitespaces=False, escape_whitespaces=True))
    return proto.SerializeToString()


def ranks_lost(fields: dict) -> str | None:
    """Why the GGUF's sentencepiece vocabulary holds no merge ranks, or None when it does (or is no such
    vocabulary: byte-level BPE stores its merges in order, unigram has none)."""
    scores = fields.get("tokenizer.ggml.scores")
    if fields.get("tokenizer.ggml.model") != "llama" or "tokenizer.ggml.merges" in fields or not scores:
        return None
    if len(set(scores)) > 1:
        return None
    return f"no tokenizer.ggml.merges, and all {len(scores)} tokenizer.ggml.scores are {scores[0]:g}"


def rank_by_position(text: str) -> tuple[str, int]:
    """tokenizer.json ``text`` with its BPE merges ranked by the position of the token each makes; several
    merges making one token keep transformers' order for them (longer left piece first). Returns the text as
    tokenizers writes it, and the number of merges."""
    from tokenizers import Tokenizer

    doc = nogc.loads(text)
    model = doc["model"]
    vocab, merges = model["vocab"], model["merges"]
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]  # older writers: "a b"
    made = [vocab.get(left + right) for left, right in pairs]
    if None in made:  # transformers derives each merge from a token it splits: one that makes none is not its
        i = made.index(None)
        raise FFNToolsError(f"tokenizer.json rebuilt from the GGUF: merge {pairs[i]} makes no token of the vocabulary")
    order = sorted(range(len(pairs)), key=lambda i: (made[i], -len(pairs[i][0])))
    model["merges"] = [merges[i] for i in order]
    return Tokenizer.from_str(json.dumps(doc)).to_str(pretty=True), len(merges)


GENERIC = ("PreTrainedTokenizerFast", "TokenizersBackend")  # load tokenizer.json as it is (one class in transformers 5)
# What a model's tokenizer class may rebuild on loading that the GGUF says otherwise (tokenizer.ggml.pre); not
# the normalizer: Qwen2Tokenizer's NFC is Qwen's own (its tokenizer.json has it), which a GGUF does not record
LOADED = ("pre_tokenizer",)


def generic_class(saved: Path, files: dict[str, str | bytes], fields: dict) -> list[str]:
    """``PreTrainedTokenizerFast`` as tokenizer_config.json's class where the class transformers' reader names
    (by architecture) rebuilds what tokenizer.json says on loading: ``Qwen2Tokenizer`` sets Qwen's digit split
    whatever the GGUF's ``tokenizer.ggml.pre`` (a Qwen model with Llama 3's vocabulary would tokenize numbers
    otherwise than llama.cpp). ``saved``: the folder the files were saved in. Returns what the summary says."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    cfg = json.loads(str(files.get("tokenizer_config.json") or "{}"))
    cls = cfg.get("tokenizer_class")
    if not cls or cls in GENERIC or "tokenizer.json" not in files:
        return []
    with nogc.paused():
        loaded = AutoTokenizer.from_pretrained(saved).backend_tokenizer
    written = Tokenizer.from_str(str(files["tokenizer.json"]))
    # each part as the tokenizers library serializes it (not the whole tokenizer: a 128K vocabulary and its merges,
    # dumped and parsed twice, were 2 s of a Llama 3 GGUF's export)
    rebuilt = [k for k in LOADED if _part(loaded, k) != _part(written, k)]
    if not rebuilt:
        return []
    cfg["tokenizer_class"] = GENERIC[0]
    files["tokenizer_config.json"] = json.dumps(cfg, ensure_ascii=False, indent=2) + "\n"
    return [f"tokenizer_config.json: tokenizer_class {GENERIC[0]}, not {cls}: {cls} replaces tokenizer.json's "
            f"pre-tokenizer when it loads, which would not split text as the GGUF's tokenizer.ggml.pre "
            f"{fields.get('tokenizer.ggml.pre')!r} does (llama.cpp)"]


def _part(tokenizer, name: str):
    """A tokenizer's part (``pre_tokenizer``, ...) as the tokenizers library serializes it, parsed; None where it
    has none."""
    part = getattr(tokenizer, name)
    return None if part is None else json.loads(part.__getstate__())


# generation_config.json key -> the GGUF key convert_hf_to_gguf.py writes it to (gguf-py's Metadata.load reads
# generation_config.json; repetition_penalty is llama.cpp's penalty_repeat), float32 in the GGUF
SAMPLING = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
            "top_k": "general.sampling.top_k", "min_p": "general.sampling.min_p",
            "repetition_penalty": "general.sampling.penalty_repeat"}


def sampling_settings(fields: dict) -> dict:
    """The generation settings the GGUF stores (``SAMPLING``), floats as their float32's shortest decimal."""
    import numpy as np

    out = {}
    for key, field in SAMPLING.items():
        if field in fields:
            v = fields[field]
            out[key] = float(str(np.float32(v))) if isinstance(v, float) else v
    return out


def generation_config(config: dict, sampling: dict | None = None) -> str | None:
    """generation_config.json as transformers' ``save_pretrained`` writes it for a model of ``config``, or None
    when the config has no token ids to put in it; with ``sampling`` (``sampling_settings``) the token ids, those
    settings and ``do_sample`` true, as a model's publisher writes it."""
    if not any(config.get(k) is not None for k in TOKEN_IDS):
        return None
    from transformers import AutoConfig, GenerationConfig

    if sampling:
        gen = GenerationConfig(**{k: config[k] for k in TOKEN_IDS if config.get(k) is not None}, do_sample=True,
                               **sampling)
    else:
        gen = GenerationConfig.from_model_config(AutoConfig.for_model(**config))
    with tempfile.TemporaryDirectory() as d:
        gen.save_pretrained(d)
        return (Path(d) / "generation_config.json").read_text("utf-8")
