"""Progress on long work: a byte counter with rate and ETA on stderr, shown only on a terminal (not when
piped) and not with --quiet. Writers update it as bytes are copied or computed, not when they are queued."""

from __future__ import annotations

import sys
import time

from .sizes import human

_enabled = True


def set_enabled(enabled: bool) -> None:
    """Turn progress display on or off for this process (the CLI's --quiet)."""
    global _enabled
    _enabled = enabled


def visible() -> bool:
    """Whether progress is shown: enabled (no --quiet) and stderr is a terminal."""
    return _enabled and sys.stderr.isatty()


class Progress:
    """Counts bytes done out of a total and redraws one line at most 10 times a second."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0
        self.start = self._last = time.monotonic()
        self.shown = visible()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.shown and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self.start, 1e-9)
            pct = 100 * self.done / self.total if self.total else 100
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            sys.stderr.write(f"\r{self.desc}: {pct:5.1f}%  {human(self.done)} / {human(self.total)}  "
                             f"{human(int(rate))}/s  ETA {int(eta) // 60}:{int(eta) % 60:02d} ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
