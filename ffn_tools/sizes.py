"""Byte sizes as users type them: '500MB', '5GB', '2GiB', '1.5G', '1048576'."""

from __future__ import annotations

import re

from .errors import FFNToolsError

# Decimal units are powers of 10 (GB = 10**9 bytes, as Hugging Face's max_shard_size);
# binary units (GiB) are powers of 2. A bare number is bytes.
UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
SIZE_HELP = "Units: B, KB/MB/GB/TB (powers of 10, GB = 10^9 bytes) or KiB/MiB/GiB/TiB (powers of 2)."


def parse_size(text: str | int) -> int:
    """Parse a byte size.

    Raises:
        FFNToolsError: the text is not a positive size with a known unit.
    """
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
        unit = m.group(2).upper() if m else None
        if not m or unit not in UNITS:
            raise FFNToolsError(f"cannot read size {text!r}; write e.g. 500MB, 5GB or 2GiB. {SIZE_HELP}")
        value = int(float(m.group(1)) * UNITS[unit])
    if value <= 0:
        raise FFNToolsError(f"size must be positive, got {text!r}")
    return value


def human(n: int) -> str:
    """1.23 GB style, powers of 10."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
