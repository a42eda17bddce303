"""The texts verify has two tokenizers encode (``tokenization``): short, varied, fixed.

Each exercises something a tokenizer conversion gets wrong in its own way: merge ranks (prose, code, repeated
pieces), the dummy-prefix space of sentencepiece vocabularies (leading, trailing and runs of spaces, text right
after a special token), byte fallback (emoji, scripts a small vocabulary lacks), pre-tokenizer splits (digits,
contractions, punctuation, case), and special tokens written in the text. The empty text is there: both sides
must add the same special tokens to nothing.

A's own special tokens are written into the texts that hold ``{bos}`` or ``{eos}`` (``SPECIAL``; a text whose
token A has none of is left out, and the count says so), not fixed strings such as ``</s>``: llama.cpp makes a
token whose text looks like an end of turn (``</s>``, ``<|endoftext|>``, ``<|im_end|>``, ...) a control token
in any vocabulary, whatever type the GGUF gives it, so a literal ``</s>`` in text is one special token to it
where transformers reads three pieces (measured on the qwen2 vocabulary, whose ``</s>`` is an ordinary token):
a difference of llama.cpp's, made for every conversion alike, not of the file. ChatML and Mistral's
instruction markers are in the texts as they are: special tokens in the vocabularies that have them, text in
the others, on both sides.
"""

from __future__ import annotations

CORPUS: tuple[str, ...] = (
    # prose
    "The quick brown fox jumps over the lazy dog.",
    "Hello world",
    "Tokenizers rank their merges: the first merge that applies wins, so order is meaning.",
    "I'm sure you're right: they've done it, haven't they? We'll see; it'd be fine.",
    # spaces and line breaks: the dummy prefix, whitespace pieces
    " Hello world",
    "Hello world ",
    "a    b",
    "  two leading spaces, and three   inside",
    "   ",
    "line one\nline two\n\n\nline five",
    "\n",
    "tabs\tand\t\ttabs",
    "windows\r\nline ends\r\n",
    "Mixed\u00a0non-breaking\u2009thin\u200bzero-width spaces",
    # other scripts and bytes
    "Grüße aus München, ça va? Où est la bibliothèque?",
    "naïve café résumé coöperate",
    "Привет, мир! Как дела?",
    "日本語のテキストと中文文本。",
    "한국어 문장입니다.",
    "مرحبا بالعالم",
    "Emoji: 🦙🚀👍🏽 and ✨ flags 🇫🇷",
    # code and structured text
    "def gelu(x):\n    return 0.5 * x * (1 + torch.tanh(x))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    '{"key": [1, 2, 3], "nested": {"ok": true, "v": null}}',
    "https://example.com/path?query=1&x=%20y#frag",
    "CamelCaseIdentifier snake_case_name SCREAMING_CASE kebab-case",
    "!!!??? ... --- *** ### @@@",
    # numbers
    "3.14159 2.71828 1,000,000 -42 0x1F 1e-5 2024-01-31 12:34:56",
    "1234567890 9876543210 000 0001",
    # repeated pieces
    "A" * 40,
    "ab" * 25,
    # special tokens written in the text
    "{bos} text after the bos token{eos}",
    "{eos}{bos}",
    "<|endoftext|><|im_start|>user\nhi<|im_end|>",
    "[INST] question [/INST] answer",
    # the shortest
    "x",
    "",
)

SPECIAL = {"{bos}": "bos_token", "{eos}": "eos_token"}  # placeholder -> the attribute of A's tokenizer filling it


def texts(tokenizer) -> tuple[tuple[str, ...], list[str]]:
    """``CORPUS`` with A's special tokens written in (``SPECIAL``), and the placeholders A has no token for
    (the texts holding one are left out)."""
    out, lacking = [], []
    for text in CORPUS:
        for mark, attr in SPECIAL.items():
            token = getattr(tokenizer, attr, None) if mark in text else None
            if mark in text and not token:
                lacking.append(attr)
                break
            text = text.replace(mark, str(token)) if token else text
        else:
            out.append(text)
    return tuple(out), sorted(set(lacking))
