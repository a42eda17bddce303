"""Progress on long work, on stderr, not with --quiet: on a terminal a byte counter with rate and ETA redrawn
in place; otherwise (piped, a log file, CI) one plain line every ``LINE_EVERY`` seconds, so a long run is seen
to be alive without filling a log. Writers update it as bytes are copied or computed, not when they are queued.
Before a step has bytes to count (imports, loading a model, a converter's start), ``doing`` says what it does.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .sizes import human

_enabled = True
LINE_EVERY = 5.0  # seconds between progress lines when stderr is not a terminal (the first after as long)
CLEAR = "\r\x1b[K"  # back to the line's start and erase it: a terminal's redrawn line replaced
_doing: list[str] = []  # the steps ``doing`` is in, innermost last; the last one is on the terminal's line


def set_enabled(enabled: bool) -> None:
    """Turn progress display on or off for this process (the CLI's --quiet)."""
    global _enabled
    _enabled = enabled


def visible() -> bool:
    """Whether the redrawn progress bar is shown: enabled (no --quiet) and stderr is a terminal."""
    return _enabled and sys.stderr.isatty()


def say(line: str) -> None:
    """One line on stderr, unless --quiet: what a long step is about to cost, before it starts."""
    if _enabled:
        with above_status():
            print(line, file=sys.stderr, flush=True)


@contextmanager
def above_status() -> Iterator[None]:
    """Write to stderr above ``doing``'s status line: it is erased first and drawn again after, so a line said
    meanwhile (a warning, a cost) stands on its own line rather than glued to the status."""
    if not _doing:
        yield
        return
    _draw("")
    try:
        yield
    finally:
        _draw(_doing[-1])


class StatusAwareHandler(logging.StreamHandler):
    """The CLI's logging handler: each record written above ``doing``'s status line (``above_status``)."""

    def emit(self, record: logging.LogRecord) -> None:
        with above_status():
            super().emit(record)


@contextmanager
def doing(what: str) -> Iterator[None]:
    """Say ``what`` a step is doing while it runs, where nothing else would show the command alive (a long
    verify's opening checks, a converter's start): on a terminal one line redrawn in place, erased when the step
    ends (a progress bar drawn meanwhile replaces it). Not with --quiet, nor where stderr is not a terminal: a log
    keeps only lines that say something when read later (the bars' every ``LINE_EVERY`` seconds, warnings)."""
    if not visible():
        yield
        return
    _doing.append(what)
    _draw(what)
    try:
        yield
    finally:
        _doing.pop()
        _draw(_doing[-1] if _doing else "")


def _draw(line: str) -> None:
    sys.stderr.write(CLEAR + line)
    sys.stderr.flush()


class Progress:
    """Counts bytes done out of a total: redraws one line at most 10 times a second on a terminal, writes a
    line every ``LINE_EVERY`` seconds elsewhere."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0
        self.start = self._last = time.monotonic()
        self.shown = visible()
        self.lines = _enabled and not self.shown  # plain lines: stderr is not a terminal
        self.written = 0  # plain lines written

    def _status(self, now: float) -> str:
        rate = self.done / max(now - self.start, 1e-9)
        pct = 100 * self.done / self.total if self.total else 100
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        return (f"{self.desc}: {pct:5.1f}%  {human(self.done)} / {human(self.total)}  {human(int(rate))}/s  "
                f"ETA {int(eta) // 60}:{int(eta) % 60:02d}")

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.shown and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            _draw(f"{self._status(now)} ")  # over the line ``doing`` drew, if any
        elif self.lines and now - self._last >= LINE_EVERY:
            self._last = now
            self.written += 1
            sys.stderr.write(self._status(now) + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
        elif self.written:  # a run long enough to have said it was going says it ended
            sys.stderr.write(f"{self.desc}: done, {human(self.done)} in {time.monotonic() - self.start:.0f} s\n")
            sys.stderr.flush()
