"""The prompts ``verify --generate`` runs both models on, and how a Hugging Face tokenizer turns them into ids.

The built-in set (``PROMPTS``) is short and varied (a question, an instruction, arithmetic, code, a completion,
another language; then text in CJK, Hangul and Arabic scripts and a tool call as chat templates write one, where
tokenizer and byte-fallback defects show before they show in English): each side's client runs all of them, so a
small set keeps the cost to seconds on the tests' tiny models and to a few forward passes on a real one. ``--prompts
FILE`` replaces it: one prompt per line, or a JSON list of strings, or JSON lines with a ``prompt`` (or ``text``)
field.

Where a side has a chat template, each prompt is one user message rendered by it with the generation prompt
added, and tokenized without adding special tokens again (``apply_chat_template``'s own way, and
llama-cpp-python's for a GGUF's ``tokenizer.chat_template``); without one, the text is tokenized as it is, the
tokenizer adding its special tokens (BOS) as it says.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import FFNToolsError

PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "What is 12 times 7?",
    "Translate 'good morning' into German.",
    "def add(a, b):",
    "Once upon a time, there was a",
    # where tokenizer and byte-fallback defects show first (vllm#54150: U+FFFD in a Hangul probe, none in English)
    "长城有多长？日本の首都はどこですか。",
    "한국의 수도는 어디입니까?",
    "ما هي عاصمة مصر؟",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>',
)
NEW_TOKENS = 16  # greedy tokens generated per prompt by default


def load_prompts(path: str | Path | None) -> list[str]:
    """The prompts of ``--prompts FILE`` (see the module docstring), or the built-in set for None.

    Raises:
        FFNToolsError: the file cannot be read, holds no prompt, or a JSON entry is not text.
    """
    if path is None:
        return list(PROMPTS)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FFNToolsError(f"--prompts {path}: cannot read it ({e})") from None
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise FFNToolsError(f"--prompts {path}: not a JSON list ({e})") from None
    elif stripped.startswith("{"):
        try:
            rows = [json.loads(line) for line in stripped.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise FFNToolsError(f"--prompts {path}: not JSON lines ({e})") from None
        items = [r.get("prompt", r.get("text")) if isinstance(r, dict) else r for r in rows]
    else:
        items = [line for line in text.splitlines() if line.strip()]
    bad = [i for i, p in enumerate(items) if not isinstance(p, str) or not p]
    if bad or not items:
        raise FFNToolsError(f"--prompts {path}: " + (f"entry {bad[0] + 1} is not a non-empty text" if bad
                                                     else "holds no prompt"))
    return items


def hf_prompt_ids(tokenizer, prompts: list[str]) -> tuple[list[list[int]], bool]:
    """Each prompt's ids through a transformers ``tokenizer``: a user message in its chat template where it has
    one (the generation prompt added, no special tokens added again), else the text with its special tokens.
    Returns (ids, templated)."""
    if getattr(tokenizer, "chat_template", None):
        out = []
        for p in prompts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in transformers 5
                ids = ids["input_ids"]
            out.append([int(i) for i in ids])
        return out, True
    return [[int(i) for i in tokenizer.encode(p)] for p in prompts], False


def greedy(prompt: list[int], new_tokens: int, eos: set[int], run) -> list[int]:
    """``prompt`` continued greedily: ``run(ids)`` gives the logits of the last position after feeding ``ids``
    (the whole prompt first, then one token at a time: the client keeps its cache); stops after ``new_tokens``
    tokens or at a token of ``eos``, which is kept."""
    seq = list(prompt)
    logits = run(list(prompt))
    for _ in range(new_tokens):
        token = int(logits.argmax())
        seq.append(token)
        if token in eos or len(seq) - len(prompt) == new_tokens:
            break
        logits = run([token])
    return seq


def pieces(decode, sequences: list[list[int]], logits: list) -> dict[int, str]:
    """The text ``decode(id)`` gives of every id in ``sequences`` and of each position's most likely token."""
    ids = {int(t) for s in sequences for t in s}
    for rows in logits:
        ids.update(int(t) for t in rows.argmax(-1))
    return {t: decode(t) for t in sorted(ids)}
