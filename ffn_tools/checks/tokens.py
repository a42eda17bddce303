"""Texts through two tokenizers: what one check of them found (the comparison is the client's: llama.cpp
tokenizes a GGUF's vocabulary, ``converters.gguf.tokenization``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from . import Check


@dataclass
class TokenizationResult(Check):
    """The corpus through both tokenizers: how many texts were compared, which differ (``problems``: the
    differences as sentences, or the tokenizer's failure), or why none was."""

    name: ClassVar[str] = "tokenization"

    compared: int = 0
    differ: list[tuple[str, list[int], list[int]]] = field(default_factory=list)  # (text, A's ids, B's ids)
    left_out: int = 0  # texts of the corpus not compared: they need a special token A has none of
    lacking: list[str] = field(default_factory=list)  # those tokens
    what: str = "A's transformers tokenizer vs llama.cpp on B's vocabulary"

    def line(self) -> str:
        if self.skipped:
            return f"tokenization: not compared ({self.skipped})"
        out = (f" ({self.left_out} left out: A has no {' or '.join(self.lacking)})" if self.left_out else "")
        if self.differ:
            return (f"tokenization ({self.what}): {len(self.differ)} of {self.compared} texts of the built-in "
                    f"corpus tokenize differently{out}")
        if self.problems:
            return f"tokenization ({self.what}): not compared: {self.problems[0]}"
        return (f"tokenization ({self.what}): all {self.compared} texts of the built-in corpus tokenize the "
                f"same{out}")

    def as_dict(self) -> dict:
        return {"compared": self.compared, "left_out": self.left_out, "lacking": self.lacking, "what": self.what,
                "skipped": self.skipped, "problems": self.problems,
                "differ": [{"text": t, "a": a, "b": b} for t, a, b in self.differ],
                "passed": self.verdict}  # not compared: no verdict
