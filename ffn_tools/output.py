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


def check_output(out: Path, inputs: list[Path], force: bool) -> None:
    """Refuse an output that exists (without force) or overlaps an input.

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
    if out.is_dir() and not _looks_like_output(out):
        raise OutputExistsError(f"{out}: is a directory that holds no checkpoint; --force replaces only earlier "
                                "outputs, so remove it yourself if you mean it")


def _looks_like_output(d: Path) -> bool:
    """A directory --force may replace: empty, or an earlier checkpoint output (weights, config or a manifest)."""
    entries = list(d.iterdir())
    return not entries or any(p.suffix in WEIGHT_SUFFIXES or p.name in ("config.json", "ffn_manifest.json") for p in entries)


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
