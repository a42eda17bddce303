"""Flax msgpack files: parameter trees read lazily and written as a stream, no jax needed.

The format is ``flax.serialization.to_bytes`` / ``msgpack_restore``: a msgpack tree of maps with string
keys whose leaves are msgpack ext type 1 (ndarray; 3 = numpy scalar) holding the msgpack array
``(shape, dtype name, C-order bytes)``. Arrays over ``MAX_CHUNK_SIZE`` bytes are stored, as flax does, as
``{"__msgpack_chunked_array__": True, "shape": {"0": d0, ...}, "chunks": {"0": flat ext, ...}}``.

Reading parses only the msgpack headers and records where each array's bytes lie (nothing is decoded
until a tensor is asked for); writing emits the same bytes ``to_bytes`` would, one tensor in memory at a
time. Bytes are never converted: bfloat16 stays bfloat16 (the bytes of torch and ml_dtypes agree).
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ffn_tools.errors import CheckpointError

# numpy dtype names flax writes -> torch dtypes (bytes are reinterpreted, never converted).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32, "uint64": torch.uint64,
    "bool": torch.bool,
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
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class _Ext:
    code: int
    start: int
    size: int


@dataclass(frozen=True)
class _Bin:
    start: int
    size: int


class _Scanner:
    """Decodes msgpack structure from a buffer, leaving bin and ext payloads in place."""

    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos = buf, pos

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

    def value(self):
        b = self._take("B")
        if b <= 0x7F or b >= 0xE0:
            return b if b <= 0x7F else b - 0x100
        if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
            n = b & 0x0F if b <= 0x8F else self._take("H" if b == 0xDE else "I")
            out = {}
            for _ in range(n):
                k = self.value()
                out[k if isinstance(k, str) else ("?", k)] = self.value()
            return out
        if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
            n = b & 0x0F if b <= 0x9F else self._take("H" if b == 0xDC else "I")
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
    if item[2].size != math.prod(shape) * DTYPES[dtype].itemsize:
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
    if len(dtypes) != 1 or sum(n for _, _, (_, n) in parts) != math.prod(shape) * DTYPES[parts[0][0]].itemsize:
        raise ValueError(f"{where}: chunks do not add up to shape {list(shape)}")
    return Leaf(path, parts[0][0], shape, file, tuple(p for _, _, p in parts))


def read_leaf(handle, leaf: Leaf) -> torch.Tensor:
    """The tensor of ``leaf``, read from the open binary file ``handle`` (bytes reinterpreted, not converted)."""
    dtype = DTYPES[leaf.dtype]
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


# ---- writing -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutLeaf:
    """An array to write: where in the tree, what it is, and how to get it when its turn comes."""

    path: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _uint(n: int) -> bytes:
    if n <= 0x7F:
        return bytes([n])
    for limit, tag, fmt in ((0xFF, 0xCC, "B"), (0xFFFF, 0xCD, "H"), (0xFFFFFFFF, 0xCE, "I")):
        if n <= limit:
            return bytes([tag]) + struct.pack(">" + fmt, n)
    return b"\xcf" + struct.pack(">Q", n)


def _sized(n: int, fix: tuple[int, int] | None, tags: Sequence[tuple[int, int, str]]) -> bytes:
    if fix and n < fix[1]:
        return bytes([fix[0] | n])
    for tag, limit, fmt in tags:
        if n < limit:
            return bytes([tag]) + struct.pack(">" + fmt, n)
    raise CheckpointError(f"msgpack cannot hold an object of {n} bytes/entries")


def _map(n: int) -> bytes:
    return _sized(n, (0x80, 16), ((0xDE, 1 << 16, "H"), (0xDF, 1 << 32, "I")))


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return _sized(len(b), (0xA0, 32), ((0xD9, 1 << 8, "B"), (0xDA, 1 << 16, "H"), (0xDB, 1 << 32, "I"))) + b


def _array_record_head(shape: tuple[int, ...], dtype: str, nbytes: int) -> bytes:
    """The ndarray ext's header and record head, up to (not including) the C-order bytes."""
    shape_b = _sized(len(shape), (0x90, 16), ((0xDC, 1 << 16, "H"), (0xDD, 1 << 32, "I"))) + b"".join(map(_uint, shape))
    record = b"\x93" + shape_b + _str(dtype) + _sized(nbytes, None, ((0xC4, 1 << 8, "B"), (0xC5, 1 << 16, "H"), (0xC6, 1 << 32, "I")))
    size = len(record) + nbytes
    fixext = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    head = bytes([fixext[size]]) if size in fixext else _sized(size, None, ((0xC7, 1 << 8, "B"), (0xC8, 1 << 16, "H"), (0xC9, 1 << 32, "I")))
    return head + bytes([EXT_NDARRAY]) + record


def _chunks(leaf: OutLeaf) -> list[tuple[int, int]] | None:
    """(first element, count) of each flat chunk when the array is stored chunked, else None."""
    if leaf.nbytes <= MAX_CHUNK_SIZE:
        return None
    per = max(1, int(MAX_CHUNK_SIZE / leaf.dtype.itemsize))
    total = math.prod(leaf.shape)
    return [(i, min(per, total - i)) for i in range(0, total, per)]


def _chunked_head(leaf: OutLeaf, n_chunks: int) -> bytes:
    shape = _map(len(leaf.shape)) + b"".join(_str(str(i)) + _uint(d) for i, d in enumerate(leaf.shape))
    return _map(3) + _str(CHUNKED) + b"\xc3" + _str("shape") + shape + _str("chunks") + _map(n_chunks)


def leaf_size(leaf: OutLeaf) -> int:
    """Exact encoded size of a leaf's value."""
    name, item = DTYPE_NAMES[leaf.dtype], leaf.dtype.itemsize
    chunks = _chunks(leaf)
    if chunks is None:
        return len(_array_record_head(leaf.shape, name, leaf.nbytes)) + leaf.nbytes
    return len(_chunked_head(leaf, len(chunks))) + sum(
        len(_str(str(i))) + len(_array_record_head((n,), name, n * item)) + n * item for i, (_, n) in enumerate(chunks))


def shard_cost(leaf: OutLeaf) -> int:
    """An upper bound of what the leaf adds to a file: its value, its keys, a map header per key."""
    return leaf_size(leaf) + sum(len(_str(k)) + 5 for k in leaf.path)


def nest(leaves: Sequence[OutLeaf]) -> dict:
    """The tree of leaves (maps in first-appearance order).

    Raises:
        CheckpointError: a path is both an array and a subtree, or appears twice.
    """
    root: dict = {}
    for leaf in leaves:
        node = root
        for i, k in enumerate(leaf.path[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"{'/'.join(leaf.path[: i + 1])} would be both an array and a subtree "
                                      f"(holding {'/'.join(leaf.path)}); rename one of the tensors")
        if leaf.path[-1] in node:
            raise CheckpointError(f"{'/'.join(leaf.path)} would be written twice; rename one of the tensors")
        node[leaf.path[-1]] = leaf
    return root


def write_tree(path: Path, leaves: Sequence[OutLeaf], on_leaf: Callable[[int], None] | None = None) -> None:
    """Write ``leaves`` as one msgpack tree, streaming each array's bytes."""
    with open(path, "wb") as f:
        _write_node(f, nest(leaves), on_leaf)


def _write_node(f, node: dict, on_leaf) -> None:
    f.write(_map(len(node)))
    for key, v in node.items():
        f.write(_str(key))
        if isinstance(v, dict):
            _write_node(f, v, on_leaf)
        else:
            _write_leaf(f, v)
            if on_leaf:
                on_leaf(v.nbytes)


def _write_leaf(f, leaf: OutLeaf) -> None:
    t = leaf.produce()
    if t.dtype != leaf.dtype or tuple(t.shape) != leaf.shape:
        raise RuntimeError(f"internal error: {'/'.join(leaf.path)} produced {t.dtype}{list(t.shape)}, "
                           f"planned {leaf.dtype}{list(leaf.shape)}")
    flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    data = memoryview(flat.numpy())
    name, item = DTYPE_NAMES[leaf.dtype], leaf.dtype.itemsize
    chunks = _chunks(leaf)
    if chunks is None:
        f.write(_array_record_head(leaf.shape, name, leaf.nbytes))
        f.write(data)
        return
    f.write(_chunked_head(leaf, len(chunks)))
    for i, (first, n) in enumerate(chunks):
        f.write(_str(str(i)) + _array_record_head((n,), name, n * item))
        f.write(data[first * item: (first + n) * item])
