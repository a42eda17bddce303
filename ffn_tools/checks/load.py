"""Would a checkpoint load in its real client? What the client's own load found (each client's
``Client.load_check`` runs it: transformers on the meta device, mlx_lm's strict lazy load, llama.cpp building
the model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import FFNToolsError, listing
from . import Check

SHOWN = 4  # names per category in the one-line summary (the JSON has them all)


@dataclass
class LoadCheck(Check):
    """The outcome: ``skipped`` says why no check applies (no client loads this kind of checkpoint here);
    ``refused`` that the client refuses to build B's model at all (a failure); otherwise the three lists say
    what would go wrong."""

    name: ClassVar[str] = "load check"

    client: str
    missing: list[str] = field(default_factory=list)  # parameters the model would initialise afresh
    unexpected: list[str] = field(default_factory=list)  # checkpoint tensors the model would ignore
    mismatched: list[str] = field(default_factory=list)  # "name: checkpoint [..], model [..]"
    architecture: str | None = None
    refused: str | None = None
    words: str | None = None  # the client's own message, where it says what is missing or left over itself

    @property
    def ok(self) -> bool:
        return self.skipped is None and not (self.refused or self.missing or self.unexpected or self.mismatched)

    @property
    def passed(self) -> bool:
        """Whatever did not run did not fail (the report says it did not run)."""
        return self.ok or self.skipped is not None

    def line(self) -> str:
        return self.summary()

    def failures(self) -> list[str]:
        return [] if self.passed else [f"B {self.summary()}"]

    def summary(self) -> str:
        """One line: what would happen on load."""
        if self.skipped:
            return f"load check ({self.client}) did not run: {self.skipped}"
        if self.refused:
            return f"would not load: {self.client} cannot build the model from its config ({self.refused})"
        if self.ok:
            return f"loads in {self.client} ({self.architecture}): every parameter provided, nothing left over"
        if self.words:
            return f"would not load in {self.client}: {self.words}"
        parts = []
        for what, items in (("newly initialized", self.missing), ("unexpected (ignored)", self.unexpected),
                            ("of the wrong shape", self.mismatched)):
            if items:
                parts.append(f"{len(items)} tensor{'s' * (len(items) > 1)} {what}: {listing(items, SHOWN)}")
        return f"would load in {self.client} ({self.architecture}) with " + "; ".join(parts)

    def as_dict(self) -> dict:
        return {"client": self.client, "architecture": self.architecture, "ok": self.ok, "skipped": self.skipped,
                "refused": self.refused,
                "missing": self.missing, "unexpected": self.unexpected, "mismatched": self.mismatched}


class MissingClient(FFNToolsError):
    """The client that loads this checkpoint is not installed, so the load check cannot run (exit 2)."""
