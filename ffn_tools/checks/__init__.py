"""What a check of a checkpoint (against another, or against its client) found: one interface for every check.

    load         would a checkpoint load in its client (``LoadCheck``)
    config       two configs as their clients read them (``ConfigResult``)
    side_files   tokenizer, chat template, generation defaults (``SideFilesResult``)
    tokens       texts through two tokenizers (``TokenizationResult``)
    outside      the tensors outside the FFNs (``OutsideResult``)
    diagnose     bit-level comparison of tensors, and what a difference most likely is

The runtime clients (``ffn_tools.clients``, implemented by the formats) produce these; ``verify`` gathers them
into its report. Every result is a ``Check``: ``passed``, ``line()`` (one line of the report), ``failures()``
(one line each), ``as_dict()`` (its JSON), ``skipped`` (why it did not run: never read as a pass; its JSON's ``passed`` is null)
and ``not_applicable`` (it did not run because the runtime asked has no answer to it: ``clients.NotApplicable``, which
leaves verify's verdict incomplete).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

__all__ = ["Check", "as_json"]


@dataclass(kw_only=True)
class Check:
    """One check's outcome (see the module docstring). ``problems`` are failures, ``notes`` facts that are not;
    ``skipped`` says why the check did not run, and a skipped check passes only in that it found nothing: the
    report says it did not run. ``not_applicable``: it was skipped because the runtime asked has no answer to it
    (``clients.Client.unanswered``), not for want of something to compare: verify's verdict is then incomplete."""

    name: ClassVar[str] = "check"

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    not_applicable: bool = False

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def verdict(self) -> bool | None:
        """``passed`` where the check ran; None where it did not (``skipped``): what its JSON says, never a pass."""
        return None if self.skipped else self.passed

    def line(self) -> str:
        if self.skipped:
            return f"{self.name}: not compared ({self.skipped})"
        return f"{self.name}: {'passed' if self.passed else f'{len(self.problems)} problems'}"

    def failures(self) -> list[str]:
        return [f"{self.name}: {p}" for p in self.problems]

    def as_dict(self) -> dict:
        return {"problems": self.problems, "notes": self.notes, "skipped": self.skipped, "passed": self.verdict}


def as_json(check: Check | None) -> dict | None:
    """``check``'s JSON (``as_dict``), with ``"not_applicable": true`` where the runtime asked has no answer to it;
    None for no check."""
    if check is None:
        return None
    return {**check.as_dict(), "not_applicable": True} if check.not_applicable else check.as_dict()
