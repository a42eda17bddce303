"""Flax msgpack files: parameter trees read lazily and written as a stream, no jax needed.

The format is ``flax.serialization.to_bytes`` / ``msgpack_restore``: a msgpack tree of maps with string
keys whose leaves are msgpack ext type 1 (ndarray; 3 = numpy scalar) holding the msgpack array
``(shape, dtype name, C-order bytes)``. Arrays over ``MAX_CHUNK_SIZE`` bytes are stored, as flax does, as
``{"__msgpack_chunked_array__": True, "shape": {"0": d0, ...}, "chunks": {"0": flat ext, ...}}``.

Reading parses only the msgpack headers and records where each array's bytes lie (nothing is decoded
until a tensor is asked for); ``converters.flax.writer`` writes the same bytes ``to_bytes`` would. Bytes
are never converted: bfloat16 stays bfloat16 (the bytes of torch and ml_dtypes agree).
"""

from __future__ import annotations

import io
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ffn_tools.io.dtypes import itemsize, torch_dtype
from ffn_tools.errors import CheckpointError

if TYPE_CHECKING:
    import torch

# numpy dtype names flax writes -> safetensors dtype strings (bytes are reinterpreted, never converted).
# Plain strings: reading a tree's structure does not import torch.
DTYPES: dict[str, str] = {
    "float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
EXT_NDARRAY, EXT_SCALAR = 1, 3
CHUNKED = "__msgpack_chunked_array__"
MAX_CHUNK_SIZE = 2**30  # flax.serialization.MAX_CHUNK_SIZE


@dataclass(frozen=True)
class Leaf:
    """An array in a msgpack file: ``pieces`` are (absolute offset, nbytes) runs of its C-order bytes."""

    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    file: Path
    pieces: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(DTYPES[self.dtype])


@dataclass(frozen=True)
class _Ext:
    code: int
    start: int
    size: int


@dataclass(frozen=True)
class _Bin:
    start: int
    size: int


MAX_ARRAY = 4096  # items: a parameter tree's lists are shapes and [shape, dtype, data] triples
MAX_DEPTH = 64  # nesting of maps and arrays


class _Scanner:
    """Decodes msgpack structure from a buffer, leaving bin and ext payloads in place.

    Work is bounded by the file: a count that more items than bytes remain could hold, an array longer than
    a parameter tree ever holds, or nesting deeper than ``MAX_DEPTH`` is refused before it is walked.
    """

    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos, self.depth = buf, pos, 0

    def _count(self, n: int, per_item: int, what: str) -> int:
        left = len(self.buf) - self.pos
        if n * per_item > left:
            raise ValueError(f"{what} of {n} items where {left} bytes remain")
        if what == "an array" and n > MAX_ARRAY:
            raise ValueError(f"an array of {n} items at byte {self.pos}: no parameter tree holds one this long")
        return n

    def value(self):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
            return self._value()
        finally:
            self.depth -= 1

    def _take(self, fmt: str):
        v = struct.unpack_from(">" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def _skip(self, n: int) -> int:
        start = self.pos
        if start + n > len(self.buf):
            raise ValueError("ends early")
        self.pos += n
        return start

    def _value(self):
        b = self._take("B")
        if b <= 0x7F or b >= 0xE0:
            return b if b <= 0x7F else b - 0x100
        if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
            n = self._count(b & 0x0F if b <= 0x8F else self._take("H" if b == 0xDE else "I"), 2, "a map")
            out = {}
            for _ in range(n):
                k = self.value()
                out[k if isinstance(k, str) else ("?", k)] = self.value()
            return out
        if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
            n = self._count(b & 0x0F if b <= 0x9F else self._take("H" if b == 0xDC else "I"), 1, "an array")
            return [self.value() for _ in range(n)]
        if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB):
            n = b & 0x1F if b <= 0xBF else self._take({0xD9: "B", 0xDA: "H", 0xDB: "I"}[b])
            return bytes(self.buf[self._skip(n): self.pos]).decode("utf-8")
        if b in (0xC4, 0xC5, 0xC6):
            n = self._take({0xC4: "B", 0xC5: "H", 0xC6: "I"}[b])
            return _Bin(self._skip(n), n)
        if b in (0xC7, 0xC8, 0xC9) or 0xD4 <= b <= 0xD8:
            n = self._take({0xC7: "B", 0xC8: "H", 0xC9: "I"}[b]) if b <= 0xC9 else 1 << (b - 0xD4)
            code = self._take("b")
            return _Ext(code, self._skip(n), n)
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        fmts = {0xCA: "f", 0xCB: "d", 0xCC: "B", 0xCD: "H", 0xCE: "I", 0xCF: "Q", 0xD0: "b", 0xD1: "h", 0xD2: "i", 0xD3: "q"}
        if b in fmts:
            return self._take(fmts[b])
        raise ValueError(f"byte 0x{b:02x} is not msgpack")


def _describe(v) -> str:
    kinds = {str: "a string", list: "a list", type(None): "nil", bool: "a boolean", dict: "a map", int: "a number",
             float: "a number", _Ext: "an ext value of an unknown type", _Bin: "raw bytes"}
    return kinds.get(type(v), type(v).__name__)


def read_tree(file: Path) -> list[Leaf]:
    """The arrays of a Flax msgpack file, in file order, without reading their bytes.

    Raises:
        CheckpointError: the file is not a msgpack tree of arrays (naming the first offending path).
    """
    hint = "ffn-tools reads parameter trees written by flax.serialization.to_bytes (maps of arrays)"
    try:
        with open(file, "rb") as fh:
            if fh.seek(0, 2) == 0:
                raise CheckpointError(f"{file}: empty file; {hint}")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                scan = _Scanner(buf)
                root = scan.value()
                if scan.pos != len(buf):
                    raise ValueError(f"{len(buf) - scan.pos} bytes of extra data after the tree")
                if not isinstance(root, dict):
                    raise CheckpointError(f"{file}: not a Flax parameter tree: the top level is {_describe(root)}; {hint}")
                leaves: list[Leaf] = []
                _collect(buf, file, root, (), leaves, hint)
    except (ValueError, struct.error, RecursionError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not a Flax msgpack file (truncated or corrupt: {e}); {hint}") from None
    if not leaves:
        raise CheckpointError(f"{file}: the tree holds no arrays; {hint}")
    return leaves


def _collect(buf, file: Path, node: dict, path: tuple, out: list, hint: str) -> None:
    for key, v in node.items():
        if isinstance(key, tuple):
            raise CheckpointError(f"{file}: not a Flax parameter tree: key {key[1]!r} under /{'/'.join(path)} "
                                  f"is not a string; {hint}")
        p = (*path, key)
        where = "/".join(p)
        if isinstance(v, dict) and v.get(CHUNKED) is True:
            out.append(_unchunk(buf, file, p, v))
        elif isinstance(v, dict):
            _collect(buf, file, v, p, out, hint)
        elif isinstance(v, _Ext) and v.code in (EXT_NDARRAY, EXT_SCALAR):
            dtype, shape, data = _ndarray(buf, v, where)
            out.append(Leaf(p, dtype, shape, file, (data,)))
        else:
            raise CheckpointError(f"{file}: not a Flax parameter tree: {where} is {_describe(v)}, not an array; {hint}")


def _ndarray(buf, ext: _Ext, where: str) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    scan = _Scanner(buf, ext.start)
    item = scan.value()
    ok = (isinstance(item, list) and len(item) == 3 and isinstance(item[0], list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in item[0]) and isinstance(item[2], _Bin))
    if not ok or scan.pos != ext.start + ext.size:
        raise ValueError(f"{where}: malformed array record")
    dtype = item[1] if isinstance(item[1], str) else bytes(buf[item[1].start: item[1].start + item[1].size]).decode()
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: dtype {dtype!r} is not supported; supported: {', '.join(DTYPES)}")
    shape = tuple(item[0])
    if item[2].size != math.prod(shape) * itemsize(DTYPES[dtype]):
        raise ValueError(f"{where}: {item[2].size} bytes do not hold {dtype}{list(shape)}")
    return dtype, shape, (item[2].start, item[2].size)


def _unchunk(buf, file: Path, path: tuple, node: dict) -> Leaf:
    where = "/".join(path)
    shape_map, chunks = node.get("shape"), node.get("chunks")
    if not isinstance(shape_map, dict) or not isinstance(chunks, dict):
        raise ValueError(f"{where}: malformed chunked array")
    shape = tuple(shape_map[str(i)] for i in range(len(shape_map)))
    parts = [_ndarray(buf, chunks[str(i)], f"{where}/chunks/{i}") for i in range(len(chunks))]
    dtypes = {d for d, _, _ in parts}
    if len(dtypes) != 1 or sum(n for _, _, (_, n) in parts) != math.prod(shape) * itemsize(DTYPES[parts[0][0]]):
        raise ValueError(f"{where}: chunks do not add up to shape {list(shape)}")
    return Leaf(path, parts[0][0], shape, file, tuple(p for _, _, p in parts))


def read_leaf(handle: io.BufferedIOBase, leaf: Leaf) -> torch.Tensor:
    """The tensor of ``leaf``, read from the open binary file ``handle`` (bytes reinterpreted, not converted)."""
    import torch

    dtype = torch_dtype(DTYPES[leaf.dtype])
    if leaf.nbytes == 0:
        return torch.empty(leaf.shape, dtype=dtype)
    data = bytearray(leaf.nbytes)
    view, at = memoryview(data), 0
    for start, n in leaf.pieces:
        handle.seek(start)
        if handle.readinto(view[at: at + n]) != n:
            raise CheckpointError(f"{leaf.file}: ended early while reading {'/'.join(leaf.path)}")
        at += n
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(leaf.shape)
