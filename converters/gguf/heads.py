"""``--to gguf --mtp``: what llama.cpp's converter does with a model's MTP (NextN) heads (``ffn_tools.mtp``).

convert_hf_to_gguf.py has ``--mtp`` (the heads alone) and ``--no-mtp`` for the families whose converter class
exports heads (``supports_mtp_export``: DeepSeek-V3.2's, GLM-4.5's, ...); its DeepSeek-V3 class has neither and
writes no head. The writer asks (``request``), the worker sets the class before the converter runs (``set_class``)
and records in the file what became of the heads (``RECORD``, as the other formats record ``--mtp drop``), and the
summary says it (``changes``).
"""

from __future__ import annotations

from ffn_tools import mtp
from ffn_tools.errors import FFNToolsError, listing


def request(ckpt, mode: str | None) -> tuple[tuple, dict | None]:
    """``ckpt``'s heads, and the worker's request for ``--mtp MODE`` (the mode, each mode's metadata record; None
    without a head).

    Raises:
        FFNToolsError: an unknown mode, or only of a model without a head.
    """
    heads = mtp.find_heads(ckpt, ckpt.config)
    mtp.select((), heads, mode or "keep")
    if not heads:
        return heads, None
    return heads, {"mode": mode or "keep", "record": {m: mtp.record(m, heads)[mtp.RECORD] for m in ("drop", "only")}}


def set_class(cls, asked: dict | None) -> dict | None:
    """The converter class ``cls`` (the worker's, made for this conversion) set for ``asked`` (``request``'s):
    --mtp (only) or --no-mtp (drop) where it exports heads; a class without them writes none, and only is refused.
    What was done: the mode, whether by the converter's flag, and the record to write (None: kept).

    Raises:
        FFNToolsError: --mtp only where the class has no --mtp.
    """
    if asked is None:
        return None
    mode = asked["mode"]
    if getattr(cls, "supports_mtp_export", False):
        cls.no_mtp, cls.mtp_only = mode == "drop", mode == "only"
        return {"mode": mode, "flag": True, "record": asked["record"].get(mode)}
    if mode == "only":
        raise FFNToolsError(f"--mtp only: llama.cpp's converter class for this model ({cls.__mro__[1].__name__}) "
                            "writes no MTP head and has no --mtp (DeepSeek-V3.2's class has); --to torch --mtp only "
                            "writes the head alone")
    return {"mode": "drop", "flag": False, "record": asked["record"]["drop"]}


def record(writer, done: dict | None) -> None:
    """What became of the heads (``set_class``'s ``done``) in the GGUF's metadata, where they are not kept."""
    if done is not None and done["record"]:
        writer.add_string(mtp.RECORD, done["record"])


def changes(result: dict, heads: tuple) -> list[str]:
    """The summary's line for ``heads``: the converter's --mtp / --no-mtp as ``mtp.said`` says it, or, where its
    class has neither, the heads it left out (recorded as dropped)."""
    if not heads:
        return []
    done = result.get("mtp") or {}
    if done.get("flag"):
        return mtp.said(done["mode"], heads, hint=done["mode"] == "keep")
    n = sum(len(h.tensors) for h in heads)
    return [f"dropped the MTP head{'s' * (len(heads) > 1)} {listing([h.name for h in heads], 4)} ({n} tensors): "
            f"llama.cpp's converter class for this model ({result.get('class')}) writes none and has no --mtp "
            f"(DeepSeek-V3.2's class has); recorded in the metadata as {mtp.RECORD} (--to torch keeps it)"]
