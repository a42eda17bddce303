"""Two models as they generate (``verify --generate``), held against the noise floor: what the check found.

The statistics (``verification.generate`` computes them, on A's greedy continuations of the prompts, each side
through its own client) are read as the same statistics between A and A' (the floor): A under the change that is
not a defect — A in B's dtype, B's form re-derived from A (its quantization, its format), run by B's client. A
statistic fails where it exceeds ``factor`` times its floor plus a slack (``PROFILES``); the counts (prompts
tokenized otherwise, prompts that stop otherwise) may not exceed the floor's in any profile: a tokenizer or a
stop id is right or wrong, not noisy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from . import Check


@dataclass(frozen=True)
class Profile:
    """How far above its floor a statistic may be: ``factor`` times it, plus ``kl`` nats (a KL divergence) or
    ``positions`` positions (a top-1 / top-5 disagreement rate)."""

    name: str
    factor: float
    kl: float
    positions: int
    words: str


PROFILES = {
    "strict": Profile("strict", 1.0, 0.0, 0, "no statistic above its floor: bit-identical logits where the floor is A "
                                             "run again"),
    "standard": Profile("standard", 2.0, 1e-7, 1, "fails above 2x the floor + 1e-7 nats / 1 position"),
    "relaxed": Profile("relaxed", 5.0, 1e-5, 3, "fails above 5x the floor + 1e-5 nats / 3 positions"),
}
DEFAULT_PROFILE = "standard"

# name -> (kind, words): kind "kl" (nats over positions), "rate" (a fraction of positions), "count" (prompts)
STATISTICS: dict[str, tuple[str, str]] = {
    "kl_ab_mean": ("kl", "KL(A||B) mean"), "kl_ab_p99": ("kl", "KL(A||B) p99"), "kl_ab_max": ("kl", "KL(A||B) max"),
    "kl_ba_mean": ("kl", "KL(B||A) mean"), "kl_ba_p99": ("kl", "KL(B||A) p99"), "kl_ba_max": ("kl", "KL(B||A) max"),
    "top1_disagreement": ("rate", "top-1 disagreement"), "top5_disagreement": ("rate", "top-5 disagreement"),
    "prompts_tokenized_otherwise": ("count", "prompts tokenized otherwise"),
    "prompts_stopping_otherwise": ("count", "prompts that stop otherwise"),
}


def judge(value: float, floor: float, kind: str, profile: Profile, positions: int) -> tuple[float, bool]:
    """(the most ``value`` may be, whether it is within) for a statistic of ``kind`` whose floor is ``floor``."""
    if kind == "count":
        allowed = floor
    elif kind == "kl":
        allowed = profile.factor * floor + profile.kl
    else:
        allowed = profile.factor * floor + profile.positions / max(positions, 1)
    return allowed, value <= allowed * (1 + 1e-12)


def times(value: float, floor: float) -> str:
    """``value`` as a multiple of ``floor`` ("1.00x", "inf x" over a zero floor, "0x" both zero)."""
    if floor > 0:
        return f"{value / floor:.2f}x"
    return "0x" if value == 0 else "above a zero floor"


@dataclass(kw_only=True)
class AgreementResult(Check):
    """What ``verify --generate`` found (see the module docstring)."""

    name: ClassVar[str] = "generation"

    clients: tuple[str, str] = ("", "")
    profile: str = DEFAULT_PROFILE
    new_tokens: int = 0
    floor: str = ""  # how the floor was measured, in words
    floor_client: str = ""
    positions: int = 0
    stats: dict = field(default_factory=dict)  # STATISTICS -> B's value
    floor_stats: dict = field(default_factory=dict)  # STATISTICS -> the floor's
    judged: list[dict] = field(default_factory=list)  # per statistic: value, floor, allowed, passed
    prompts: list[dict] = field(default_factory=list)  # per prompt: its figures, divergence, stops, tokens
    not_judged: str | None = None  # why there is no floor to judge against (the statistics are still reported)
    cost: dict = field(default_factory=dict)  # what it was to cost, said before it started

    def judge(self) -> None:
        """Each statistic against its floor under the profile; a failure per statistic above it."""
        profile = PROFILES[self.profile]
        self.judged = []
        for key, (kind, words) in STATISTICS.items():
            value, floor = self.stats[key], self.floor_stats[key]
            allowed, ok = judge(value, floor, kind, profile, self.positions)
            self.judged.append({"statistic": key, "value": value, "floor": floor, "allowed": allowed, "passed": ok})
            if not ok:
                self.problems.append(self._failure(key, kind, words, value, floor, allowed))

    def _failure(self, key: str, kind: str, words: str, value: float, floor: float, allowed: float) -> str:
        n = len(self.prompts)
        if kind == "count":
            which = [p for p in self.prompts if not p[("tokens_same" if "tokenized" in key else "stops_same")]]
            first = which[0]["why_tokens" if "tokenized" in key else "why_stops"] if which else ""
            return f"{words}: {int(value)} of {n} (floor {int(floor)}); first: {first}"
        shown = _num(value) if kind == "kl" else f"{value:.1%}"
        floor_s = _num(floor) if kind == "kl" else f"{floor:.1%}"
        allowed_s = _num(allowed) if kind == "kl" else f"{allowed:.1%}"
        where = ""
        if kind == "kl":
            worst = max(self.prompts, key=lambda p: p["kl_ab_max" if "ab" in key else "kl_ba_max"])
            where = f"; worst prompt {worst['index'] + 1} ({worst['text_shown']})"
        return (f"{words} {shown} is {times(value, floor)} the floor ({floor_s}; {self.profile} allows "
                f"{allowed_s}){where}")

    def line(self) -> str:
        if self.skipped:
            return f"generation: not run ({self.skipped})"
        s, f = self.stats, self.floor_stats
        head = (f"generation ({len(self.prompts)} prompts, up to {self.new_tokens} new tokens each, "
                f"{self.clients[0]} (A) vs {self.clients[1]} (B), {self.positions} positions): "
                f"KL(A||B) mean {_num(s['kl_ab_mean'])} p99 {_num(s['kl_ab_p99'])} max {_num(s['kl_ab_max'])}, "
                f"top-1 {1 - s['top1_disagreement']:.1%}, top-5 {1 - s['top5_disagreement']:.1%}")
        rows = [head, *[f"  note: {n}" for n in self.notes]]
        for p in self.prompts:
            rows.append(f"  prompt {p['index'] + 1} ({p['text_shown']}): KL mean {_num(p['kl_ab_mean'])} max "
                        f"{_num(p['kl_ab_max'])}, top-1 {p['top1']:.0%}; {p['divergence_words']}; {p['stops_words']}"
                        + ("" if p["tokens_same"] else f"; TOKENS DIFFER: {p['why_tokens']}"))
        if self.not_judged:
            rows.append(f"  verdict: not judged ({self.not_judged})")
            return "\n".join(rows)
        verdict = ("within the floor" if not self.problems else
                   f"{len(self.problems)} statistic{'s' * (len(self.problems) != 1)} above the floor")
        rows.append(f"  verdict: {verdict}: KL(A||B) mean {times(s['kl_ab_mean'], f['kl_ab_mean'])} the floor "
                    f"({_num(f['kl_ab_mean'])}), top-1 {1 - f['top1_disagreement']:.1%} on the floor; floor: "
                    f"{self.floor}; profile {self.profile} ({PROFILES[self.profile].words})")
        return "\n".join(rows)

    def failures(self) -> list[str]:
        return [f"{self.name}: {p}" for p in self.problems]

    def as_dict(self) -> dict:
        return {**super().as_dict(), "clients": list(self.clients), "profile": self.profile,
                "new_tokens": self.new_tokens, "positions": self.positions, "floor": self.floor,
                "floor_client": self.floor_client, "statistics": self.stats, "floor_statistics": self.floor_stats,
                "judged": self.judged, "prompts": self.prompts, "not_judged": self.not_judged, "cost": self.cost}


def _num(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.3g}"
