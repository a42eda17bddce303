"""Multi-token-prediction (MTP, NextN) heads: found by their names as each family lays them out (declared as data in
``schemes/mtp.json``), named, and kept, dropped or taken alone on purpose (``convert --mtp``).

DeepSeek-V3/V3.2 and GLM-4.5+ number their NextN blocks after the main layers (``model.layers.61`` of a 61-layer
model, with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm/head`` and ``embed_tokens`` beside the block);
Qwen3-Next/Qwen3.5 keep theirs under ``mtp.``, MiMo under ``model.mtp_layers.``. How many there are is the
config's (``num_nextn_predict_layers``, ``mtp_num_hidden_layers``) or, with no such key, counted from the tensors.
A head's FFNs are FFNs like any other (its block's experts are found by the family's scheme); what this module
adds is which tensors are the head, so that ``inspect`` lists them apart from the main layers, a conversion never
drops them without saying so and recording it (``RECORD`` in the output's metadata), and ``verify`` names a head B
lacks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import FFNToolsError, listing
from .mtp_option import MODES, RECORD
from .io.safetensors_format import build_header
from .io.store import Checkpoint, TensorInfo

DATA = Path(__file__).with_name("schemes") / "mtp.json"
HEAD_FILE = "mtp.safetensors"  # the heads beside a model whose runtime has no place for them (MLX), source names


@dataclass(frozen=True)
class DraftForm:
    """How a family's head runs as a draft (``verification.draft``), its modules by leaf name under the head:
    ``x = proj([embed_norm(embed(t+1)); hidden_norm(h)])`` -> its blocks -> ``norm`` -> ``head`` (None: the main
    model's output head; ``embed`` None: the main model's embedding); ``plus_one``: its norms scale by 1 + w
    (Qwen3-Next's); ``layer_type``: the config ``layer_types`` entry its blocks run as (None: the config has none)."""

    embed_norm: str
    hidden_norm: str
    proj: str
    norm: str
    head: str | None
    embed: str | None
    plus_one: bool
    layer_type: str | None
    hidden_first: bool = False  # the projection reads [hidden_norm(h); embed_norm(embed)] (MiMo's order)
    in_block: bool = False  # its modules sit in its (one) block, not beside it (MiMo's model.mtp_layers.0.input_proj)
    family: str | None = None  # the transformers model_type its blocks and main model run as (MiMo's: qwen2)
    mask_first: bool = False  # position 0's embedding zeroed (vLLM's MiMo MTP)


@dataclass(frozen=True)
class Layout:
    """One family's MTP layout (a row of ``schemes/mtp.json``)."""

    name: str
    description: str
    kind: str  # "numbered": blocks numbered after the main layers; "prefix": everything under ``prefix``
    blocks: str  # a block's module path, ``{layer}`` its number
    counts: tuple[str, ...]  # config keys saying how many blocks
    own: tuple[str, ...]  # the head's modules beside its blocks
    model_types: tuple[str, ...]
    prefix: str = ""
    draft: DraftForm | None = None  # None: the draft reference does not run this family's form

    def block_number(self, name: str) -> int | None:
        """The block number of tensor ``name`` under this layout's blocks, or None."""
        head, _, tail = self.blocks.partition("{layer}")
        if not name.startswith(head):
            return None
        digits = name[len(head):].split(".", 1)[0]
        return int(digits) if digits.isdigit() and name[len(head) + len(digits):].startswith(tail + ".") else None


def _load() -> tuple[Layout, ...]:
    rows = json.loads(DATA.read_text())["layouts"]
    return tuple(Layout(r["name"], r["description"], r["kind"], r["blocks"], tuple(r["counts"]), tuple(r["own"]),
                        tuple(r["model_types"]), r.get("prefix", ""), DraftForm(**r["draft"]) if r.get("draft") else None)
                 for r in rows)


LAYOUTS = _load()


@dataclass(frozen=True)
class Head:
    """One MTP head: a NextN block numbered after the main layers, or a family's whole ``mtp.`` module.

    Attributes:
        layout: the family layout it was found by.
        name: how messages name it (``model.layers.2``, ``mtp``).
        blocks: its decoder blocks' numbers (the layer number of a NextN block; ``mtp.layers.{i}``'s i).
        tensors: every tensor of the head, sorted.
    """

    layout: Layout
    name: str
    blocks: tuple[int, ...]
    tensors: tuple[str, ...]

    def own(self) -> list[str]:
        """The head's own modules found (``enorm``, ``eh_proj``, ...), in the layout's order."""
        return [m for m in self.layout.own if any(f".{m}." in f".{t[len(self.name) + 1:]}" for t in self.tensors)]

    def describe(self) -> str:
        return f"MTP head {self.name}.* ({self.layout.name}: {len(self.tensors)} tensors)"


NESTED = ("text_config", "language_config")  # a multimodal config's language model


def text_view(config: Mapping | None) -> Mapping:
    """``config`` as transformers' composite config classes read their language model's settings
    (``get_text_config``): a multimodal config.json keeps ``num_hidden_layers`` and the MTP count in its
    ``text_config`` (GLM-4.5V's glm4v_moe: ``num_nextn_predict_layers``; Qwen3.5's), each key the top level lacks
    read from there; the top level's own keys (its ``model_type`` among them) stand."""
    config = config or {}
    for key in NESTED:
        inner = config.get(key)
        if isinstance(inner, Mapping):
            return {**inner, **config}
    return config


def declared(config: Mapping | None, layout: Layout | None = None) -> tuple[str, int] | None:
    """The config key saying how many MTP blocks there are and its value (of ``layout``'s keys, or any layout's),
    at the top of ``config`` or in its language model's (``text_view``)."""
    config = text_view(config)
    for key in (layout.counts if layout else tuple(k for lay in LAYOUTS for k in lay.counts)):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return None


def numbering(config: Mapping | None) -> Mapping | None:
    """``config`` as layers are numbered from it: its language model's ``num_hidden_layers`` at the top where only a
    nested config holds it (Qwen3.5's multimodal config.json), which an MTP module's blocks are numbered after
    (families.json's ``mtp.layers.{layer}`` prefixes); ``config`` itself otherwise."""
    if not config or "num_hidden_layers" in config:
        return config
    for key in NESTED:
        inner = config.get(key)
        if isinstance(inner, Mapping) and "num_hidden_layers" in inner:
            return {**config, "num_hidden_layers": inner["num_hidden_layers"]}
    return config


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def find_heads(names: Iterable[str], config: Mapping | None) -> tuple[Head, ...]:
    """The MTP heads among tensor ``names`` (a checkpoint's), by each family's layout.

    A block numbered after the main layers (``num_hidden_layers``) is a NextN head where the config declares
    NextN blocks, its model_type is a NextN family's, or the block holds a head's own tensor (``eh_proj``); a
    ``prefix`` layout's module is a head wherever its tensors are. A multimodal config's counts are read from its
    language model's (``text_view``).
    """
    names = list(names)
    config = text_view(config)
    heads: list[Head] = []
    for lay in LAYOUTS:
        if lay.kind == "prefix":
            mine = sorted(n for n in names if n.startswith(lay.prefix))
            if mine:
                blocks = sorted({b for n in mine if (b := lay.block_number(n)) is not None})
                heads.append(Head(lay, lay.prefix.rstrip("."), tuple(blocks), tuple(mine)))
            continue
        main = config.get("num_hidden_layers")
        by_block: dict[int, list[str]] = {}
        for n in names:
            b = lay.block_number(n)
            if b is not None:
                by_block.setdefault(b, []).append(n)
        count = declared(config, lay)
        family = config.get("model_type") in lay.model_types or bool(count and count[1])
        for b in sorted(by_block):
            mine = sorted(by_block[b])
            block = lay.blocks.format(layer=b)
            marked = any(n.startswith(f"{block}.{m}.") for n in mine for m in lay.own)
            past = isinstance(main, int) and b >= main
            if marked and (past or not isinstance(main, int)) or past and family:
                heads.append(Head(lay, block, (b,), tuple(mine)))
    return tuple(heads)


def head_tensors(heads: Iterable[Head]) -> frozenset[str]:
    return frozenset(t for h in heads for t in h.tensors)


def head_of(name: str, heads: Iterable[Head]) -> Head | None:
    """The head tensor ``name`` belongs to (a companion ``.scales`` beside a head's weight too), or None."""
    module = name.rpartition(".")[0]
    for h in heads:
        if name in h.tensors or any(t.rpartition(".")[0] == module for t in h.tensors):
            return h
    return None


def check_count(heads: tuple[Head, ...], config: Mapping | None, metadata: Mapping[str, str] | None = None
                ) -> str | None:
    """A line where the config declares another number of MTP blocks than the tensors hold (a head lost on the
    way, or a config copied from another model); None where they agree, nothing is declared, or the checkpoint
    records that its heads were left out on purpose (``--mtp drop``: ``metadata``'s ``RECORD``)."""
    said = declared(config)
    if said is None or (recorded(metadata) or {}).get("mtp") == "drop":
        return None
    key, n = said
    found = sum(len(h.blocks) or 1 for h in heads)
    if n == found:
        return None
    where = listing([h.name for h in heads], 4) if heads else "none"
    return f"config.json's {key} is {n} but the tensors hold {found} MTP block{'s' * (found != 1)} ({where})"


def select(names: Iterable[str], heads: tuple[Head, ...], mode: str) -> list[str]:
    """The tensor names ``--mtp MODE`` writes: all (keep), all but the heads' (drop), the heads' alone (only).

    Raises:
        FFNToolsError: an unknown mode, or ``only`` of a checkpoint with no head.
    """
    if mode not in MODES:
        raise FFNToolsError(f"--mtp {mode}: choose one of {', '.join(MODES)}")
    names = list(names)
    if mode == "keep":
        return names
    if not heads:
        if mode == "only":
            raise FFNToolsError("--mtp only: the checkpoint has no MTP head (no NextN block past num_hidden_layers, "
                                f"no {', '.join(lay.prefix + '*' for lay in LAYOUTS if lay.prefix)} tensors)")
        return names
    inside = {n for n in names if head_of(n, heads) is not None}
    return [n for n in names if (n in inside) == (mode == "only")]


def record(mode: str, heads: tuple[Head, ...], metadata: Mapping[str, str] | None = None) -> dict[str, str]:
    """The metadata an output written with ``--mtp MODE`` carries (``RECORD``): what was done to which heads; an
    input without heads that records them dropped (its ``metadata``) passes its record on, so a chain of
    conversions still says the heads were left out on purpose."""
    if not heads and (recorded(metadata) or {}).get("mtp") == "drop":
        return {RECORD: (metadata or {})[RECORD]}
    if mode == "keep" or not heads:
        return {}
    return {RECORD: json.dumps({"mtp": mode, "heads": [h.name for h in heads],
                                "tensors": sum(len(h.tensors) for h in heads)})}


def recorded(metadata: Mapping[str, str] | None) -> dict | None:
    """What an output's metadata says ``--mtp`` did (``record``), or None."""
    raw = (metadata or {}).get(RECORD)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def said(mode: str, heads: tuple[Head, ...], hint: bool = True) -> list[str]:
    """The summary's line for what ``--mtp MODE`` did; [] where there is no head to speak of. ``hint``: a kept
    head's line names ``--mtp drop`` (the output format takes it)."""
    if not heads:
        return []
    what = listing([h.name for h in heads], 4)
    n = sum(len(h.tensors) for h in heads)
    if mode == "drop":
        return [f"dropped the MTP head{'s' * (len(heads) > 1)} {what} ({n} tensors; --mtp drop), recorded in the "
                f"metadata as {RECORD}"]
    if mode == "only":
        return [f"wrote the MTP head{'s' * (len(heads) > 1)} {what} alone ({n} tensors; --mtp only), recorded in the "
                f"metadata as {RECORD}"]
    return [f"kept the MTP head{'s' * (len(heads) > 1)} {what} ({n} tensors, names as the source"
            + ("; --mtp drop leaves it out)" if hint else ")")]


class Without(Checkpoint):
    """``ckpt`` without the tensors ``drop`` (its MTP heads): what an export whose model has no place for a head
    writes the model from, the head placed otherwise (``HEAD_FILE``)."""

    def __init__(self, ckpt: Checkpoint, drop: frozenset[str]):
        self.base, self.drop = ckpt, drop
        infos = {n: ckpt.info(n) for n in ckpt if n not in drop}
        super().__init__(ckpt.path, ckpt.root, ckpt.files, infos, ckpt.metadata, ckpt.config)
        self.view_of(ckpt)
        self.like, self.absent, self.kept_codes = ckpt.like, ckpt.absent, ckpt.kept_codes

    def _read(self, info: TensorInfo):
        return self.base[info.name]

    def read_raw(self, name: str):
        return self.base.read_raw(name)

    def quantized(self, name: str):
        return self.base.quantized(name)

    def quantized_parts(self, name: str):
        return self.base.quantized_parts(name)

    def carried_metadata(self):
        return self.base.carried_metadata()

    def rebuilt_files(self):
        return self.base.rebuilt_files()

    def decoded(self) -> list[dict]:
        return self.base.decoded()

    @property
    def stored(self) -> Checkpoint:
        return self.base.stored

    def __reduce__(self):  # a worker process opens the checkpoint again and drops the same names
        return Without, (self.base, self.drop)

    def close(self) -> None:
        self.base.close()


def without(ckpt: Checkpoint, heads: tuple[Head, ...]) -> Checkpoint:
    """``ckpt`` without its heads' tensors (their companions too: an FP8 weight's ``_scale_inv``)."""
    return Without(ckpt, frozenset(n for n in ckpt if head_of(n, heads) is not None))


def head_file(ckpt: Checkpoint, heads: tuple[Head, ...]) -> bytes:
    """The heads' tensors as one safetensors file (``HEAD_FILE``), bytes as read, names as the source's; its
    metadata says what it is."""
    names = sorted(n for n in ckpt if head_of(n, heads) is not None)
    raws = [ckpt.read_raw(n) for n in names]
    meta = {"format": "pt", RECORD: json.dumps({"mtp": "beside", "heads": [h.name for h in heads],
                                                "tensors": len(names)})}
    return build_header([(n, r.dtype, r.shape, len(r)) for n, r in zip(names, raws)], meta) + b"".join(raws)


def beside(root: Path) -> tuple[Path | None, dict[str, TensorInfo]]:
    """The heads written beside a model (``HEAD_FILE`` in ``root``): its path and its tensors' infos (source
    names, byte offsets in it); (None, {}) where there is none."""
    path = Path(root) / HEAD_FILE
    if not path.is_file():
        return None, {}
    from .io.readers import open_checkpoint

    with open_checkpoint(path) as c:
        return path, {n: c.info(n) for n in c}


def placed(heads: tuple[Head, ...], where: str) -> list[str]:
    """The summary's line for heads written beside the model as ``HEAD_FILE`` (``where``: why there)."""
    if not heads:
        return []
    return [f"wrote the MTP head{'s' * (len(heads) > 1)} {listing([h.name for h in heads], 4)} "
            f"({sum(len(h.tensors) for h in heads)} tensors, as stored, names as the source) beside the model as "
            f"{HEAD_FILE}: {where}; convert --to torch from this directory brings it back"]


def said_of_output(heads: tuple[Head, ...], to: str, summary: dict,
                   reopen: Callable[[], tuple[frozenset[str], Mapping[str, str]] | None]) -> dict:
    """``summary`` (a conversion's) with what became of the input's MTP ``heads`` said, from what the output
    (opened again by ``reopen``: its tensor names and metadata) holds, where its export said nothing of them: kept (every head
    tensor there, by name), or a warning naming each head the output lacks without recording that it was dropped
    (never a silent drop). An output that could not be opened again (None) is said so."""
    changes = list(summary.get("changes") or [])
    if not heads or any("MTP head" in c for c in changes):
        return summary
    output = reopen()
    if output is None:
        lost = [f"the MTP head{'s' * (len(heads) > 1)} {listing([h.name for h in heads], 4)} of the input: "
                f"not checked in the {to} output (it could not be opened again)"]
        return {**summary, "warnings": [*summary.get("warnings", []), *lost]}
    names, metadata = output
    missing = [h for h in heads if any(t not in names for t in h.tensors)]
    if not missing:
        return {**summary, "changes": [*changes, *said("keep", heads, hint=False)]}
    if (recorded(metadata) or {}).get("mtp") == "drop":
        return {**summary, "changes": [*changes, *said("drop", tuple(missing))]}
    lost = [f"the {to} output lacks the MTP head {h.name} ({h.layout.name}, {len(h.tensors)} tensors; a "
            "speculative-decoding draft): its writer has no place for it under the source's names; --to torch keeps "
            "it" for h in missing]
    return {**summary, "warnings": [*summary.get("warnings", []), *lost]}


def named_in(error: FFNToolsError, heads: tuple[Head, ...], to: str) -> FFNToolsError:
    """``error`` (a format's refusal), its message saying which MTP head the tensors it names are, where it names
    some: ``--to dcp``'s torchtitan names have no place for DeepSeek's ``eh_proj``."""
    named = [h.name for h in heads if any(t in str(error) for t in h.tensors)]
    if named:
        error.args = (f"{error} (of the MTP head{'s' * (len(named) > 1)} {listing(named, 4)}: the {to} layout has no "
                      "place for it; --to torch keeps it, --mtp drop leaves it out where the format takes it)",
                      *error.args[1:])
    return error
