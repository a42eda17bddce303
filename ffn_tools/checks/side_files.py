"""The side files a client reads beside the weights, in ``verify``: tokenizer, chat template, generation
defaults. Each file of A must be in B and read the same: byte-identical, or equal as its reader reads it (JSON
key by key, text line by line, binary byte by byte), so a conversion that drops the tokenizer, exchanges two
token ids, edits the chat template or loses generation_config.json (eos lost: generation never stops) fails.

transformers' ``save_pretrained`` of a loaded tokenizer (``mlx_lm.convert`` re-saves it so) rewrites
tokenizer_config.json without changing the tokenizer; measured with transformers 5 on a v4-era file, each read
as equal here: adds ``is_local``/``local_files_only`` (loader arguments) and ``backend``/``model_max_length``
(defaults); writes special tokens as strings (their flags are in tokenizer.json); renames
``additional_special_tokens`` ``extra_special_tokens``; drops ``name_or_path``, ``added_tokens_decoder`` (in
tokenizer.json's ``added_tokens``), null special tokens, special_tokens_map.json (in tokenizer_config.json)
and vocab.json/merges.txt (in tokenizer.json); moves ``chat_template`` to chat_template.jinja. Two are notes,
as transformers 4 reads them: ``add_bos_token`` dropped (transformers 5 ignores it beside tokenizer.json: its
post_processor decides), ``PreTrainedTokenizerFast`` renamed ``TokenizersBackend``.

tokenizer.json is compared in full, BPE merges in order (a merge's position is its rank): merges that are one set
in another order fail with how many moved. One key may be only in B's tokenizer_config.json, a note: ``pad_token``
(``ONLY_IN_B``; a GGUF names one where its source's tokenizer had none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..errors import listing
from ..io import nogc
from ..io.store import SIDE_FILES
from . import Check
from .json_diff import Unreadable, diff, diff_text, merge_order, parse_file, read_json
from .tokenizer_behaviour import settle
from .tokenizer_config import IGNORED, content, tokenizer_views

MAX_LISTED = 8
MISSING = "is in A and missing in B"

BINARY = ("tokenizer.model", "tokenizer.model.v3")
TABLE_FILES = ("vocab.json", "added_tokens.json")  # {token: id} at the top: keys print as ['token']



@dataclass
class SideFilesResult(Check):
    """Every side file of A, found in B and read the same, or why not. ``problems``: "file: what differs" or
    "file is in A and missing in B"; ``notes``: facts that are not failures (a file only in B); ``skipped``: why
    nothing was compared (--no-side-files, a single weight file)."""

    name: ClassVar[str] = "side files"

    identical: list[str] = field(default_factory=list)  # byte-identical or equal as their reader reads them

    def line(self) -> str:
        if self.skipped:
            return f"side files: not compared ({self.skipped})"
        missing = sum(p.endswith(MISSING) and ": " not in p for p in self.problems)
        differ = len(self.problems) - missing
        listed = f" ({listing(self.identical, MAX_LISTED)})" if self.identical else ""
        notes = f", {len(self.notes)} note{'s' * (len(self.notes) > 1)}" if self.notes else ""
        return (f"side files: {len(self.identical)} identical{listed}, {differ} differ{'s' * (differ == 1)}, "
                f"{missing} missing in B{notes}")

    def as_dict(self) -> dict:
        return {"identical": self.identical, "problems": self.problems, "notes": self.notes,
                "skipped": self.skipped, "passed": self.verdict}


def compare_side_files(root_a: Path | None, root_b: Path | None, config_b: dict | None = None) -> SideFilesResult:
    """Compare the side files (``SIDE_FILES``) of checkpoints A and B as their clients read them.

    Args:
        root_a, root_b: the directories holding each checkpoint's config.json; None for a single weight file.
        config_b: B's config as its reader presents it (a native checkpoint's, from params.json), where B's
            client derives settings from it; None: B's config.json.

    Returns:
        The files equal in both; a problem for each file of A that B lacks or reads differently; notes (files
        only in B, re-save changes that change nothing); ``skipped`` when A or B is no directory.
    """
    if root_a is None or root_b is None or not (Path(root_a).is_dir() and Path(root_b).is_dir()):
        for side, root in (("A", root_a), ("B", root_b)):
            if root is None or not Path(root).is_dir():
                reason = "is a single weight file" if root is None else f"{root} is not a directory"
                return SideFilesResult(skipped=f"{side} {reason}: no side files beside it")
    ra, rb, res = Path(str(root_a)), Path(str(root_b)), SideFilesResult()
    names = [n for p in SIDE_FILES for n in (sorted({str(f.relative_to(r)) for r in (ra, rb) for f in r.glob(p)})
                                            if "*" in p else [p])]
    for name in names:
        if not (ra / name).is_file():
            res.notes += [f"B has {name}, A has none"] if (rb / name).is_file() else []
        elif not (rb / name).is_file():
            carried = _carried(name, ra, rb, config_b)
            if name == "generation_config.json" and carried is None and \
                    (derived := _derived_generation(ra / name, rb, config_b)):
                res.problems.append(f"{name} {MISSING}, and {derived}")
            else:
                (res.notes if carried else res.problems).append(carried or f"{name} {MISSING}")
        else:
            try:
                why = _differs(name, ra, rb, res.notes)
            except OSError as e:
                why = f"{name} cannot be read ({e})"
            except Unreadable as e:
                why = str(e)
            (res.problems.append(why) if why else res.identical.append(name))
    settle(ra, rb, res.problems, res.notes)
    return res


def _differs(name: str, ra: Path, rb: Path, notes: list[str]) -> str | None:
    """None when A's and B's ``name`` read the same, else "name: where they first differ"."""
    a, b = (ra / name).read_bytes(), (rb / name).read_bytes()
    if a == b:
        return None
    if name in BINARY:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"{name}: bytes differ from offset {at} (A {len(a)} bytes, B {len(b)} bytes)"
    da, db = parse_file(ra / name, "A"), parse_file(rb / name, "B")
    if isinstance(da, dict) and isinstance(db, dict):
        for k in IGNORED.get(name, ()):
            da.pop(k, None)
            db.pop(k, None)
        if name == "tokenizer.json" and da != db:  # as tokenizers reads them; named as written unless A is
            sa, sb = _canonical(ra / name, "A"), _canonical(rb / name, "B")  # in an older writer's form
            if sa is not None and sa == sb:
                return None
            if sa is not None and sb is not None:
                ca, cb = nogc.loads(sa), nogc.loads(sb)
                da, db = (ca, cb) if ca != da else (da, db)
        if name == "tokenizer_config.json":
            da, db = tokenizer_views(ra, rb, da, db, notes)
        if name == "generation_config.json":
            settle_token_ids(ra, rb, da, db, notes)
    why = diff_text(da, db) if name.endswith((".txt", ".jinja")) else diff(da, db, "", name in TABLE_FILES)
    if why and why.startswith("model.merges[") and name == "tokenizer.json":
        why = merge_order(da["model"]["merges"], db["model"]["merges"]) or why
    return why and f"{name}: {why}"


def settle_token_ids(ra: Path, rb: Path, da: dict, db: dict, notes: list[str]) -> None:
    """Where A's and B's generation_config.json disagree on the pad id only in where it is kept, drop it from both
    (``da``, ``db``) with a note: the pad id only fills a finished sequence's places in a batch, and inputs are padded
    with the tokenizer's pad token; each side's is its generation_config.json's, else config.json's, else its
    tokenizer's (``pad_token`` in tokenizer_config.json, by id in tokenizer.json). A GGUF read back writes the pad id
    there that A's tokenizer names. bos and eos stay compared as written: generate() starts and stops by them."""
    key = "pad_token_id"
    if da.get(key) == db.get(key):
        return
    ia, ib = _token_id(ra, da, key), _token_id(rb, db, key)
    if ia is not None and ia == ib:
        kept = [f"{side}'s {'generation_config.json' if key in d else 'config.json or tokenizer'}"
                for side, d in (("A", da), ("B", db))]
        notes.append(f"generation_config.json: {key} is kept in {kept[0]} and {kept[1]}: "
                     f"{ia[0] if len(ia) == 1 else ia} in both")
        da.pop(key, None)
        db.pop(key, None)


def _token_id(root: Path, generation: dict, key: str) -> list[int] | None:
    """The id(s) generate() ends up with for ``key`` (pad_token_id, ...): as a sorted list (eos may be several)."""
    value = generation.get(key)
    if value is None:
        value = read_json(root / "config.json").get(key)
    if value is None:
        value = _tokenizer_id(root, key.removesuffix("_id"))
    if value is None:
        return None
    return sorted(value) if isinstance(value, list) else [value]


def _tokenizer_id(root: Path, special: str) -> int | None:
    """The id of the tokenizer's ``special`` token (pad_token, ...), from its files, without loading it."""
    token = content(read_json(root / "tokenizer_config.json").get(special))
    if not token:
        return None
    tok = read_json(root / "tokenizer.json")
    added = {t.get("content"): t.get("id") for t in tok.get("added_tokens", [])}
    vocab = tok.get("model", {}).get("vocab")
    return added.get(token, vocab.get(token) if isinstance(vocab, dict) else None)


def _canonical(path: Path, side: str) -> str | None:
    """tokenizer.json at ``path`` as the tokenizers library reads it, written back (older writers' merges and
    defaults in today's form); None without the library. Compared as text first: equal texts need no parse (two
    128K-token files' parse was most of a side-files comparison)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # without the library: the JSON compared as written
        return None
    try:
        return Tokenizer.from_file(str(path)).to_str()
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot load
        raise Unreadable(f"tokenizer.json in {side} cannot be loaded by tokenizers ({e})") from e


def _carried(name: str, ra: Path, rb: Path, config_b: dict | None = None) -> str | None:
    """A note when A's ``name``, absent in B, is read from another file of B (where save_pretrained moves it)."""
    a, cb = read_json(ra / name), read_json(rb / "tokenizer_config.json")
    cb.setdefault("additional_special_tokens", cb.get("extra_special_tokens"))
    tok = read_json(rb / "tokenizer.json")
    added, model = {(t.get("content"), t.get("id")) for t in tok.get("added_tokens", [])}, tok.get("model", {})
    if name.endswith(".jinja") and cb.get("chat_template"):
        where = "B's tokenizer_config.json holds the chat template (compared there)"
    elif name == "special_tokens_map.json" and a and all(content(v) == content(cb.get(k)) for k, v in a.items()):
        where = "its tokens are in B's tokenizer_config.json"
    elif name == "added_tokens.json" and a and set(a.items()) <= added:
        where = "its tokens are in B's tokenizer.json"
    elif name == "vocab.json" and a and a == model.get("vocab"):
        where = "B's tokenizer.json holds the same vocabulary"
    elif name == "merges.txt" and _merges(ra / name) == [m if isinstance(m, str) else " ".join(m)
                                                         for m in model.get("merges", [])]:
        where = "B's tokenizer.json holds the same merges"
    elif name == "generation_config.json" and _derived_generation(ra / name, rb, config_b) == SAME_GENERATION:
        where = SAME_GENERATION
    else:
        return None
    return f"{name} {MISSING}; {where}"


SAME_GENERATION = "transformers derives the same generation settings from B's config.json"


def _derived_generation(file_a: Path, rb: Path, config_b: dict | None = None) -> str | None:
    """Where B has no generation_config.json, transformers generates with the settings it derives from B's
    config.json (``GenerationConfig.from_model_config``): ``SAME_GENERATION`` when those are A's file's, as
    ``GenerationConfig`` reads it, else which differ; None when they cannot be read."""
    try:
        from transformers import AutoConfig, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        a = GenerationConfig.from_pretrained(file_a.parent).to_dict()
        cfg = (AutoConfig.for_model(**{k: v for k, v in config_b.items() if k != "transformers_version"})
               if config_b else AutoConfig.from_pretrained(rb))
        b = GenerationConfig.from_model_config(cfg).to_dict()
    except Exception:  # noqa: BLE001 - no transformers, a config it cannot read: compared as files (missing)
        return None
    drop = ("transformers_version", "_from_model_config")
    differ = sorted(k for k in set(a) | set(b) if k not in drop and a.get(k) != b.get(k))
    if not differ:
        return SAME_GENERATION
    return ("what transformers derives from B's config.json differs: "
            + "; ".join(f"{k} {a.get(k)!r} in A, {b.get(k)!r} in B" for k in differ[:4]))


def _merges(path: Path) -> list[str] | None:
    """merges.txt's merges, without its ``#version`` header; None when unreadable."""
    try:
        lines = path.read_text("utf-8").split("\n")
    except (OSError, ValueError):
        return None
    return [m for i, m in enumerate(lines) if m and not (i == 0 and m.startswith("#version"))]


