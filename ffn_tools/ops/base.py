"""The ``Op`` base: one step of how an output tensor is made, as data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .views import View


@dataclass(frozen=True)
class Op:
    """One step: a list of tensors in, a list of tensors out (``apply``). A frozen dataclass, picklable.

    Subclasses override what they have: ``reverse`` (the op undoing it bit for bit), ``runs`` (the output's byte
    runs, for a pure move), ``elementwise``/``into`` (a cast), ``placement``/``shares`` (a quantizing worker).
    """

    def apply(self, ts: list) -> list:
        raise NotImplementedError

    def reverse(self) -> "Op | None":
        """The op with ``reverse().apply(self.apply(ts)) == ts`` bit for bit, or None where it has none."""
        return None

    def describe(self) -> str:
        """How it moves or changes the tensors, for --dry-run."""
        return type(self).__name__.lower()

    def pull(self, index: tuple[int, ...]) -> "tuple[tuple[int, ...], tuple[Op, ...]] | None":
        """To make only outputs ``index``: the inputs needed, and the ops making those outputs from them (None:
        every input). ``ops.take`` moves a ``Take`` ahead this way (one expert's part, not the whole stack's)."""
        return None

    def runs(self, views: list[View], cap: int) -> list[View] | None:
        """The output views of input views (a pure byte move), or None: it computes."""
        return None

    @property
    def elementwise(self) -> bool:
        """One input, one output of the same element count, element i from element i alone (a cast): ``into``."""
        return False

    def into(self, src: Any, out: Any) -> object:
        """Write into the flat tensor ``out`` the outputs of the flat input elements ``src`` (elementwise ops)."""
        raise TypeError(f"{self.describe()} is not elementwise")

    @property
    def placement(self) -> Callable[[Path, int], object] | None:
        """``place(path, offset)``, where this op (the last of an entry) writes its output's bytes itself, or None."""
        return None

    @property
    def shares(self) -> Any:
        """The work this op shares with other entries' (an object with a settable ``wanted``), or None."""
        return None


@dataclass(frozen=True)
class Each(Op):
    """An op on each tensor alone (one tensor in, one out): a ``Take`` passes ahead of it."""

    def pull(self, index: tuple[int, ...]) -> "tuple[tuple[int, ...], tuple[Op, ...]]":
        return index, (self,)
