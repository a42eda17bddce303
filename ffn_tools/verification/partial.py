"""``verify --layers`` on a machine that holds only some shards of a checkpoint.

A pair too large for one machine's disk is verified by layer range, each machine holding the shards its range
needs. Which those are is known from the index alone (``shards_needed``: its names against the FFN registry's
templates, no shard opened), so a user fetches only them (``verify --layers R --shards-needed``). Under
``--layers`` a sharded checkpoint opens with the shards not on disk listed as ``Checkpoint.absent``; a
selected FFN's tensor in one of them is refused naming the shards to fetch (``refusal``), and the FFN tensors
of other layers are left out of the FFN search (``search_names``), so a layer split across a present and an
absent shard does not read as an inconsistent FFN. What needs every shard (the load check, the logits) says
it did not run (``Checkpoint.absent_line``); without ``--layers`` a missing shard is refused, as for every command.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..detect import choose_scheme, ffn_members
from ..errors import CheckpointError, FFNToolsError, SchemeError
from ..io.store import WEIGHT_INDEXES, WEIGHT_SUFFIXES, Checkpoint, read_config
from ..io.readers import index_shards
from ..registry import Scheme, compile_template


@dataclass
class ShardNeeds:
    """The shards of one checkpoint a selection needs: ``needed`` (file names relative to ``root``, in the
    index's order), of ``total``; ``index`` is None for a checkpoint that is not a sharded index (then
    ``needed`` is its weight files, all of them)."""

    path: str
    index: str | None
    needed: list[str]
    total: int
    absent: list[str]  # of the needed, those not on disk here

    def as_dict(self) -> dict:
        return {"path": self.path, "index": self.index, "needed": self.needed, "total": self.total,
                "absent": self.absent}

    def line(self, side: str) -> str:
        where = f"{len(self.needed)} of {self.total} shards" if self.index else "not sharded: its one checkpoint"
        here = f"; not here: {', '.join(self.absent)}" if self.absent else "; all here"
        return f"{side}: {' '.join(self.needed) or '(none)'}  ({where}{here})"


def find_index(path: str | Path) -> Path | None:
    """The sharded index a checkpoint path opens through (the file itself, or one in the directory)."""
    path = Path(path)
    if path.name.endswith(".index.json"):
        return path
    if path.is_dir():
        return next((path / n for n in WEIGHT_INDEXES if (path / n).is_file()), None)
    return None


def _scheme(names: list[str], config: dict | None, scheme: Scheme | None, where: Path) -> Scheme:
    """A given scheme where its templates match the names (as ``verify`` applies one), else the detected."""
    if scheme is not None and any(compile_template(t).fullmatch(n) for g in scheme.groups
                                  for f in g.forms.values() for t in f.templates().values() for n in names):
        return scheme
    try:
        return choose_scheme(names, config)
    except SchemeError as e:
        raise SchemeError(f"{where}: {e}") from None


def selected(where: tuple[int, int | None], layers: set[int] | None, experts: set[int] | None) -> bool:
    """Whether an FFN tensor at (layer, expert) belongs to the selection (shared, dense and stacked expert
    tensors, expert None, go with their layer: as ``engine._select`` keeps them)."""
    layer, expert = where
    return (layers is None or layer in layers) and (experts is None or expert is None or expert in experts)


def shards_needed(path: str | Path, layers: set[int] | None, experts: set[int] | None = None,
                  scheme: Scheme | None = None) -> ShardNeeds:
    """The shard files holding the selected FFNs' tensors, from the index and config.json alone.

    Raises:
        CheckpointError: an unreadable index. SchemeError: its names hold no FFN a scheme knows.
    """
    path = Path(path)
    index = find_index(path)
    if index is None:
        files = [path.name] if path.is_file() else sorted(p.name for p in path.iterdir()
                                                          if p.suffix in WEIGHT_SUFFIXES)
        return ShardNeeds(str(path), None, files, len(files), [])
    _, weight_map = index_shards(index, absent_ok=True)  # validated as when it is opened
    names = list(weight_map)
    members = ffn_members(names, _scheme(names, read_config(index.parent), scheme, index))
    wanted = {weight_map[n] for n, where in members.items() if selected(where, layers, experts)}
    order = list(dict.fromkeys(weight_map.values()))
    needed = sorted(wanted)
    return ShardNeeds(str(path), index.name, needed, len(order),
                      [s for s in needed if not (index.parent / s).is_file()])


def refusal(sides: list[tuple[str, Checkpoint]], layers: str, experts: str | None,
            scheme: Scheme | None) -> FFNToolsError | None:
    """The error for selected FFN tensors that lie in absent shards, every side's at once; None if none do.

    Args:
        sides: ("A", checkpoint) for each side opened with shards absent.
        layers, experts: the selection as the user wrote it (parsed again here, for the message).
    """
    from ..specs import parse_spec

    problems = []
    for side, ckpt in sides:
        absent: Mapping = ckpt.stored.absent
        if not absent:
            continue
        needs = shards_needed(ckpt.path, parse_spec(layers), parse_spec(experts) if experts else None, scheme)
        missing = [s for s in needs.needed if s in absent]
        if missing:
            problems.append(f"{side} ({needs.path}): --layers {layers} needs {len(missing)} shard"
                            f"{'s' * (len(missing) > 1)} that {'are' if len(missing) > 1 else 'is'} not here: "
                            f"{', '.join(missing)}")
    if not problems:
        return None
    return CheckpointError("; ".join(problems) + "; fetch them, or choose layers whose shards are here ("
                           "`ffn-tools verify A B --layers RANGE --shards-needed` lists the shards a range needs)")


def search_names(ckpt: Checkpoint, scheme: Scheme, layers: set[int] | None, experts: set[int] | None) -> list[str]:
    """The tensors the FFN search looks among on a checkpoint with absent shards: every present tensor but
    the FFN tensors outside the selection (whose other half may lie in an absent shard)."""
    members = ffn_members(list(ckpt), scheme)
    return [n for n in ckpt if n not in members or selected(members[n], layers, experts)]
