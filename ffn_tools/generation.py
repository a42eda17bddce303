"""Prompts run by one client (``Client.generate``): the ids, where they stop, the logits, as that client made them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Generation:
    """Prompts run by one client (``Client.generate``).

    Attributes:
        client: the client's name.
        prompts: each prompt's token ids as this client makes them (its tokenizer, its chat template).
        templated: whether a chat template made them.
        eos: the token ids at which this client's generation stops (what it reads: generation_config.json,
            config.json, a GGUF's end-of-generation tokens).
        sequences: the ids run: each prompt followed by its greedy continuation (the stop token included where
            one was generated), or the sequences the caller gave to score.
        starts: where each sequence's continuation starts (its prompt's length).
        logits: each sequence's next-token logits at every position, float32 (positions, vocabulary).
        pieces: the text of each token id in ``sequences`` and of each position's most likely token.
    """

    client: str
    prompts: list[list[int]]
    templated: bool
    eos: list[int]
    sequences: list[list[int]]
    starts: list[int]
    logits: list["np.ndarray"]
    pieces: dict[int, str] = field(default_factory=dict)

    def piece(self, token: int) -> str:
        return self.pieces.get(token, f"<{token}>")
