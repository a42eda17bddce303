"""Atomic outputs: write into a temporary sibling, move into place only when everything succeeded.

An existing output is refused unless ``force``; an output that is, contains, or lies inside an input is
refused always (writing it would destroy what is being read).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import OutputExistsError
from .store import WEIGHT_SUFFIXES


def check_output(out: Path, inputs: list[Path], force: bool, replaceable=None) -> None:
    """Refuse an output that exists (without force, or that --force may not replace) or overlaps an input.

    Args:
        replaceable: predicate saying whether an existing ``out`` is an earlier output --force may
            replace (default: a weight file, or a directory holding only a checkpoint).

    Raises:
        OutputExistsError: naming the path and the fix.
    """
    o = out.resolve()
    for inp in inputs:
        i = inp.resolve()
        if o == i or i.is_relative_to(o):
            raise OutputExistsError(f"{out}: the output would overwrite the input {inp}; choose another -o path")
    if out.exists() and not force:
        raise OutputExistsError(f"{out}: already exists; choose another -o path or pass --force to replace it")
    if out.exists() and not (replaceable or _looks_like_output)(out):
        raise OutputExistsError(f"{out}: does not look like an earlier checkpoint output; --force replaces only "
                                "those, so remove it yourself if you mean it")


# Files an earlier output directory may hold besides weights: configs, manifests, tokenizer files, notes.
SIDE_SUFFIXES = (".json", ".model", ".jinja", ".txt", ".md", ".tiktoken")


def _looks_like_output(p: Path) -> bool:
    """What --force may replace: a weight file; an empty directory; or a directory of plain files, all of
    them weights or side files, at least one of them weights or config.json. Nothing else is deleted."""
    if not p.is_dir():
        return p.suffix in WEIGHT_SUFFIXES
    entries = list(p.iterdir())
    if any(e.is_dir() or e.suffix not in (*WEIGHT_SUFFIXES, *SIDE_SUFFIXES) for e in entries):
        return not entries
    return not entries or any(e.suffix in WEIGHT_SUFFIXES or e.name == "config.json" for e in entries)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


@contextmanager
def atomic_output(out: Path, *, inputs: list[Path], force: bool) -> Iterator[Path]:
    """Yield a temporary path beside ``out``; on success it replaces ``out``, on failure it is removed.

    The caller creates a file or a directory at the yielded path.

    Raises:
        OutputExistsError: before anything is written, see ``check_output``.
    """
    check_output(out, inputs, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out.parent / f".{out.name}.tmp-{tag}"
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.old-{tag}"
        os.replace(out, old)
        os.replace(tmp, out)
        _remove(old)
    else:
        os.replace(tmp, out)
