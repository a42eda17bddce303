"""Two models as they generate (``verify --generate``), held against the noise floor: what the check found.

The statistics (``verification.generate`` computes them, on A's greedy continuations of the prompts, each side
through its own client) are read as the same statistics between A and A' (the floor): A under the change that is
not a defect — A in B's dtype, B's form re-derived from A (its quantization, its format), run by B's client. A
statistic fails where it exceeds ``factor`` times its floor plus a slack (``PROFILES``); the counts (prompts
tokenized otherwise, prompts whose stop token is not a stop id of B's) may not exceed the floor's in any profile: a
tokenizer or a stop id is right or wrong, not noisy.

Where one client runs both B and A' (B's form re-derived from A, or A in B's dtype), the two hold one form and
should compute alike to that client's run-to-run noise (zero for a deterministic client on the same bytes): B is
compared with A' directly too (``direct``), so a defect smaller than the floor between two clients (a norm
scaled by 1.01 under 4-bit quantization) is not hidden by it.

A check that did not run (``skipped``) or has no floor to be judged by (``not_judged``) is never passed: its JSON
says ``"passed": null``.
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


def against(value: float, floor: float, what: str = "the floor") -> str:
    """``value`` held against ``floor``, as words that follow the statistic's name and value: "is 1.30x the floor
    (1e-05)", "is 0, as the floor is", "is above the floor of 0" (``what`` names the floor)."""
    if floor > 0:
        return f"is {value / floor:.2f}x {what} ({_num(floor)})"
    return f"is 0, as {what} is" if value == 0 else f"is above {what} of 0"


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
    direct: dict = field(default_factory=dict)  # B against A' where one client runs both (``Direct``), or why not
    cost: dict = field(default_factory=dict)  # what it was to cost, said before it started

    def judge(self) -> None:
        """Each statistic against its floor under the profile, and B against A' where one client runs both; a
        failure per statistic above its floor. What names a cause comes first: the prompts' tokens and stop ids
        (right or wrong, not noisy), then B against A' (the same form in the same client), then the statistics
        against the floor (symptoms, wherever they come from)."""
        profile = PROFILES[self.profile]
        self.judged = []
        counts: list[str] = []
        symptoms: list[str] = []
        for key, (kind, words) in STATISTICS.items():
            value, floor = self.stats[key], self.floor_stats[key]
            allowed, ok = judge(value, floor, kind, profile, self.positions)
            self.judged.append({"statistic": key, "value": value, "floor": floor, "allowed": allowed, "passed": ok})
            if not ok:
                (counts if kind == "count" else symptoms).append(self._failure(key, kind, words, value, floor,
                                                                               allowed))
        self.problems += counts + self._judge_direct(profile) + symptoms

    def _judge_direct(self, profile: Profile) -> list[str]:
        """B against A' (``direct``: both run by one client, which on the same form computes alike to its
        run-to-run noise), each statistic of positions within the profile above that noise; the failure, in one
        line."""
        d = self.direct
        if not d.get("statistics"):
            return []
        d["judged"], bad = [], 0
        for key in DIRECT:
            kind = STATISTICS[key][0]
            value, noise = d["statistics"][key], d["noise"][key]
            allowed, ok = judge(value, noise, kind, profile, self.positions)
            d["judged"].append({"statistic": key, "value": value, "noise": noise, "allowed": allowed, "passed": ok})
            bad += not ok
        d["passed"] = not bad
        if not bad:
            return []
        ds = d["statistics"]
        a, b = self.clients[0], self.clients[1]
        floor_words = f"between {a} and {b}" if a != b else f"A against A in B's form, both in {a}"
        return [f"B against A' (A in B's form, both run by {d['client']}): KL(A'||B) mean {_num(ds['kl_ab_mean'])} max "
                f"{_num(ds['kl_ab_max'])}, top-1 disagreement {ds['top1_disagreement']:.1%}; {bad} of {len(DIRECT)} "
                f"statistics above the client's run-to-run noise ({d['noise_words']}; {self.profile} allows "
                f"{_slack(profile)} above it): B is not A in B's form, its weights or config differ by more than the "
                f"conversion, which the floor ({floor_words}, KL mean {_num(self.floor_stats['kl_ab_mean'])}) "
                f"can hide"]

    def _failure(self, key: str, kind: str, words: str, value: float, floor: float, allowed: float) -> str:
        n = len(self.prompts)
        if kind == "count":
            which = [p for p in self.prompts if not p[("tokens_same" if "tokenized" in key else "stops_same")]]
            first = which[0]["why_tokens" if "tokenized" in key else "why_stops"] if which else ""
            return f"{words}: {int(value)} of {n} (floor {int(floor)}); first: {first}"
        where = ""
        if kind == "kl":
            worst = max(self.prompts, key=lambda p: p["kl_ab_max" if "ab" in key else "kl_ba_max"])
            where = f"; worst prompt {worst['index'] + 1} ({worst['text_shown']})"
        return (f"{words} {_shown(value, kind)} {against(value, floor)}; {self.profile} allows "
                f"{_shown(allowed, kind)}{where}")

    @property
    def decided(self) -> bool:
        """The models ran and the statistics were judged against a floor (not skipped, not ``not_judged``)."""
        return not self.skipped and not self.not_judged

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
        d = self.direct
        if d.get("statistics"):
            ds = d["statistics"]
            rows.append(f"  B against A' (both run by {d['client']}): KL(A'||B) mean {_num(ds['kl_ab_mean'])} max "
                        f"{_num(ds['kl_ab_max'])}, top-1 {1 - ds['top1_disagreement']:.1%}; run-to-run noise: "
                        f"{d['noise_words']} -> {'same' if d.get('passed') else 'DIFFER'}")
        elif d.get("why_not"):
            rows.append(f"  B against A': not compared ({d['why_not']})")
        n = len(self.problems)
        verdict = "within the floor" if not n else f"{n} failure{'s' * (n != 1)}"
        rows.append(f"  verdict: {verdict}: KL(A||B) mean {_num(s['kl_ab_mean'])} "
                    f"{against(s['kl_ab_mean'], f['kl_ab_mean'])}, top-1 {1 - f['top1_disagreement']:.1%} on the "
                    f"floor; floor: {self.floor}; profile {self.profile} ({PROFILES[self.profile].words})")
        return "\n".join(rows)

    def failures(self) -> list[str]:
        return [f"{self.name}: {p}" for p in self.problems]

    def as_dict(self) -> dict:
        return {**super().as_dict(), "passed": self.passed if self.decided else None, "ran": not self.skipped,
                "clients": list(self.clients), "profile": self.profile,
                "new_tokens": self.new_tokens, "positions": self.positions, "floor": self.floor,
                "floor_client": self.floor_client, "statistics": self.stats, "floor_statistics": self.floor_stats,
                "judged": self.judged, "prompts": self.prompts, "not_judged": self.not_judged,
                "direct": self.direct, "cost": self.cost}


DIRECT = tuple(k for k, (kind, _) in STATISTICS.items() if kind != "count")  # B against A': per position


def _shown(value: float, kind: str) -> str:
    return _num(value) if kind == "kl" else f"{value:.1%}" if kind == "rate" else str(int(value))


def _slack(profile: Profile) -> str:
    """What a profile allows above a floor of 0, in words."""
    if not profile.kl and not profile.positions:
        return "nothing"
    return f"{profile.kl:g} nats, {profile.positions} position{'s' * (profile.positions != 1)}"


def _num(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.3g}"
