"""What ``verify --locate`` found (``verification.locate``): a row per part, the first part that leaves its floor,
a compact per-layer table and every figure as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

WORDS = {"embed": "embedding rows", "attn_norm": "attention's input norm", "attn": "attention output",
         "after_attn": "hidden state after attention", "ffn_norm": "FFN's input norm", "router": "router logits",
         "topk": "router's top-k choice", "shared": "shared expert output", "routed": "routed experts' combined output",
         "ffn": "FFN block output", "hidden": "hidden state after the FFN", "final_norm": "final norm",
         "logits": "logits"}
SHORT = {"attn_norm": "anorm", "attn": "attn", "after_attn": "h_attn", "ffn_norm": "fnorm", "router": "router",
         "topk": "top-k", "shared": "shared", "routed": "routed", "ffn": "ffn", "hidden": "h_ffn"}


@dataclass
class Row:
    """One part: its key, layer (None outside the layers) and name; B's figure and the floor's (``locate.figure``:
    ``rel``/``max_rel``/``cosine`` or ``choice``), the most B's may be, whether it leaves the floor, a note."""

    key: str
    layer: int | None
    part: str
    b: dict | None = None
    floor: dict | None = None
    anchor: dict | None = None
    allowed: float | None = None
    floor_leaves_anchor: bool = False
    left: bool = False
    note: str = ""

    @property
    def statistic(self) -> str:
        return "choice" if self.b is not None and "choice" in self.b else "rel"

    def words(self) -> str:
        where = f"layer {self.layer} " if self.layer is not None else ""
        return f"{where}{WORDS.get(self.part, self.part)} ({self.key})"

    def cell(self, anchor_is_b: bool = False) -> str:
        """The part's figure as a multiple of its floor's: "1.0" at it, "=" both 0, "!" marks one that leaves."""
        if self.b is None:
            return "-" if not self.left else "shape!"
        s, v = self.statistic, self.b[self.statistic]
        held = self.anchor if self.anchor is not None and not anchor_is_b else self.floor
        if held is None:
            return f"{v:.1e}"
        f = held[s]
        text = "=" if v == 0 and f == 0 else (f"{v / f:.1f}x" if f > 0 else f"{v:.0e}")
        return text + ("!" if self.left else "")


@dataclass
class LocateResult:
    """A, B and the floor run with hooks (see ``verification.locate``)."""

    clients: tuple[str, str] = ("", "")
    sequences: int = 0
    positions: int = 0
    floor: str = ""  # how the floor was made, in words
    anchor: str = ""  # how the independent floor was made, in words ("": none here)
    anchor_is_b: bool = False  # B computes as the anchor's output: held against ffn-tools' floor instead
    not_judged: str | None = None  # why there is no floor
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def first(self) -> Row | None:
        """The first part, in the model's order, that leaves its floor."""
        return next((r for r in self.rows if r.left), None)

    @property
    def passed(self) -> bool | None:
        """No part leaves its floor; None where there was no floor to judge against."""
        if self.first is not None:
            return False
        return None if self.not_judged else True

    @property
    def floors_part(self) -> Row | None:
        """The first part where ffn-tools' floor leaves the anchor's: a defect of ffn-tools' own conversion."""
        return next((r for r in self.rows if r.floor_leaves_anchor), None)

    def verdict(self) -> str:
        on_anchor = self.anchor and not self.anchor_is_b
        which = f"the independent floor ({self.anchor})" if on_anchor else f"its floor ({self.floor})"
        if (r := self.first) is not None:
            if r.b is None:
                return f"--locate: B parts from A at {r.words()}: {r.note}"
            s = r.statistic
            name = "share of positions choosing other experts" if s == "choice" else "relative error"
            held = r.anchor if on_anchor else r.floor
            return (f"--locate: B parts from A first at {r.words()}: {name} {r.b[s]:.3g}, {held[s] if held else 0:.3g} "
                    f"at {which}, at most {r.allowed:.3g} allowed")
        if self.not_judged:
            return f"--locate: not judged ({self.not_judged}); the figures are B's against A"
        return f"--locate: every part of every layer within {which}"

    def lines(self) -> list[str]:
        out = [self.verdict(),
               f"  A run by {self.clients[0]}, B by {self.clients[1]}, on {self.sequences} sequences "
               f"({self.positions} positions)" + ("" if self.anchor else f"; floor: {self.floor or 'none'}")]
        if self.anchor:
            out.append(f"  ffn-tools' floor: {self.floor}" if not self.anchor_is_b else
                       f"  independent floor (B's own maker, so not B's floor): {self.anchor}")
        if (f := self.floors_part) is not None:
            out.append(f"  floors DIFFER: ffn-tools' floor leaves the independent floor first at {f.words()}: "
                       "ffn-tools' conversion to B's form computes otherwise than the anchor's")
        out += [f"  note: {n}" for n in self.notes]
        layers = sorted({r.layer for r in self.rows if r.layer is not None})
        parts = [p for p in SHORT if any(r.part == p for r in self.rows)]
        cells = {r.key: r.cell(self.anchor_is_b) for r in self.rows}
        out.append("  per layer, B's figure as a multiple of its floor's (=: both 0; !: leaves it; -: no such part)")
        out.append("  " + "layer".ljust(6) + "".join(SHORT[p].rjust(9) for p in parts))
        for layer in layers:
            out.append("  " + str(layer).ljust(6) + "".join(cells.get(f"L{layer}.{p}", "-").rjust(9) for p in parts))
        around = [f"{k} {cells[k]}" for k in ("embed", "final_norm", "logits") if k in cells]
        if around:
            out.append("  " + ", ".join(around))
        return out

    def as_dict(self) -> dict:
        first = self.first
        return {"passed": self.passed, "first": None if first is None else {**asdict(first), "words": first.words()},
                "verdict": self.verdict(), "clients": list(self.clients), "sequences": self.sequences,
                "positions": self.positions, "floor": self.floor, "anchor": self.anchor, "anchor_is_b": self.anchor_is_b,
                "floors_differ_at": None if self.floors_part is None else self.floors_part.key,
                "not_judged": self.not_judged, "notes": self.notes,
                "parts": [asdict(r) for r in self.rows]}
