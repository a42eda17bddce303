"""Streaming writer of Flax msgpack parameter trees: the bytes ``flax.serialization.to_bytes`` writes.

Each leaf is an ``OutLeaf`` whose ``produce()`` returns its torch tensor when its turn comes, so one
tensor is in memory at a time. Arrays over ``MAX_CHUNK_SIZE`` bytes are written chunked as flax does
(see ``converters.flax.msgpack_format``). ``leaf_size`` is exact, so shards can be sized before writing.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ffn_tools.io.dtypes import itemsize, torch_dtype
from ffn_tools.errors import CheckpointError

from . import msgpack_format as flax_msgpack
from .msgpack_format import CHUNKED, DTYPE_NAMES, EXT_NDARRAY

if TYPE_CHECKING:
    import torch

@dataclass(frozen=True)
class OutLeaf:
    """An array to write: where in the tree, its dtype (a safetensors string), its shape, and how to get
    it (a torch tensor) when its turn comes."""

    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


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
    limit = flax_msgpack.MAX_CHUNK_SIZE  # looked up at call time: tests lower it
    if leaf.nbytes <= limit:
        return None
    per = max(1, int(limit / leaf.itemsize))
    total = math.prod(leaf.shape)
    return [(i, min(per, total - i)) for i in range(0, total, per)]


def _chunked_head(leaf: OutLeaf, n_chunks: int) -> bytes:
    shape = _map(len(leaf.shape)) + b"".join(_str(str(i)) + _uint(d) for i, d in enumerate(leaf.shape))
    return _map(3) + _str(CHUNKED) + b"\xc3" + _str("shape") + shape + _str("chunks") + _map(n_chunks)


def leaf_size(leaf: OutLeaf) -> int:
    """Exact encoded size of a leaf's value."""
    name, item = DTYPE_NAMES[leaf.dtype], leaf.itemsize
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
    import torch

    t = leaf.produce()
    if t.dtype != torch_dtype(leaf.dtype) or tuple(t.shape) != leaf.shape:
        raise RuntimeError(f"internal error: {'/'.join(leaf.path)} produced {t.dtype}{list(t.shape)}, "
                           f"planned {leaf.dtype}{list(leaf.shape)}")
    flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    data = memoryview(flat.numpy())
    name, item = DTYPE_NAMES[leaf.dtype], leaf.itemsize
    chunks = _chunks(leaf)
    if chunks is None:
        f.write(_array_record_head(leaf.shape, name, leaf.nbytes))
        f.write(data)
        return
    f.write(_chunked_head(leaf, len(chunks)))
    for i, (first, n) in enumerate(chunks):
        f.write(_str(str(i)) + _array_record_head((n,), name, n * item))
        f.write(data[first * item: (first + n) * item])
