"""A's tokenizer and a GGUF's, compared by what they do: the same texts (``corpus.CORPUS``) encoded by A's
transformers tokenizer and by llama.cpp from the GGUF's vocabulary.

Comparing ``tokenizer.ggml.tokens`` id by id (``gguf_checks.compare_tokenizer``) cannot see how the pieces are
chosen: the scores a sentencepiece vocabulary ranks its merges by, the merges of a byte-level BPE one, the
pre-tokenizer llama.cpp picks from ``tokenizer.ggml.pre``, whether a space is prefixed. llama.cpp's own
convert_hf_to_gguf.py, given a sentencepiece Llama with tokenizer.json and no tokenizer.model, writes score -1000
for every token and no merges; the tokens are right and llama.cpp tokenizes many texts otherwise (measured on
the tiny llama-spm model of the tests: 16 of the 37 texts here). So llama.cpp itself tokenizes (llama-cpp-python's
``Llama(vocab_only=True)``: no weight is read) in a process of its own (``llama_cpp_run``: a crash of llama.cpp
is a line here), each side adding the special tokens its own settings say (transformers' ``encode``, llama.cpp's
``add_special``) and reading special tokens written in the text as such. One differing text fails.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

from ffn_tools.checks.tokens import TokenizationResult

from ffn_tools.checks import corpus
from ffn_tools.checks.tokenizer_behaviour import transformers_tokenizer
from ffn_tools.errors import pip_install

SHOWN = 16  # token ids shown of each side of the first differing text
TEXT_SHOWN = 60  # characters shown of it


def _text(text: str) -> str:
    return repr(text[:TEXT_SHOWN]) + ("..." if len(text) > TEXT_SHOWN else "")


def _ids(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:SHOWN]))
    return f"[{shown}{', ...' if len(ids) > SHOWN else ''}] ({len(ids)} tokens)"


def compare_tokenization(root_a: Path, gguf: Path, fields: dict) -> TokenizationResult:
    """The built-in corpus (``corpus.texts``) tokenized by A's tokenizer (transformers' ``AutoTokenizer`` from
    ``root_a``) and by llama.cpp from the GGUF at ``gguf`` (``fields``: its metadata).

    Returns:
        The result: a problem naming the first differing text, both token lists and how many texts differ; a
        problem when llama.cpp could not tokenize (it died, or refused the vocabulary); ``skipped`` when A has
        no tokenizer transformers loads, B has no ``tokenizer.ggml.tokens``, or llama-cpp-python is missing.
    """
    res = TokenizationResult()
    try:
        tok = transformers_tokenizer(root_a)
    except Exception as e:  # noqa: BLE001 - no tokenizer files, or ones transformers cannot read
        res.skipped = f"A has no tokenizer transformers loads from {root_a} ({type(e).__name__})"
        return res
    if not fields.get("tokenizer.ggml.tokens"):
        res.skipped = "B has no tokenizer.ggml.tokens"
        return res
    if importlib.util.find_spec("llama_cpp") is None:  # it is imported in the child only
        res.skipped = f"llama-cpp-python is not installed here: {pip_install('gguf')}"
        return res
    from .llama_cpp_run import run

    texts, res.lacking = corpus.texts(tok)
    res.left_out = len(corpus.CORPUS) - len(texts)
    a = [list(tok.encode(t)) for t in texts]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "texts.json").write_text(json.dumps(list(texts), ensure_ascii=False), encoding="utf-8")
        try:
            run("--tokenize", str(gguf), str(Path(d) / "texts.json"), str(Path(d) / "ids.json"))
        except RuntimeError as e:
            res.problems.append(f"llama.cpp could not tokenize with B's vocabulary: {e}")
            return res
        b = json.loads((Path(d) / "ids.json").read_text())
    res.compared = len(texts)
    res.differ = [(t, x, y) for t, x, y in zip(texts, a, b) if x != y]
    if res.differ:
        t, x, y = res.differ[0]
        res.problems.append(f"{len(res.differ)} of {len(texts)} texts tokenize differently in llama.cpp (B) than "
                            f"in A's transformers tokenizer; first: {_text(t)}: A {_ids(x)}, B {_ids(y)}")
    return res
