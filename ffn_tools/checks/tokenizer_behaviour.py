"""Tokenizer files that differ where a vocabulary says nothing, compared by what the two tokenizers do.

A tokenizer rebuilt from a vocabulary (a GGUF's ``tokenizer.ggml.*``: tokens, ids, merges, token types, named
special ids) cannot give back how its source's files spelled the rest: whether special tokens are also in
``model.vocab`` or only in ``added_tokens``, the post-processor's form (Llama 3's ``Sequence[ByteLevel,
TemplateProcessing]`` and a lone ``TemplateProcessing`` add the same ids), ``model.ignore_merges``, and in
tokenizer_config.json the ``extra_special_tokens`` list (a GGUF marks every special token a control token, and
keeps no list) and ``tokenizer_class`` (transformers' GGUF reader picks one by architecture). Such differences
fail ``side_files``' file comparison though nothing a client computes need change.

``settle`` takes each tokenizer.json / tokenizer_config.json problem whose pair agrees on every fact a vocabulary
holds (``facts``: each token's id, the merges in rank order, each added token's id and special flag, the model's
type and unknown token; tokenizer_config.json without ``tokenizer_class`` and ``add_prefix_space`` (``OBSERVED``),
and without ``extra_special_tokens`` where the other side's tokenizer.json marks each of those tokens special:
``_config_agrees``) and has
transformers load both tokenizers: when they encode the built-in corpus (``corpus``) to the same ids, decode
those to the same text with special tokens kept and skipped, and mark the same tokens special, the problem
becomes a note saying so and what was not compared; otherwise it stays, with the first text they treat
differently. A pair that differs in a fact (two ids exchanged, merges reordered) stays a problem without this
check, named by that fact.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..io import nogc
from . import corpus
from .json_diff import diff, document, forget, merge_order, read_json
from .tokenizer_config import IGNORED, tokenizer_views

FILES = ("tokenizer.json", "tokenizer_config.json")
# tokenizer_config.json settings left to the behaviour check: the class (a GGUF names none), and whether a space is
# put before the first word (GPT-2's class saves false; a GGUF keeps no such key, and the rebuilt tokenizer's
# pre-tokenizer decides; where the two sides' tokenizers do not agree, every corpus text's first word encodes otherwise)
OBSERVED = ("tokenizer_class", "add_prefix_space")
NOT_COMPARED = "texts beyond the corpus"
NOT_COMPARED_LIST = ("the extra_special_tokens list (transformers' all_special_ids, which "
                     "convert_ids_to_tokens(skip_special_tokens=True) reads)")


def settle(ra: Path, rb: Path, problems: list[str], notes: list[str]) -> None:
    """Move each tokenizer problem in ``problems`` that only a rebuilt tokenizer's spelling makes (see the module
    doc) into ``notes``, when both tokenizers behave the same; a behaviour difference is added to the problem.
    Each file is parsed once (``json_diff.document``), and let go after."""
    try:
        _settle(ra, rb, problems, notes)
    finally:
        forget()
        _facts.cache_clear()


def _settle(ra: Path, rb: Path, problems: list[str], notes: list[str]) -> None:
    _name_the_fact(ra, rb, problems)
    _settle_sentencepiece(ra, rb, problems, notes)
    candidates = [p for p in problems if p.startswith(tuple(f"{f}: " for f in FILES)) and _agrees(ra, rb, p)]
    if not candidates:
        return
    why, n = behaviour(ra, rb)
    for p in candidates:
        i = problems.index(p)
        if why is None:
            del problems[i]
            listed = NOT_COMPARED + (f" and {NOT_COMPARED_LIST}" if "extra_special_tokens" in p else "")
            name = p.split(": ", 1)[0]
            parts = _parts(ra / name, rb / name)
            p = f"{name}: {', '.join(parts)} differ" if len(parts) > 1 else p
            notes.append(f"{p}: a tokenizer rebuilt from a vocabulary (as from a GGUF) cannot give this back; compared "
                         f"by behaviour instead: both encode the {n} texts of the built-in corpus to the same ids, "
                         f"decode them to the same text (special tokens kept and skipped) and mark the same tokens "
                         f"special (not compared: {listed})")
        else:
            problems[i] = f"{p}; and the tokenizers differ in what they do: {why}"


def _settle_sentencepiece(ra: Path, rb: Path, problems: list[str], notes: list[str]) -> None:
    """A tokenizer.model problem (its bytes differ) whose two sentencepiece models hold the same pieces, with the
    same scores and types (``pieces``), becomes a note when sentencepiece itself encodes the corpus to the same ids
    with both and decodes those to the same text; a rebuilt model (a GGUF's) keeps no trainer settings, no
    normalizer rule table it does not use. Otherwise the problem stays, with what differs."""
    i = next((i for i, p in enumerate(problems) if p.startswith("tokenizer.model: ")), None)
    if i is None:
        return
    pa, pb = pieces(ra / "tokenizer.model"), pieces(rb / "tokenizer.model")
    if pa is None or pb is None:
        return
    if pa != pb:
        k = next((k for k, (x, y) in enumerate(zip(pa, pb)) if x != y), min(len(pa), len(pb)))
        problems[i] += (f"; piece {k}: A {pa[k] if k < len(pa) else None}, B {pb[k] if k < len(pb) else None} "
                        f"(piece, score, type; A {len(pa)} pieces, B {len(pb)})")
        return
    why, n = sentencepiece_behaviour(ra / "tokenizer.model", rb / "tokenizer.model")
    if why is not None:
        problems[i] += f"; and the sentencepiece models differ in what they do: {why}"
        return
    notes.append(f"{problems.pop(i)}: a sentencepiece model rebuilt from a vocabulary (as from a GGUF) keeps its "
                 f"pieces, not its trainer's settings; compared by behaviour instead: both hold the same {len(pa)} "
                 f"pieces, scores and types, and sentencepiece encodes the {n} texts of the built-in corpus to the "
                 f"same ids with both and decodes them to the same text (not compared: {NOT_COMPARED})")


def pieces(path: Path) -> list[tuple[str, float, int]] | None:
    """A sentencepiece model's pieces as (piece, score, type), in id order; None where it cannot be read."""
    try:
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # (protobuf-generated)
        model.ParseFromString(path.read_bytes())
    except Exception:  # noqa: BLE001 - no sentencepiece, or no model: compared as bytes
        return None
    return [(p.piece, p.score, p.type) for p in model.pieces]


def sentencepiece_behaviour(a: Path, b: Path) -> tuple[str | None, int]:
    """The first corpus text sentencepiece encodes, or decodes, otherwise with model ``a`` than with ``b``, or None;
    and how many texts were compared. The corpus's special-token placeholders are written as each model's own
    control pieces (``corpus.texts`` of a stand-in naming them), so a control piece spelled out is compared too."""
    import sentencepiece

    sa, sb = (sentencepiece.SentencePieceProcessor(model_proto=f.read_bytes()) for f in (a, b))
    texts, _ = corpus.texts(_Specials(sa))
    for text in texts:
        ea, eb = sa.encode(text), sb.encode(text)
        if ea != eb:
            k = next((k for k, (x, y) in enumerate(zip(ea, eb)) if x != y), min(len(ea), len(eb)))
            return (f"{text[:40]!r} encodes otherwise from piece {k}: {ea[k:k + 8]} in A, {eb[k:k + 8]} in B"), len(texts)
        if sa.decode(ea) != sb.decode(eb):
            return f"{ea[:12]} decodes to {sa.decode(ea)[:40]!r} in A, {sb.decode(eb)[:40]!r} in B", len(texts)
    return None, len(texts)


class _Specials:
    """A sentencepiece model's bos/eos/unk/pad pieces under transformers' attribute names (``corpus.SPECIAL``)."""

    def __init__(self, sp):
        for name, i in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id()),
                        ("pad_token", sp.pad_id())):
            setattr(self, name, sp.id_to_piece(i) if 0 <= i < sp.get_piece_size() else None)


def _parts(a: Path, b: Path) -> list[str]:
    """The top-level keys in which JSON files ``a`` and ``b`` differ (``model``'s one by one)."""
    try:
        da, db = (document(f) for f in (a, b))
    except (OSError, ValueError):
        return []
    out = []
    for k in sorted((set(da) | set(db)) - {"name_or_path", "is_local", "local_files_only"}):
        x, y = da.get(k), db.get(k)
        if k == "model" and isinstance(x, dict) and isinstance(y, dict):
            out += [f"model.{m}" for m in sorted(set(x) | set(y)) if x.get(m) != y.get(m)]
        elif x != y:
            out.append(k)
    return out


def _agrees(ra: Path, rb: Path, problem: str) -> bool:
    if problem.startswith("tokenizer.json: "):
        fa, fb = facts(ra / "tokenizer.json"), facts(rb / "tokenizer.json")
        return fa is not None and fa == fb
    return _config_agrees(ra, rb)


def _name_the_fact(ra: Path, rb: Path, problems: list[str]) -> None:
    """A tokenizer.json problem whose pair differs in a fact (``facts``) names that fact, not the first difference
    in the file's order (a post-processor spelled otherwise, which alone would be compared by behaviour)."""
    i = next((i for i, p in enumerate(problems) if p.startswith("tokenizer.json: ")), None)
    if i is None or problems[i].startswith(("tokenizer.json: model.vocab", "tokenizer.json: model.merges",
                                            "tokenizer.json: added_tokens")):
        return
    fa, fb = facts(ra / "tokenizer.json"), facts(rb / "tokenizer.json")
    if fa is None or fb is None or fa == fb:
        return
    va, vb = ({"model": {"type": f["type"], "unk_token": f["unk"], "vocab": f["ids"], "merges": f["merges"]},
               "added_tokens": f["added"]} for f in (fa, fb))  # named as tokenizer.json names them
    why = (merge_order(fa["merges"], fb["merges"]) if fa["merges"] != fb["merges"] else None) or diff(va, vb, "")
    if why:
        problems[i] = f"tokenizer.json: {why}"


def facts(path: Path) -> dict | None:
    """What a vocabulary holds of tokenizer.json at ``path``: each token's id (model.vocab with the added tokens),
    the merges in rank order, each added token's id and special flag, the model's type and unknown token (a GGUF's
    tokenizer.ggml.unknown_token_id); None when unreadable. Computed once per file (its size and time), read-only."""
    try:
        st = path.stat()
    except OSError:
        return None
    return _facts(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _facts(name: str, mtime_ns: int, size: int) -> dict | None:
    path = Path(name)
    try:
        doc = document(path)
        model = doc["model"]
        ids = dict(model.get("vocab") or {}) if isinstance(model.get("vocab"), dict) else {
            t: i for i, t in enumerate(x[0] for x in model.get("vocab") or [])}  # unigram: [[piece, score], ...]
        added = {t["content"]: (t["id"], bool(t.get("special"))) for t in doc.get("added_tokens") or []}
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    for token, (i, _) in added.items():
        if ids.setdefault(token, i) != i:  # an added token over another id: a fact, kept as it is
            ids[f"{token} (added)"] = i
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return {"type": model.get("type"), "unk": model.get("unk_token"), "ids": ids, "merges": merges, "added": added}


def _config_agrees(ra: Path, rb: Path) -> bool:
    """tokenizer_config.json of A and B read the same (as ``side_files`` reads them) once ``tokenizer_class`` and
    null settings are left out, and ``extra_special_tokens`` where the other side's tokenizer.json marks each of
    its tokens special."""
    va, vb = read_json(ra / "tokenizer_config.json"), read_json(rb / "tokenizer_config.json")
    if not va or not vb:
        return False
    for v in (va, vb):
        for k in IGNORED["tokenizer_config.json"]:
            v.pop(k, None)
    va, vb = tokenizer_views(ra, rb, va, vb, [])
    for v in (va, vb):  # the class: a GGUF names none (transformers' reader picks one by architecture); a null
        for k in OBSERVED:  # setting (add_prefix_space: null, as Qwen2Tokenizer saves it) is no setting
            v.pop(k, None)
        for k in [k for k, x in v.items() if x is None]:
            del v[k]
    for v, other in ((va, rb), (vb, ra)):
        listed = v.get("extra_special_tokens")
        marked = {t: s for t, (_, s) in ((facts(other / "tokenizer.json") or {}).get("added") or {}).items()}
        if isinstance(listed, list) and all(isinstance(t, str) and marked.get(t) for t in listed):
            v.pop("extra_special_tokens")
    return diff(va, vb, "") is None


def transformers_tokenizer(root: Path):
    """transformers' ``AutoTokenizer`` of the files in ``root``, its warnings silenced, built with the cyclic
    collector paused (``io.nogc``: a 128K-token vocabulary is millions of objects). The last few built are kept,
    keyed on the files' names, sizes and modification times: a GGUF verify asks for A's three times (behaviour,
    the tokenizer check, the tokenization check), 1-3 s each for a 128K vocabulary. Treat it as read-only. Raises
    what transformers raises (ImportError without it)."""
    root = Path(root).resolve()
    files = tuple(sorted((f.name, st.st_size, st.st_mtime_ns) for f in root.iterdir()
                         if f.is_file() and (st := f.stat()))) if root.is_dir() else ()
    return _built(root, files)


@functools.lru_cache(maxsize=4)
def _built(root: Path, files: tuple):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with nogc.paused():
        return AutoTokenizer.from_pretrained(root)


def behaviour(ra: Path, rb: Path) -> tuple[str | None, int]:
    """The first thing A's and B's tokenizers (transformers' ``AutoTokenizer``) do differently on the built-in
    corpus, or None; and how many texts were compared."""
    try:
        ta, tb = transformers_tokenizer(ra), transformers_tokenizer(rb)
    except Exception as e:  # noqa: BLE001 - no transformers, or files it cannot load: nothing shows they agree
        return f"transformers could not load both tokenizers to compare them ({type(e).__name__}: {e})"[:200], 0
    texts, _ = corpus.texts(ta)
    for text in texts:
        ea, eb = list(ta.encode(text)), list(tb.encode(text))
        if ea != eb:
            k = next((k for k, (x, y) in enumerate(zip(ea, eb)) if x != y), min(len(ea), len(eb)))
            return (f"{text[:40]!r} encodes otherwise from token {k}: {ea[k:k + 8]} in A, {eb[k:k + 8]} in B "
                    f"({len(ea)} and {len(eb)} tokens)"), len(texts)
        for skip in (False, True):
            da, db = ta.decode(ea, skip_special_tokens=skip), tb.decode(eb, skip_special_tokens=skip)
            if da != db:
                return (f"{ea[:12]} decodes to {da[:40]!r} in A, {db[:40]!r} in B"
                        f"{' (special tokens skipped)' if skip else ''}"), len(texts)
    sa, sb = ({i: t.special for i, t in tok.added_tokens_decoder.items()} for tok in (ta, tb))
    if sa != sb:
        i = min(set(sa) ^ set(sb) | {i for i in sa.keys() & sb.keys() if sa[i] != sb[i]})
        return (f"token {i} is {'special' if sa.get(i) else 'not special' if i in sa else 'not added'} in A, "
                f"{'special' if sb.get(i) else 'not special' if i in sb else 'not added'} in B"), len(texts)
    return None, len(texts)
