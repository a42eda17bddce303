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
from ..errors import CheckpointError
from ..sizes import human

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
MAX_COUNT = 2 ** 64 - 1  # the Rust reader multiplies a shape out in a usize and refuses it past this
MAX_DIM = 2 ** 63 - 1  # a dimension past this is no torch tensor (int64 sizes): nothing could read it
LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # how every Git LFS pointer file begins (its spec)


def lfs_pointer(path: Path) -> str | None:
    """The error for a Git LFS pointer in place of the file it names (a clone made without Git LFS, or before
    ``git lfs pull``): what it is, the real file's size, how to fetch it; None for any other file."""
    with open(path, "rb") as f:
        text = f.read(1024)
    if not text.startswith(LFS_POINTER):
        return None
    fields = dict(line.split(" ", 1) for line in text.decode("ascii", "replace").splitlines() if " " in line)
    size = fields.get("size", "").strip()
    what = f"the {human(int(size))} file" if size.isdigit() else "the file"
    return (f"{path}: a Git LFS pointer ({len(text)} bytes), not {what} it names: the repository was cloned without "
            "its Git LFS files; run `git lfs pull` in the clone (or download the file itself)")


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor in a safetensors header; ``start``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise CheckpointError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _index(v) -> bool:
    """A JSON non-negative integer (not a bool, a float or a string), as the Rust reader's usize."""
    return type(v) is int and v >= 0


def read_header(path: Path) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """Read and validate the header of a safetensors file, as strictly as safetensors' Rust reader.

    Every entry needs a string ``dtype`` the format knows, a ``shape`` of non-negative integers and integer
    ``data_offsets`` [begin, end] whose size fits dtype and shape; the entries, sorted by offset, must tile
    the data exactly (no overlap, no gap, nothing after the last one); names are unique; ``__metadata__``
    maps strings to strings.

    Returns:
        (entries by name, ``__metadata__`` dict, empty when absent).

    Raises:
        CheckpointError: naming the file (and the tensor) and what is wrong.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, too short for a header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                lfs_pointer(path) or f"{path}: not a safetensors file or truncated (header claims {n} bytes, file "
                f"has {size}); re-download or re-save it"
            )
        raw = f.read(n)
    if not raw.startswith(b"{"):
        raise CheckpointError(f"{path}: not a safetensors file (the header does not start with '{{')")
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: corrupted safetensors header: {e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupted safetensors header ({e}); re-download or re-save it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupted safetensors header: __metadata__ must map strings to strings")
    base = 8 + n
    entries: dict[str, HeaderEntry] = {}
    for name, spec in header.items():
        entries[name] = _entry(path, name, spec, base, size)
    end = 0
    for entry in sorted(entries.values(), key=lambda h: (h.start, h.end)):
        if entry.start != base + end:
            what = "overlaps the previous tensor" if entry.start < base + end else "leaves a gap before it"
            raise CheckpointError(f"{path}: tensor {entry.name!r}: data_offsets {entry.start - base}:"
                                  f"{entry.end - base} {what}; the file is corrupted (re-download or re-save it)")
        end = entry.end - base
    if base + end != size:
        raise CheckpointError(f"{path}: {size - base - end} bytes after the last tensor's data (the header accounts "
                              f"for {end} of {size - base}); the file is corrupted or was appended to")
    return entries, metadata


def _entry(path: Path, name: str, spec, base: int, size: int) -> HeaderEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
        raise CheckpointError(f"{where}: a header entry needs dtype, shape and data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ST_DTYPES:
        raise CheckpointError(f"{where} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_index(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_index(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not two increasing non-negative integers")
    lo, hi = offsets
    if any(d > MAX_DIM for d in shape):
        raise CheckpointError(f"{where}: shape {shape} has a dimension past 2^63 - 1, which no framework's tensor "
                              "holds; the file is corrupted (re-download or re-save it)")
    count = 1
    for d in shape:  # multiplied out in order, as the Rust reader does: an empty tensor may not overflow either
        count *= d
        if count > MAX_COUNT:
            raise CheckpointError(f"{where}: shape {shape} overflows a 64-bit element count (multiplied out in "
                                  "order); the file is corrupted (re-download or re-save it)")
    if hi - lo != count * itemsize(dtype):
        raise CheckpointError(f"{where}: offsets {lo}:{hi} do not match {dtype}{list(shape)}")
    if base + hi > size:
        raise CheckpointError(f"{where} ends at byte {base + hi} but the file has {size} bytes: truncated; "
                              "re-download or re-save it")
    return HeaderEntry(name, dtype, tuple(shape), base + lo, base + hi)


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
