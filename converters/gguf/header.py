"""gguf-py's ``GGUFReader``, its header parsed in a fraction of the time, to the same fields and tensors.

``GGUFReader`` parses every metadata value into numpy views of its memory map, one ``np.memmap`` slice (a
Python-level ``__array_finalize__`` each) per number and per string: a tokenizer of 128,256 tokens and
280,147 merges takes it 12.6 s to open, before a single tensor is read, in every ``inspect``, ``verify`` and
``convert`` of a Llama-3 or Qwen GGUF. ``Reader`` is the same class with three changes that leave what it
builds as it was: the map is sliced through a plain ``ndarray`` view of it (the mapping stays open: the view
holds it), the item sizes are looked up once per dtype, and an array of strings in the file's own byte order
is cut with one slice per length and one per string, an array of numbers as slices of one view of them
(the parts, indices and types ``_get_field_parts`` gives). Files in the other byte order take gguf-py's own path. ``tests/test_gguf.py`` checks the fields,
parts and tensors equal ``GGUFReader``'s on real files.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType


class Reader(GGUFReader):
    """``GGUFReader`` with a faster header parse (see the module doc)."""

    _sizes: dict[Any, int] = {}

    def __init__(self, path, mode: Any = "r") -> None:
        self.path, self.mode = path, mode  # which file, how mapped: ``sidefiles.header_reader`` hands it on
        super().__init__(path, mode)

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # GGUFReader.__init__ assigns its memory map here
        self.mapped = mapped  # ``mapped.flush()`` writes back what an "r+" reader changed
        self._plain = mapped.view(np.ndarray)
        self._bytes = memoryview(self._plain)  # type: ignore[arg-type]  # an ndarray is a buffer

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        count = int(count)
        size = self._sizes.get(dtype)
        if size is None:
            size = self._sizes[dtype] = np.dtype(dtype).itemsize
        arr = self._plain[offset:offset + size * count].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        count, itype = int(alen[0]), int(raw_itype[0])
        scalar = self.gguf_scalar_to_np.get(GGUFValueType(itype)) if itype in GGUFValueType._value2member_map_ else None
        if scalar is not None:  # one element a part, as gguf-py's loop gives: slices of one view of them all
            size = np.dtype(scalar).itemsize
            block = self._plain[orig_offs + 12:orig_offs + 12 + size * count].view(scalar)
            if len(block) != count:
                raise ValueError(f"an array at byte {orig_offs} runs past the end of the file")
            types = [GGUFValueType.ARRAY] + ([GGUFValueType(itype)] if count else [])
            return 12 + size * count, [raw_itype, alen, *(block[i:i + 1] for i in range(count))], \
                list(range(2, 2 + count)), types
        if itype != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        parts: list[np.ndarray] = [raw_itype, alen]
        idxs: list[int] = []
        data, raw, offs = self._plain, self._bytes, orig_offs + 12
        for _ in range(count):
            n = int.from_bytes(raw[offs:offs + 8], "little")
            if offs + 8 + n > len(data):
                raise ValueError(f"a string at byte {offs} runs past the end of the file")
            idxs.append(len(parts) + 1)
            parts += (data[offs:offs + 8].view(np.uint64), data[offs + 8:offs + 8 + n])
            offs += 8 + n
        types = [GGUFValueType.ARRAY] + ([GGUFValueType.STRING] if count else [])
        return offs - orig_offs, parts, idxs, types


# value type -> its size in bytes, for the scalar types of a GGUF key-value pair (gguf-py's GGUFValueType numbers)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def string_field(path, key: str) -> str | None:
    """The string value of metadata ``key`` of the GGUF at ``path``, or None (absent, not a string, not a GGUF):
    the header walked key by key from the start and left at that key, nothing parsed into arrays. Whether a
    GGUF is a LoRA adapter (``general.type``) is asked of every GGUF a command opens; ``Reader`` would parse a
    Llama-3 tokenizer first (0.4 s; gguf-py's own reader 7.6 s)."""
    import mmap
    import struct

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:4] != b"GGUF":
                return None
            order = "<" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF else ">"  # a big-endian file's version reads
            u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")  # as 0xNNNN0000 little-endian
            count, at = u64.unpack_from(m, 16)[0], 24

            def skip(kind: int, at: int) -> int:
                if kind in _SCALAR_SIZES:
                    return at + _SCALAR_SIZES[kind]
                if kind == _STRING:
                    return at + 8 + u64.unpack_from(m, at)[0]
                if kind == _ARRAY:
                    item, n = u32.unpack_from(m, at)[0], u64.unpack_from(m, at + 4)[0]
                    at += 12
                    if item in _SCALAR_SIZES:
                        return at + n * _SCALAR_SIZES[item]
                    for _ in range(n):
                        at = skip(item, at)
                    return at
                raise ValueError(f"unknown GGUF value type {kind}")

            for _ in range(count):
                n = u64.unpack_from(m, at)[0]
                name, kind = bytes(m[at + 8:at + 8 + n]), u32.unpack_from(m, at + 8 + n)[0]
                at += 12 + n
                if name == key.encode():
                    return bytes(m[at + 8:at + 8 + u64.unpack_from(m, at)[0]]).decode() if kind == _STRING else None
                at = skip(kind, at)
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return None
    return None
