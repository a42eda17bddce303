"""Where two JSON documents (or texts) first differ, named as a person reads them: "model.merges[3] is 'a b' in
A, 'ab' in B"; the same BPE merges in another order named as such (their order is their rank)."""

from __future__ import annotations

import bisect
import functools
import json
from pathlib import Path

from ..io import nogc

CLIP = 60
TABLES = ("vocab", "added_tokens_decoder")  # {token: id} tables inside a file: keys print as ['token']


class Unreadable(ValueError):
    """A side file its reader cannot read; the message is the problem sentence."""


def parse(name: str, data: bytes, side: str):
    kind = "UTF-8 text" if name.endswith((".txt", ".jinja")) else "JSON"
    try:
        text = data.decode("utf-8")
        return text if kind != "JSON" else nogc.loads(text)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError both are
        raise Unreadable(f"{name} in {side} is not valid {kind} ({e})") from e


def parse_file(path: Path, side: str):
    """``parse`` of the file at ``path``; a JSON object comes from ``document`` (parsed once), as a shallow copy
    (its top-level keys the caller's to change, the values below them shared and read-only)."""
    if path.name.endswith((".txt", ".jinja")):
        return parse(path.name, path.read_bytes(), side)
    try:
        doc = document(path)
    except ValueError:
        return parse(path.name, path.read_bytes(), side)  # raises Unreadable, naming why
    return dict(doc) if isinstance(doc, dict) else doc


def read_json(path: Path) -> dict:
    """The JSON object at ``path`` (``parse_file``'s shallow copy), or {} where it is absent, unreadable or no
    object: its own comparison reports it."""
    try:
        doc = document(path)
    except (OSError, ValueError):
        return {}
    return dict(doc) if isinstance(doc, dict) else {}


def document(path: Path):
    """The parsed JSON at ``path``, shared and read-only, parsed once per file (its size and time) until ``forget``:
    a 128K-token tokenizer.json takes 0.6 s to parse, and one side-files comparison read each up to six times."""
    st = path.stat()
    return _parsed(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)  # the two sides' tokenizer.json and tokenizer_config.json
def _parsed(path: str, mtime_ns: int, size: int):
    return nogc.loads(Path(path).read_text("utf-8"))


def forget() -> None:
    """Let the parsed files go (a 128K-token tokenizer.json is some 100 MB of Python objects)."""
    _parsed.cache_clear()


def diff(a, b, path: str, table: bool = False) -> str | None:
    """Where JSON values ``a`` (A) and ``b`` (B) first differ: "path is X in A, Y in B"; None when equal."""
    if isinstance(a, list) and isinstance(b, list) and by_id(a) and by_id(b):  # added_tokens: named by id
        a, b, table = {f"id={t['id']}": t for t in a}, {f"id={t['id']}": t for t in b}, True
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            p = (f"{path}[{k}]" if table and k.startswith("id=") else f"{path}[{k!r}]" if table or not
                 k.isidentifier() else f"{path}.{k}" if path else k)
            if k not in b or k not in a:
                return f"{p} is {clip(a[k])} in A and missing in B" if k in a else f"{p} is only in B ({clip(b[k])})"
            why = diff(a[k], b[k], p, k in TABLES)
            if why:
                return why
        return None
    if isinstance(a, list) and isinstance(b, list) and not leaf(a) | leaf(b):
        why = next((w for i, (x, y) in enumerate(zip(a, b)) if (w := diff(x, y, f"{path}[{i}]"))), None)
        return why or (None if len(a) == len(b) else f"{path or 'the list'} has {len(a)} items in A, {len(b)} in B")
    if same(a, b):
        return None
    if isinstance(a, str) and isinstance(b, str) and max(len(a), len(b)) > CLIP:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"{path or 'the text'} differs from character {i}: {clip(a[i:])} in A, {clip(b[i:])} in B"
    return f"{path or 'the value'} is {clip(a)} in A, {clip(b)} in B"


def leaf(items: list) -> bool:
    """A short list of scalars (a merge pair, eos ids) reads as one value."""
    return len(items) <= 8 and not any(isinstance(t, (dict, list)) for t in items)


def by_id(items: list) -> bool:
    ids = [t.get("id") if isinstance(t, dict) else None for t in items]
    return all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids)


def same(a, b) -> bool:
    """Equal as JSON values: 1 == 1.0, but true is not 1."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same, a, b))
    return (isinstance(a, bool), a) == (isinstance(b, bool), b)


def diff_text(a: str, b: str) -> str | None:
    la, lb = a.split("\n"), b.split("\n")
    i = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), None)
    return (f"line {i + 1} is {clip(la[i])} in A, {clip(lb[i])} in B" if i is not None
            else f"A has {len(la)} lines, B {len(lb)}" if la != lb else None)


def clip(v) -> str:
    s = repr(v) if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return s if len(s) <= CLIP else s[:CLIP - 3] + "..."



def merge_order(a: list, b: list) -> str | None:
    """When A's and B's BPE merges are one set in another order, where: a merge's position is its rank (BPE
    applies the first applicable merge of the list), so the order is compared, not only the set."""
    pa, pb = ([m if isinstance(m, str) else " ".join(m) for m in x] for x in (a, b))
    if sorted(pa) != sorted(pb):
        return None
    i = next(i for i, (x, y) in enumerate(zip(pa, pb)) if x != y)
    rank = {m: r for r, m in enumerate(pb)}
    kept: list[int] = []  # the longest run of A's merges in B's order (patience sorting): the rest moved
    for r in (rank[m] for m in pa):
        at = bisect.bisect_left(kept, r)
        kept[at:at + 1] = [r]
    return (f"model.merges: the same {len(pa)} merges in another order ({len(pa) - len(kept)} moved against the "
            f"rest; first at rank {i}: {clip(pa[i])} in A, {clip(pb[i])} in B): BPE applies merges by rank, so "
            "text tokenizes differently")
