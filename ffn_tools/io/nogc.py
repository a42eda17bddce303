"""Building large trees of Python objects with the cyclic garbage collector paused.

A 128K-token tokenizer.json parses into millions of lists and dicts. Each allocation of a container counts towards
the collector's next pass, and each pass walks every young object again; the full passes walk everything alive.
``json.loads`` of such a file took 0.2-0.4 s with the collector running and 0.075 s with it paused. Transformers
building a tokenizer from one (``from_pretrained``) pays the same cost. Parsed JSON holds no reference cycles, so
pausing the collector frees nothing later. A tokenizer pauses it for one object's making, and whatever cycles the
build leaves are collected once it runs again.

The collector is process-wide. The pause is counted, so that overlapping pauses (verify's model checks run on a
thread beside the FFN comparison) end at the last one's end, and a collector switched off by someone else stays
off.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_resume = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The cyclic collector off for the block (counted across threads; see the module doc)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()


def loads(text: str | bytes):
    """``json.loads`` with the collector paused."""
    with paused():
        return json.loads(text)
