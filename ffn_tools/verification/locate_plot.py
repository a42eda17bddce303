"""``verify --locate --plot FILE``: the per-layer table as a small SVG image (no plotting package needed): one
cell per layer and part, shaded by how far B's figure is above its floor (white: at or under it; red: 10x and
beyond), outlined where it leaves the floor, the first such cell marked."""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

from .locate_report import SHORT, LocateResult, Row

CELL, LEFT, TOP = 34, 46, 64


def _shade(row: Row | None, anchor_is_b: bool) -> str:
    if row is None or row.b is None:
        return "#eeeeee"
    held = row.anchor if row.anchor is not None and not anchor_is_b else row.floor
    s = row.statistic
    v, f = row.b[s], (held or {}).get(s, 0.0)
    ratio = v / f if f > 0 else (1.0 if v == 0 else 1e3)
    t = min(max(math.log10(ratio), 0.0), 1.0) if ratio > 0 else 0.0
    g = int(255 * (1 - t))
    return f"#ff{g:02x}{g:02x}"


def write_svg(r: LocateResult, path: str | Path) -> Path:
    """``r``'s per-layer table as an SVG image at ``path`` (see the module docstring); returns the path."""
    by_key = {row.key: row for row in r.rows}
    layers = sorted({row.layer for row in r.rows if row.layer is not None})
    parts = [p for p in SHORT if any(row.part == p for row in r.rows)]
    width, height = LEFT + CELL * len(parts) + 10, TOP + CELL * len(layers) + 30
    first = r.first
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="10">',
           f'<text x="4" y="14" font-size="11">{escape(r.verdict()[:110])}</text>']
    for j, p in enumerate(parts):
        x = LEFT + j * CELL + CELL // 2
        out.append(f'<text x="{x}" y="{TOP - 6}" text-anchor="middle" transform="rotate(-30 {x} {TOP - 6})">'
                   f'{escape(SHORT[p])}</text>')
    for i, layer in enumerate(layers):
        y = TOP + i * CELL
        out.append(f'<text x="{LEFT - 6}" y="{y + CELL // 2 + 4}" text-anchor="end">{layer}</text>')
        for j, p in enumerate(parts):
            row = by_key.get(f"L{layer}.{p}")
            stroke = ('stroke="#000" stroke-width="3"' if row is not None and row is first else
                      'stroke="#c00" stroke-width="1.5"' if row is not None and row.left else 'stroke="#999"')
            out.append(f'<rect x="{LEFT + j * CELL}" y="{y}" width="{CELL - 2}" height="{CELL - 2}" '
                       f'fill="{_shade(row, r.anchor_is_b)}" {stroke}><title>{escape(row.key if row else "")} '
                       f'{escape(row.cell(r.anchor_is_b) if row else "no such part")}</title></rect>')
    out.append(f'<text x="4" y="{height - 8}">layers down, parts across; shade: B\'s figure over its floor\'s '
               '(log, 1x white to 10x red); outlined: leaves it</text></svg>')
    Path(path).write_text("\n".join(out))
    return Path(path)
