"""Selections like ``0-3,7`` for --layers and --experts: read (``parse_spec``) and written (``spans``)."""

from __future__ import annotations

import re

from .errors import FFNToolsError


def parse_spec(spec: str) -> set[int]:
    """Parse ``0-3,7`` into {0, 1, 2, 3, 7}.

    Raises:
        FFNToolsError: malformed, or a range whose end is before its start.
    """
    out: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise FFNToolsError(f"cannot read selection {spec!r}: write indices and ranges like 0-3,7")
        lo = int(m.group(1))
        out.update(range(lo, int(m.group(2) or lo) + 1))
    return out


def spans(ids) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5`` (what ``parse_spec`` reads back)."""
    out, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)
