"""What B should hold, given A, as B's client will hold it: derived once per verify (``Expected.derive``) and
compared once.

A checkpoint B is not always A's tensors as stored. B's client may load A through transforms of its own (mlx_lm's
sanitize: ``Client.pairing``), store some tensors in another form than it reads them (llama.cpp's norms plus one:
``Client.stored_otherwise``), B may record tensors it read back through such a form (a GGUF's norms read back
minus one: ``checks.rounded``), and a side whose config ties its head holds its embedding as its head whatever it
stores (``tied``). Each is one ``Transform``: the names it takes from the plain comparison by name, decided before
anything is compared (``left_out``: B's tensors it derives from A, A's its load uses or drops), and its comparison
of B's tensors with A's through the ops that made B (llama.cpp's plus one: ``checks.rounded.plus_ops``; mlx_lm's
sanitize: the MLX export's own plan), each tensor once, into the outside result (``compare``). A's FFN tensors B's
client computes are read so before the FFN checks (``Pairing.computed``/``read``, through ``a_as_loaded``).
``verify`` asks the derived ``Expected`` for the names to leave out, compares the rest by name once
(``outside``), then each transform's derived tensors, in one loop, in one place. Nothing compared by name is
forgiven after: a tensor is compared either by name or against its derivation, never both (the tied head too: the
head one side stores and the other does not is decided before, compared once where that side ties it: ``tied``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..checks.outside import outside_tolerance
from ..checks.rounded import compare_recorded, recorded_shifts
from ..errors import listing
from ..tolerances import tolerance_for
from .tied import TiedHead

if TYPE_CHECKING:
    from ..checks.outside import OutsideResult
    from ..clients import Client
    from ..pairing import Pairing


@dataclass(frozen=True)
class Sides:
    """What a transform's comparison reads: both checkpoints, the tolerance overrides, and each side's tie of its
    head to its embedding as its client reads its config (None: unknown)."""

    ca: object
    cb: object
    atol: float | None
    rtol: float | None
    ties: tuple[bool | None, bool | None]


class Transform(Protocol):
    """One way B's client holds something other than A's tensors as stored (see the module docstring)."""

    def left_out(self) -> frozenset[str]:
        """B's tensors the plain comparison leaves to this transform."""

    def compare(self, outside: "OutsideResult", sides: Sides) -> list[str]:
        """Compare what this transform derives from A with what B holds, into ``outside``; returns notes."""


@dataclass(frozen=True)
class StoredOtherwise:
    """Tensors B's client stores in another form than it reads them (``Client.stored_otherwise``)."""

    client: "Client"
    names: frozenset[str]

    def left_out(self) -> frozenset[str]:
        return self.names

    def compare(self, outside, sides: Sides) -> list[str]:
        return (self.client.compare_stored_otherwise(outside, sides.ca, sides.cb, sides.atol, sides.rtol)
                if self.names else [])


@dataclass(frozen=True)
class Recorded:
    """Tensors B records as read back from a form storing them plus a constant (``checks.rounded``)."""

    shifts: Mapping[str, float]

    def left_out(self) -> frozenset[str]:
        return frozenset(self.shifts)

    def compare(self, outside, sides: Sides) -> list[str]:
        return compare_recorded(outside, sides.ca, sides.cb, dict(self.shifts)) if self.shifts else []


@dataclass(frozen=True)
class Loaded:
    """A as B's client loads it (``Client.pairing``): its FFN tensors read as computed (``Expected.a_as_loaded``);
    outside them, B's tensors its load computes from A's (``derived``) compared once with what it computes, and A's
    it uses or drops (``gone``) not looked for in B (``Pairing.derives``, decided before any comparison)."""

    pairing: "Pairing"
    derived: frozenset[str] = frozenset()
    gone: frozenset[str] = frozenset()

    def left_out(self) -> frozenset[str]:
        return self.derived | self.gone

    def compare(self, outside, sides: Sides) -> list[str]:
        outcomes, notes = self.pairing.compare(sorted(self.derived), tolerance_check(sides.atol, sides.rtol))
        for d in outcomes:
            outside.add(d)
        if self.gone:
            notes.append(f"A's {listing(sorted(self.gone), 4)}: renamed, used or dropped by B's client when it loads "
                         "A, so B has no tensor of that name")
        return notes


class AsLoaded(Mapping):
    """A's tensors read through ``through`` (its checkpoint, or the read-ahead stream), except ``computed``
    (``Pairing.computed``): those as B's client computes them (``pairing.read``)."""

    def __init__(self, through: Mapping, pairing: Pairing, computed: set[str]):
        self.through, self.pairing, self.computed = through, pairing, computed

    def __getitem__(self, name: str):
        return self.pairing.read(name) if name in self.computed else self.through[name]

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.through

    def __iter__(self):
        return iter(self.through)

    def __len__(self) -> int:
        return len(self.through)


@dataclass(frozen=True)
class LoadedView:
    """A mapping of A's tensors seen as B's client loads A (``AsLoaded``): what ``PairChecker`` reads A through."""

    pairing: "Pairing"
    computed: frozenset[str]

    def __call__(self, through: Mapping) -> Mapping:
        return AsLoaded(through, self.pairing, set(self.computed))


def as_stored(through: Mapping) -> Mapping:
    """A's tensors as stored: B's client computes none of them."""
    return through


def tolerance_check(atol, rtol) -> Callable:
    """``(name, a, b, bits) -> why or None``: a tensor pair within its row (the outside check's criterion)."""
    def check(name, a, b, bits):
        return outside_tolerance(name, a, b, tolerance_for([a.dtype, b.dtype], bits, atol=atol, rtol=rtol))
    return check


@dataclass(frozen=True)
class Expected:
    """B as derived from A through B's client (see the module docstring): the transforms, in the order their
    comparisons run, and ``pairing`` (A's FFN tensors as B's client computes them), or None."""

    transforms: tuple[Transform, ...]
    pairing: "Pairing | None"

    @classmethod
    def derive(cls, client: "Client", ca, cb, paired: bool,
               ffns: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset()),
               decided: tuple[Transform, ...] = ()) -> "Expected":
        """What B should hold given A, as ``client`` (B's) will hold it; ``paired``: both sides have FFNs (without
        them nothing is compared and nothing is derived); ``ffns``: A's and B's FFN tensors (compared as pairs,
        not here); ``decided``: transforms decided before (A's MTP heads B lacks: ``heads.Heads``)."""
        if not paired:
            return cls((), None)
        pairing = client.pairing(ca, cb)  # A as B's client loads it: FFNs and outside
        transforms: list[Transform] = [*decided, StoredOtherwise(client, client.stored_otherwise(cb)),
                                       Recorded(recorded_shifts(cb.metadata))]
        outside = (frozenset(n for n in ca if n not in ffns[0]), frozenset(n for n in cb if n not in ffns[1]))
        if pairing is not None:
            transforms.append(Loaded(pairing, *pairing.derives(*outside)))
        transforms.append(TiedHead.decide(outside, frozenset().union(*(t.left_out() for t in transforms))))
        return cls(tuple(transforms), pairing)

    def a_as_loaded(self, names: list[str]) -> tuple[frozenset[str], Callable[[Mapping], Mapping], str | None]:
        """Of A's FFN tensors ``names``, those B's client computes when it loads A (``Pairing.computed``), how to
        read A's tensors so (a view of a mapping of them), and the note saying so (None where it computes none)."""
        computed = frozenset(self.pairing.computed(names)) if self.pairing is not None else frozenset()
        if self.pairing is None or not computed:
            return frozenset(), as_stored, None
        return computed, LoadedView(self.pairing, computed), self.pairing.describe(sorted(computed))

    def left_out(self) -> frozenset[str]:
        """B's tensors the plain outside comparison leaves to a transform."""
        return frozenset().union(*(t.left_out() for t in self.transforms))

    def compare_derived(self, outside: "OutsideResult | None", sides: Sides) -> list[str]:
        """Every transform's comparison into ``outside`` (nothing where it was not compared); returns notes."""
        if outside is None or outside.skipped:
            return []
        return [note for t in self.transforms for note in t.compare(outside, sides)]
