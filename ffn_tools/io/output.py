"""Atomic outputs: write into a temporary sibling, move into place only when everything succeeded.

An existing output is refused unless ``force``; an output that is, contains, or lies inside an input is
refused always (writing it would destroy what is being read).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from glob import escape as glob_escape
from pathlib import Path

from ..errors import OutputError, OutputExistsError, counted
from ..progress import say
from ..sizes import human
from . import receipt, resume
from .run import NO_RUN, Run
from .store import WEIGHT_SUFFIXES

log = logging.getLogger(__name__)


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


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _stale(out: Path) -> list[Path]:
    """Temporary outputs for ``out`` left by ffn-tools processes that no longer run (killed with SIGKILL, or by
    a power cut; or interrupted, where they kept finished shards), newest first; those of live processes are not
    among them."""
    found = []
    for p in out.parent.glob(f".{glob_escape(out.name)}.*-*"):
        m = re.fullmatch(rf"\.{re.escape(out.name)}\.(?:tmp|old)-(\d+)-[0-9a-f]{{8}}(?:\.{re.escape(receipt.NAME)})?",
                         p.name)
        if m and not alive(int(m.group(1))):
            found.append(p)
    return sorted(found, key=lambda p: p.lstat().st_mtime_ns, reverse=True)


def remove_stale(out: Path, resume_key: str | None = None) -> Path | None:
    """Remove the temporary outputs for ``out`` that killed processes left, but the newest whose resume ledger
    has ``resume_key`` (``--resume``: returned, to be continued). A removed one that had finished shards is said."""
    kept = None
    for p in _stale(out):
        if kept is None and resume_key is not None and resume.ledger_key(p) == resume_key:
            kept = p
            continue
        if (n := resume.finished_shards(p)) and p.name.startswith(f".{out.name}.tmp-"):
            why = ("it was begun by another command, with other options or from other inputs" if resume_key
                   else "--resume continues one")
            say(f"{out}: removed the unfinished output of a killed or interrupted run ({p.name}, "
                f"{counted(n, 'shard')} finished; {why})")
        _remove(p)
    return kept


def _bytes_under(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


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


NOT_DISTRIBUTED = ("--ray writes the shards of a directory of safetensors shards as Ray tasks (split-gateup, "
                   "fuse-gateup, convert --to torch or mlx, with a directory -o); this output is written whole by one "
                   "writer: run without --ray")
NOT_RESUMABLE = ("--resume continues a directory of safetensors shards (split-gateup, fuse-gateup, merge, extract, "
                 "convert --to torch or mlx, with a directory -o); this output is written whole, so no part of it can "
                 "be reused: run without --resume")


@contextmanager
def atomic_output(out: Path, *, inputs: list[Path], force: bool, nbytes: int | None = None,
                  resume_key: str | None = None, sources: list[Path] | None = None,
                  distributed: bool = False, run: Run = NO_RUN) -> Iterator[Path]:
    """Yield a temporary path beside ``out``; on success it replaces ``out``, on failure (an exception) it is
    removed. Interrupted (Ctrl-C, or SIGTERM / SIGHUP, which the CLI raises as a ``KeyboardInterrupt``), it is kept
    where its resume ledger has finished shards (``kept_for_resume``), else removed. Temporaries that killed or
    interrupted processes left for ``out`` are removed first, except, under ``--resume`` (``run.resume``), the
    newest whose ledger has ``resume_key``: that one is yielded, its finished shards in it (see ``resume``); where
    there is none, a line says so.

    The caller creates a file or a directory at the yielded path (a directory may already be there).

    Args:
        nbytes: what will be written, when known: refused up front if the disk has less free.
        resume_key: the run's key, where the caller keeps a resume ledger (None: it cannot be continued, and
            --resume is refused).
        sources: the files the output is made of, for its receipt (``io.receipt``; default: ``inputs``, directories
            whole), hashed while the caller writes.
        distributed: the caller writes it with Ray tasks under ``--ray`` (``cluster``); any other output refuses
            --ray (``run.ray``) up front.
        run: the run's options this reads: ``resume``, ``ray``, ``command`` (the receipt's record) and
            ``hash_limit`` (the receipt hashes that many bytes of the sources; None: all).

    Raises:
        OutputExistsError / OutputError: before anything is written (see ``check_output``, ``check_parent``,
            ``_lock``), or the disk filled up (naming ``out`` and the space needed).
    """
    if run.ray is not None and not distributed:
        raise OutputError(f"{out}: {NOT_DISTRIBUTED}")
    resuming = run.resume
    if resuming and resume_key is None:
        raise OutputError(f"{out}: {NOT_RESUMABLE}")
    check_output(out, inputs, force)
    check_parent(out)
    with _lock(out):
        kept = remove_stale(out, resume_key if resuming else None)
        free = shutil.disk_usage(out.parent).free + (_bytes_under(kept) if kept else 0)
        if nbytes is not None and nbytes > free:
            raise OutputError(f"{out}: not enough space: the output needs {human(nbytes)}, {out.parent} has "
                              f"{human(free)} free")
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp = out.parent / f".{out.name}.tmp-{tag}"
        if kept is not None:
            os.replace(kept, tmp)
            say(f"{out}: --resume: continuing the unfinished output {kept.name} "
                f"({counted(resume.finished_shards(tmp), 'shard')} finished, each checked before reuse)")
        elif resuming:
            say(f"{out}: --resume: no unfinished output of this same run was left (by a killed or interrupted run); "
                "writing it from the start")
        hashing = receipt.Sources(inputs if sources is None else sources, run.hash_limit)
        beside = out.parent / f".{out.name}.tmp-{tag}.{receipt.NAME}"  # a one-file output's receipt, until in place
        try:
            yield tmp
            made = receipt.make(out, tmp, hashing, run.command)
            receipt.write(made, tmp / receipt.NAME if tmp.is_dir() else beside)
        except OSError as e:
            hashing.stop()
            _remove(tmp)
            beside.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                need = f"needs {human(nbytes)}; " if nbytes else ""
                raise OutputError(f"{out}: no space left on the device while writing ({need}{out.parent} had "
                                  f"{human(free)} free); free some space or choose another -o path") from None
            if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise OutputError(f"{out}: cannot write ({e.strerror}); choose another -o path") from None
            raise
        except BaseException as e:
            hashing.stop()
            if not (isinstance(e, KeyboardInterrupt) and resume_key is not None and kept_for_resume(out, tmp)):
                _remove(tmp)
            beside.unlink(missing_ok=True)
            raise
        if tmp.is_dir():
            resume.remove_ledger(tmp)  # last: a kill before the rename leaves every finished shard to --resume
        if out.exists() or out.is_symlink():
            old = out.parent / f".{out.name}.old-{tag}"
            os.replace(out, old)
            os.replace(tmp, out)
            _remove(old)
        else:
            os.replace(tmp, out)
        side = out.with_name(f"{out.name}.{receipt.NAME}")
        if beside.exists():
            os.replace(beside, side)
        else:
            side.unlink(missing_ok=True)  # an earlier one-file output's, which this directory replaced


def kept_for_resume(out: Path, tmp: Path) -> bool:
    """Whether the temporary output ``tmp`` of an interrupted run is kept for ``--resume`` (its ledger has finished
    shards), said in one line on stderr whatever ``--quiet`` says (it leaves files on the disk): where it is, how to
    continue, how to discard it."""
    if not (n := resume.finished_shards(tmp)):
        return False
    log.warning("%s: interrupted: kept %s in %s; the same command with --resume continues from them, without "
                "--resume (or rm -r %s) discards them", out, counted(n, "finished shard"), tmp, tmp)
    return True
