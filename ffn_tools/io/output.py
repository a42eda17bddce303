"""Atomic outputs: write into a temporary sibling, move into place only when everything succeeded.

An existing output is refused unless ``force``; an output that is, contains, or lies inside an input is
refused always (writing it would destroy what is being read).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from glob import escape as glob_escape
from pathlib import Path

from ..errors import OutputError, OutputExistsError
from ..sizes import human
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
        if inp.is_dir() and o.is_relative_to(i):
            raise OutputExistsError(f"{out}: lies inside the input directory {inp}, which ffn-tools never modifies; "
                                    "choose an -o path outside it")
    if out.exists() and not force:
        raise OutputExistsError(f"{out}: already exists; choose another output path (out=) or pass force=True to "
                                "replace it", flags={"out=": "-o", "force=True": "--force"})
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


def check_parent(out: Path) -> None:
    """Create ``out``'s parent, or say in terms of ``out`` why it cannot be written there (before anything,
    a temporary included, is written beside it).

    Raises:
        OutputError: a parent is a file, or the directory cannot be created or written (read-only file
            system, or no permission: said which).
    """
    for p in (out.parent, *out.parent.parents):
        if p.exists():
            if not p.is_dir():
                raise OutputError(f"{out}: cannot write here: {p} is a file, not a directory; choose another -o path")
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out}: cannot create its directory {out.parent} ({e.strerror}); choose another -o "
                          "path") from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        why = "read-only file system" if _read_only(out.parent) else "permission denied"
        raise OutputError(f"{out}: cannot write into {out.parent} ({why}); choose another -o path")


def _read_only(p: Path) -> bool:
    """Whether ``p`` lies on a file system mounted read-only (os.access says only that it cannot be written)."""
    try:
        return bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale(out: Path) -> list[Path]:
    """Remove temporary outputs for ``out`` left by ffn-tools processes that no longer run (killed with
    SIGKILL, or by a power cut); those of live processes are kept. Returns what was removed."""
    removed = []
    for p in out.parent.glob(f".{glob_escape(out.name)}.*-*"):
        m = re.fullmatch(rf"\.{re.escape(out.name)}\.(?:tmp|old)-(\d+)-[0-9a-f]{{8}}", p.name)
        if m and not _alive(int(m.group(1))):
            _remove(p)
            removed.append(p)
    return removed


@contextmanager
def _lock(out: Path) -> Iterator[None]:
    """Hold ``.OUT.lock`` beside the output while writing: a second process writing the same output is
    refused (naming the first) instead of silently replacing its result."""
    lock = out.parent / f".{out.name}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a place the OS refuses (/proc, read-only): said of -o, not of the lock file
        raise OutputError(f"{out}: cannot write in {out.parent} ({e.strerror}); choose another -o path") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise OutputError(f"{out}: another ffn-tools process (PID {other}) is writing this output; wait for "
                              "it to finish or choose another -o path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)
    finally:
        os.close(fd)


@contextmanager
def atomic_output(out: Path, *, inputs: list[Path], force: bool, nbytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``out``; on success it replaces ``out``, on failure (an exception,
    Ctrl-C, SIGTERM) it is removed. Temporaries that killed processes left for ``out`` are removed first.

    The caller creates a file or a directory at the yielded path.

    Args:
        nbytes: what will be written, when known: refused up front if the disk has less free.

    Raises:
        OutputExistsError / OutputError: before anything is written (see ``check_output``, ``check_parent``,
            ``_lock``), or the disk filled up (naming ``out`` and the space needed).
    """
    check_output(out, inputs, force)
    check_parent(out)
    with _lock(out):
        remove_stale(out)
        free = shutil.disk_usage(out.parent).free
        if nbytes is not None and nbytes > free:
            raise OutputError(f"{out}: not enough space: the output needs {human(nbytes)}, {out.parent} has "
                              f"{human(free)} free")
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp = out.parent / f".{out.name}.tmp-{tag}"
        try:
            yield tmp
        except OSError as e:
            _remove(tmp)
            if e.errno == errno.ENOSPC:
                need = f"needs {human(nbytes)}; " if nbytes else ""
                raise OutputError(f"{out}: no space left on the device while writing ({need}{out.parent} had "
                                  f"{human(free)} free); free some space or choose another -o path") from None
            if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise OutputError(f"{out}: cannot write ({e.strerror}); choose another -o path") from None
            raise
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
