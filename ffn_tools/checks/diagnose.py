"""Bit-level comparison of canonical FFN tensors, and what a difference most likely is.

``first_difference`` names the first differing element; ``explain`` recognises the classic conversion
defects from the tensors themselves (gate and up swapped, down transposed, a fused tensor stored in
another layout than it is read with); ``Fingerprints`` finds B's FFNs that are A's *other* FFNs (layers
shifted, experts permuted). All of it runs only on checkpoints expected to be bit-identical.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from ..ffn import FFNRef
from ..layouts import GateUpLayout, fuse
from ..registry import CANONICAL_ROLES

ROLES = CANONICAL_ROLES  # gate, up, down and their biases
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bit patterns as integers (so -0.0 != 0.0 and NaN payloads count)."""
    return t.contiguous().view(_INT[t.element_size()])


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def first_difference(role: str, a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when ``a`` and ``b`` are bit-identical, else one sentence locating the first difference."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{role}: A is {_dt(a)}{list(a.shape)}, B is {_dt(b)}{list(b.shape)}"
    return first_difference_in_blocks(role, [(0, a, b)])


Blocks = Iterable[tuple[int, torch.Tensor, torch.Tensor]]  # (first row, A's rows, B's rows), same dtype and shape


def first_difference_in_blocks(role: str, blocks: Blocks) -> str | None:
    """``first_difference`` of two tensors given as blocks of rows (read one block at a time, so a tensor
    larger than memory compares in the memory of a block): the first differing element, with its index in
    the whole tensor, and how many differ in all."""
    first, differ, total = None, 0, 0
    for row, a, b in blocks:
        total += a.numel()
        ba, bb = bits(a), bits(b)
        if torch.equal(ba, bb):
            continue
        ne = ba != bb
        differ += int(ne.sum())
        if first is None:
            idx = tuple(int(i) for i in ne.nonzero()[0])
            hex_w = 2 * a.element_size()
            mask = (1 << 4 * hex_w) - 1
            first = (f"{role}{[idx[0] + row, *idx[1:]] if idx else []}: A {a[idx].item():.8g} "
                     f"(0x{int(ba[idx]) & mask:0{hex_w}x}) vs B {b[idx].item():.8g} (0x{int(bb[idx]) & mask:0{hex_w}x})")
    return None if first is None else f"{first}; {differ} of {total} elements differ"


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _layouts(i: int) -> list[GateUpLayout]:
    """Every layout a fused dim of 2*i rows could be in (tp degrees that divide i, up to 16)."""
    out = []
    for order in ("gate-up", "up-gate"):
        out += [GateUpLayout(order, "concat"), GateUpLayout(order, "interleaved")]
        out += [GateUpLayout(order, "tp", tp) for tp in (2, 4, 8, 16) if i % tp == 0 and tp < i]
    return out


def explain(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
            fused_b: tuple[torch.Tensor, GateUpLayout] | None = None,
            fused_a: tuple[torch.Tensor, GateUpLayout] | None = None) -> list[str]:
    """Likely causes of a difference between A's and B's canonical tensors of one FFN.

    Args:
        a, b: canonical tensors by role (gate, up, down, biases).
        fused_b: B's stored gate_up weight (2I, H) and the layout it was read with, when B is fused.
        fused_a: A's, when A is fused: B's separate gate and up may be A's rows split in another layout
            (``split-gateup --layout`` other than the family's).

    Returns:
        Hints, each a sentence; empty when nothing recognisable.
    """
    hints = []
    same = {r: identical(a[r], b[r]) for r in ROLES if r in a and r in b}
    swapped = not same.get("gate") and not same.get("up") and identical(a["gate"], b["up"]) \
        and identical(a["up"], b["gate"])
    if swapped:
        hints.append("B's gate is A's up and B's up is A's gate: gate and up are swapped")
    if not same.get("down") and a["down"].shape == b["down"].T.shape and identical(a["down"], b["down"].T.contiguous()):
        hints.append("B's down is A's down transposed")
    if fused_b is not None and not (same.get("gate") and same.get("up")):
        stored, read_as = fused_b
        for cand in _layouts(a["gate"].shape[0]):
            if cand != read_as and identical(fuse(a["gate"], a["up"], cand), stored):
                flags = f"--b-layout {cand.arrangement}" + (f" --b-tp {cand.tp}" if cand.arrangement == "tp" else "") \
                    + f" --b-order {cand.order}"
                hints.append(f"B's gate_up is stored as {cand.describe()} but was read as {read_as.describe()} "
                             f"(pass {flags} if that is how it was written)")
                break
    if fused_a is not None and fused_b is None and not swapped and not (same.get("gate") and same.get("up")):
        stored, read_as = fused_a
        for cand in _layouts(b["gate"].shape[0]):
            if cand != read_as and b["gate"].shape == b["up"].shape and identical(fuse(b["gate"], b["up"], cand),
                                                                                   stored):
                flags = f"--layout {cand.arrangement}" + (f" --tp {cand.tp}" if cand.arrangement == "tp" else "") \
                    + f" --order {cand.order}"
                hints.append(f"B's gate and up are A's gate_up rows split as {cand.describe()}, where A's are read as "
                             f"{read_as.describe()}: B was split in another layout than A's (split A again without "
                             f"that --layout; pass {flags} if A's gate_up is stored that way)")
                break
    return hints


class Fingerprints:
    """Digests of every canonical weight seen, to recognise an FFN that turns up under another name."""

    def __init__(self) -> None:
        self._seen: dict[str, FFNRef] = {}

    @staticmethod
    def digest(t: torch.Tensor) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(bits(t).numpy().tobytes())
        return h.hexdigest()

    def add(self, ref: FFNRef, tensors: dict[str, torch.Tensor]) -> None:
        for role in ("gate", "up", "down"):
            self._seen.setdefault(self.digest(tensors[role]), ref)

    def whose(self, tensors: dict[str, torch.Tensor]) -> FFNRef | None:
        """The FFN whose gate, up and down these are, if one FFN matches all three."""
        refs = {self._seen.get(self.digest(tensors[r])) for r in ("gate", "up", "down")}
        return refs.pop() if len(refs) == 1 else None
