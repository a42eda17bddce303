"""A's MTP (NextN) heads in ``verify``, decided before any comparison, like the tied head (``tied``).

A head B lacks whole (none of its own tensors in B, none of its FFNs among B's) is decided before anything is
compared (``Heads.decide``): its tensors and FFNs are left out of the comparison by name (``left_out``,
``without``), and it is said once: a note where B records that it was left out on purpose (``--mtp drop``, its
metadata's ``mtp.RECORD``), else a failure naming the head. Nothing is compared and forgiven after.

A head B holds is compared as any tensors and FFNs are; then (``Heads.report``) said once from what the comparison
found: held only in part (a failure naming what B lacks), differing outside its FFNs (a failure naming the
tensors), and its draft acceptance (``draft.acceptance``: greedy top-1 of B's head against A's and against the
main model's next token on a few short token sequences), held to the floor measured in the same run, A's head cast
to B's dtypes: B's head accepting fewer drafts than that floor allows fails, naming the head.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import mtp
from ..errors import FFNToolsError, listing
from ..ffn import FFNRef
from ..specs import spans
from .draft import Acceptance, acceptance

if TYPE_CHECKING:
    from ..checks.outside import OutsideResult
    from ..detect import FFNSet
    from .report import VerifyReport

SEQUENCES, LENGTH = 4, 32  # the token sequences the heads draft on (random, seeded): a few short prompts


@dataclass(frozen=True)
class Heads:
    """A's MTP heads as verify decides them before any comparison: ``absent`` those B lacks whole (each with
    whether B records leaving it out), ``present`` the rest, ``names`` the absent heads' tensors (their FFNs'
    too), which the comparison by name leaves out."""

    absent: tuple[tuple[mtp.Head, bool], ...] = ()
    present: tuple[mtp.Head, ...] = ()
    names: frozenset[str] = frozenset()
    layers: frozenset[int] = frozenset()  # the absent heads' FFNs' layers

    @classmethod
    def decide(cls, ca, cb, fa: "FFNSet | None", fb: "FFNSet | None") -> "Heads":
        heads = mtp.find_heads(ca, ca.config)
        if not heads:
            return cls()
        dropped = mtp.recorded(cb.metadata) or {}
        in_b = set(fb.by_ref()) if fb else set()
        absent, present, layers = [], [], set()
        for head in heads:
            own, refs = _parts(head, fa)
            if any(t in cb for t in own) or refs & in_b:
                present.append(head)
            else:
                absent.append((head, dropped.get("mtp") == "drop" and head.name in dropped.get("heads", ())))
                layers |= {r.layer for r in refs}
        return cls(tuple(absent), tuple(present), frozenset(t for h, _ in absent for t in h.tensors),
                   frozenset(layers))

    def selected(self, selection: tuple) -> tuple:
        """``--layers``/``--experts`` (``selection``) without the absent heads' layers, which are not compared.

        Raises:
            FFNToolsError: ``--layers`` naming only those layers.
        """
        layers, experts = selection
        if layers is None or not layers & self.layers:
            return selection
        if not layers - self.layers:
            heads = listing([h.name for h, _ in self.absent], 3)
            raise FFNToolsError(f"--layers {spans(layers)}: the layers of A's MTP head {heads} alone, which B does "
                                "not hold (verify without --layers says whether it was left out on purpose)")
        return layers - self.layers, experts

    def left_out(self) -> frozenset[str]:
        """A's tensors of the heads B lacks: left out of the comparison by name (an ``expected.Transform``)."""
        return self.names

    def compare(self, outside: "OutsideResult", sides) -> list[str]:
        """Nothing to derive: an absent head is said once, by ``said``."""
        return []

    def without(self, fa: "FFNSet") -> "FFNSet":
        """A's FFNs but the absent heads': what the FFN pairing pairs (an absent head is one line, not its FFNs
        listed as A's only)."""
        if not self.names:
            return fa
        return dataclasses.replace(fa, ffns=tuple(f for f in fa.ffns if f.names["down"] not in self.names),
                                   tensors=fa.tensors - self.names)

    def said(self, report: "VerifyReport") -> None:
        """Each absent head, once: left out on purpose (recorded in B), or a failure naming it."""
        for head, recorded in self.absent:
            if recorded:
                report.notes.append(f"{_what(head)} is not in B: left out on purpose (B records --mtp drop)")
            else:
                report.problems.append(f"B lacks {_what(head)}: the model's speculative-decoding draft is gone; "
                                       "convert with --mtp keep (the default), or --mtp drop to leave it out on "
                                       "purpose (recorded)")

    def report(self, report: "VerifyReport", ca, cb, fa: "FFNSet | None") -> None:
        """Each present head, once, from what the comparison found (see the module docstring)."""
        if not self.present:
            return
        differ = {re.split(r"[\[:]", d, maxsplit=1)[0] for d in (report.outside.differ if report.outside else [])}
        compared = report.outside is not None and not report.outside.skipped
        runs = _drafts(ca, cb) if compared else {}
        for head in self.present:
            what = _what(head)
            own, refs = _parts(head, fa)
            missing = [t for t in own if t not in cb] + sorted({str(r) for r in refs} & set(report.only_a))
            if missing:
                report.problems.append(f"B holds only part of {what}: {listing(missing, 3)} not in B")
                continue
            got = runs.get(head.name)
            line = got.line(named=False) if isinstance(got, Acceptance) else (f"its drafts not run: {got}" if got else "")
            below = got.below() if isinstance(got, Acceptance) else None
            tail = f" ({line})" if line else ""
            if bad := sorted(differ & set(head.tensors)):
                report.problems.append(f"{what} differs in B: {listing(bad, 3)}{tail}")
            elif below:
                report.problems.append(f"{what}: B's drafts fall {below}{tail}")
            elif compared:
                report.notes.append(f"{what}: in B and agreeing with A's{tail}")


def _what(head: mtp.Head) -> str:
    return f"A's MTP head {head.name} ({head.layout.name}, {len(head.tensors)} tensors)"


def _parts(head: mtp.Head, fa: "FFNSet | None") -> tuple[list[str], set[FFNRef]]:
    """The head's own tensors (outside its FFNs, which are paired as FFNs: a fused one renamed) and its FFNs' refs."""
    inside = set(head.tensors)
    ffn_tensors = fa.tensors if fa else frozenset()
    refs = {f.ref for f in (fa.ffns if fa else ()) if f.names["down"] in inside}
    return [t for t in head.tensors if t not in ffn_tensors], refs


def _drafts(ca, cb) -> dict[str, "Acceptance | str"]:
    """Each head's draft acceptance (``draft.acceptance`` on ``SEQUENCES`` random sequences of ``LENGTH`` tokens),
    by the head's name; where the reference cannot run them, why not, for every head."""
    import torch

    vocab = int(mtp.text_view(ca.config).get("vocab_size") or 0)  # a multimodal config's: its text_config's
    try:
        if vocab < 2:
            raise FFNToolsError("no vocab_size in config.json")
        tokens = torch.randint(0, vocab, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(0))
        return {x.head: x for x in acceptance(ca, cb, tokens)}
    except (FFNToolsError, ImportError, ValueError, KeyError, RuntimeError) as e:
        return {h.name: str(e) for h in mtp.find_heads(ca, ca.config)}
