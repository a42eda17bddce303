"""A as B's client would load it (``Client.pairing``): the tensors its load computes from A's, which verify
compares B's with, decided before any comparison."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .checks.outside import Derived


class Pairing(ABC):
    """A as B's client would load it: the tensors its load computes from A's (renamed, derived, folded), which B
    stores as computed. ``verify`` compares B's tensors with those, not with A's as stored: decided before any
    comparison (``computed`` for the FFNs, ``derives`` outside them) and compared once, never compared by name
    first and forgiven after."""

    @abstractmethod
    def computed(self, names: list[str]) -> set[str]:
        """Those of A's tensors ``names`` (its FFNs') that the client computes and B's view reads back by name."""

    @abstractmethod
    def read(self, name: str) -> "torch.Tensor":
        """A's tensor ``name`` as the client computes it (one of ``computed``'s)."""

    def describe(self, names: list[str]) -> str:
        """The note saying that A's tensors ``names`` were compared as the client computes them."""
        return (f"{len(names)} of A's FFN tensors compared as B's client computes them from A when it loads it, "
                "not as A stores them")

    def derives(self, a_names: frozenset[str], b_names: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        """Of the tensors outside the FFNs (A's ``a_names``, B's ``b_names``), before any is compared: B's that the
        client's load computes from A's otherwise than by name (``compare`` compares them with what it computes,
        never by name with A's), and A's that its load uses or drops (B has no tensor of that name). The default:
        none, every tensor compared by name."""
        return frozenset(), frozenset()

    def compare(self, names: list[str], compare: Callable) -> tuple[list["Derived"], list[str]]:
        """B's tensors ``names`` (``derives``'s), each compared once with what the client computes from A: the
        outcomes and the notes saying how. ``compare(name, a, b, bits) -> why or None`` is the outside check's
        criterion."""
        return [], []
