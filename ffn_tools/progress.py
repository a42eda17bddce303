"""Progress on long work, on stderr, not with --quiet: on a terminal a byte counter with rate and ETA redrawn
in place; otherwise (piped, a log file, CI) one plain line every ``LINE_EVERY`` seconds, so a long run is seen
to be alive without filling a log. Writers update it as bytes are copied or computed, not when they are queued."""

from __future__ import annotations

import sys
import time

from .sizes import human

_enabled = True
LINE_EVERY = 5.0  # seconds between progress lines when stderr is not a terminal (the first after as long)


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
        print(line, file=sys.stderr, flush=True)


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
            sys.stderr.write(f"\r{self._status(now)} ")
            sys.stderr.flush()
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
