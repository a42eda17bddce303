"""The safetensors file format itself: read and validate a header, build one.

We parse headers ourselves (rather than only through ``safe_open``) for two reasons: every tensor's byte
offset lets the executor copy untouched tensors byte for byte without decoding them, and a truncated or
corrupted file gets an error naming the file and what is wrong instead of a Rust panic message.

Layout: 8 bytes little-endian header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets}}``
(plus ``__metadata__``: str -> str), then the data; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from .dtypes import ST_DTYPES, itemsize
from .errors import CheckpointError

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor in a safetensors header; ``start``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """Read and validate the header of a safetensors file.

    Returns:
        (entries by name, ``__metadata__`` dict, empty when absent).

    Raises:
        CheckpointError: the file is too short, the header is not valid JSON, or a tensor lies outside
            the file (a truncated download).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, too short for a header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{path}: not a safetensors file or truncated (header claims {n} bytes, file has {size}); "
                "re-download or re-save it"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupted safetensors header ({e}); re-download or re-save it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    entries: dict[str, HeaderEntry] = {}
    for name, spec in header.items():
        try:
            dtype, shape, (lo, hi) = spec["dtype"], tuple(int(d) for d in spec["shape"]), spec["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: corrupted safetensors header entry for tensor {name!r}") from None
        if dtype not in ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        count = 1
        for d in shape:
            count *= d
        if hi - lo != count * itemsize(dtype) or lo < 0:
            raise CheckpointError(f"{path}: tensor {name!r}: offsets {lo}:{hi} do not match {dtype}{list(shape)}")
        if base + hi > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} ends at byte {base + hi} but the file has {size} bytes; "
                "re-download or re-save it"
            )
        entries[name] = HeaderEntry(name, dtype, shape, base + lo, base + hi)
    return entries, metadata


PAGE = 4096  # data copied from an input lands at the same offset modulo a page: ~20% faster copy_file_range


def build_header(items: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None,
                 data_start_mod: int | None = None) -> bytes:
    """Serialize a header for tensors written back to back in ``items`` order.

    Args:
        items: (name, safetensors dtype, shape, nbytes) in the order the data will follow.
        metadata: the ``__metadata__`` dict, or None.
        data_start_mod: when given (a multiple of 8), pad so that the data starts at this offset modulo
            ``PAGE``, matching the input the bytes are copied from.

    Returns:
        The 8-byte length prefix plus the JSON header, space-padded to a multiple of 8 bytes (as
        safetensors does, so the data that follows is 8-byte aligned) and at most ``PAGE`` more.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape, nbytes in items:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    if data_start_mod is not None and data_start_mod % 8 == 0:
        raw += b" " * ((data_start_mod - 8 - len(raw)) % PAGE)
    return struct.pack("<Q", len(raw)) + raw


def header_entry_size(name: str, dtype: str, shape: tuple[int, ...], start: int, nbytes: int) -> int:
    """Bytes one tensor adds to a header built by ``build_header`` (including its separating comma)."""
    spec = {"dtype": dtype, "shape": list(shape), "data_offsets": [start, start + nbytes]}
    return len(json.dumps({name: spec}, separators=(",", ":")).encode()) - 2 + 1
