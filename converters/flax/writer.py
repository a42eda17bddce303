"""Streaming writer of Flax msgpack parameter trees: the bytes ``flax.serialization.to_bytes`` writes.

``MsgpackWriter`` is the ``io.writer.Writer`` that ``plan.execute`` streams a Flax export into: one tree,
``flax_model.msgpack``, or beyond ``--max-shard-size`` shards (each an unflattened subtree) and
``flax_model.msgpack.index.json``, as transformers 4.x's ``FlaxPreTrainedModel.save_pretrained`` wrote them.
Plan entries are named by their tree path joined with ``/`` (the index's keys); the writer maps each name
back to its path. Each leaf's bytes come when its turn comes, as a torch tensor or, for bytes the plan copies
untouched, as input byte ranges moved with ``copy_file_range``: one array in memory at a time. Arrays over
``MAX_CHUNK_SIZE`` bytes are written chunked as flax does (see ``converters.flax.msgpack_format``).
``leaf_size`` is exact, so shards are sized before writing. A msgpack tree holds no metadata.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ffn_tools.io.dtypes import itemsize, torch_dtype
from ffn_tools.errors import CheckpointError
from ffn_tools.io.writer import ByteRange, OutTensor, Sources, Writer, copy_ranges, cut_ranges, write_all

from . import msgpack_format as flax_msgpack
from .msgpack_format import CHUNKED, DTYPE_NAMES, EXT_NDARRAY
from .reader import INDEX_NAME, WEIGHTS_NAME

if TYPE_CHECKING:
    from ffn_tools.progress import Progress


@dataclass(frozen=True)
class OutLeaf:
    """An array to write: where in the tree, its dtype (a safetensors string), its shape, and how to get
    its bytes (a torch tensor, or a list of ``ByteRange``) when its turn comes."""

    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], Any] | None
    reads: int | None = None  # input bytes it consumes, for progress (None: its own size)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def tree_name(path: tuple[str, ...]) -> str:
    """A leaf's name in plans and the index: its path joined with ``/``."""
    return "/".join(path)


class MsgpackWriter(Writer):
    """``plan.execute``'s writer for Flax trees (see the module doc).

    Args:
        paths: the tree path of every leaf the plan writes, in plan order.

    Raises:
        CheckpointError: a path is both an array and a subtree, appears twice, or two paths have one name.
    """

    suffix = ".msgpack"
    resumable = False  # written as one store, not as shards a resume ledger can keep (--resume refused)

    def output_bytes(self, items, *, max_shard_size, metadata, single):
        """Not known before writing (this store's own layout): ``--dry-run`` scales its sample's bytes."""
        return None

    def __init__(self, paths: Sequence[tuple[str, ...]]):
        nest([OutLeaf(p, "U8", (), None) for p in paths])  # every path an array or a subtree, never both
        self.paths: dict[str, tuple[str, ...]] = {}
        for p in paths:
            other = self.paths.setdefault(tree_name(p), p)
            if other != p:
                raise CheckpointError(f"{tree_name(p)} would name two arrays ({list(other)} and {list(p)}); "
                                      "rename one of the tensors")

    def _leaves(self, items: Sequence[OutTensor]) -> list[OutLeaf]:
        return [OutLeaf(self.paths[t.name], t.dtype, t.shape, t.produce, t.reads) for t in items]

    def write_file(self, path: Path, items: Sequence[OutTensor], metadata: dict | None,
                   progress: Progress | None = None) -> None:
        """Write ``items`` as one tree (``metadata``: ignored, a tree holds arrays only)."""
        write_tree(path, self._leaves(items), progress)

    def write_sharded(self, out_dir: Path, items: Sequence[OutTensor], *, max_shard_size: int | None,
                      metadata: dict | None, progress: Progress | None = None, ledger=None) -> list[str]:
        """``flax_model.msgpack``, or shards of at most ``max_shard_size`` bytes each plus the index."""
        leaves = self._leaves(items)
        shards = shard_leaves(leaves, max_shard_size)
        names = [WEIGHTS_NAME] if len(shards) == 1 else [
            WEIGHTS_NAME.replace(".msgpack", f"-{k:05d}-of-{len(shards):05d}.msgpack") for k in range(1, len(shards) + 1)]
        for name, shard in zip(names, shards):
            write_tree(out_dir / name, shard, progress)
        if len(shards) > 1:
            weight_map = {tree_name(leaf.path): name for name, shard in zip(names, shards) for leaf in shard}
            index = {"metadata": {"total_size": sum(leaf.nbytes for leaf in leaves)}, "weight_map": weight_map}
            (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names


def shard_leaves(leaves: list[OutLeaf], max_shard_size: int | None) -> list[list[OutLeaf]]:
    """Consecutive runs of ``leaves`` whose files are each at most ``max_shard_size`` bytes (a larger leaf
    gets a file alone)."""
    if not max_shard_size:
        return [leaves]
    shards: list[list[OutLeaf]] = []
    cur: list[OutLeaf] = []
    size = 5  # 5: the root map header, at most
    for leaf in leaves:
        cost = shard_cost(leaf)
        if cur and size + cost > max_shard_size:
            shards.append(cur)
            cur, size = [], 5
        cur.append(leaf)
        size += cost
    return [*shards, cur]


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


def write_tree(path: Path, leaves: Sequence[OutLeaf], progress: Progress | None = None) -> None:
    """Write ``leaves`` as one msgpack tree, streaming each array's bytes."""
    with open(path, "wb", buffering=0) as f:
        sink = _Sink(f, progress)
        try:
            _write_node(sink, nest(leaves))
            sink.flush()
        finally:
            sink.close()


class _Sink:
    """The output file: msgpack headers gathered in memory, array bytes written (or copied) straight through."""

    def __init__(self, f, progress: Progress | None):
        self.f, self.progress, self.head = f, progress, bytearray()
        self.sources: Sources = {}

    def put(self, b: bytes) -> None:
        self.head += b

    def flush(self) -> None:
        write_all(self.f, memoryview(self.head))
        self.head = bytearray()

    def data(self, payload: memoryview | list[ByteRange], start: int, n: int) -> None:
        """Bytes ``start:start+n`` of an array's C-order bytes (a buffer, or input ranges to copy)."""
        self.flush()
        if isinstance(payload, list):
            copy_ranges(self.f, cut_ranges(payload, start, n), self.sources, self.progress)
        else:
            write_all(self.f, payload[start: start + n])

    def close(self) -> None:
        for src in self.sources.values():
            src.close()


def _write_node(sink: _Sink, node: dict) -> None:
    sink.put(_map(len(node)))
    for key, v in node.items():
        sink.put(_str(key))
        if isinstance(v, dict):
            _write_node(sink, v)
        else:
            _write_leaf(sink, v)


def _write_leaf(sink: _Sink, leaf: OutLeaf) -> None:
    if leaf.produce is None:
        raise RuntimeError(f"internal error: {tree_name(leaf.path)} has no bytes (a structure-only leaf)")
    payload = leaf.produce()
    data: memoryview | list[ByteRange]
    if isinstance(payload, list):  # input byte ranges: copied, never entering Python; progress moves as they do
        if sum(r.nbytes for r in payload) != leaf.nbytes:
            raise RuntimeError(f"internal error: {tree_name(leaf.path)} produced {sum(r.nbytes for r in payload)} "
                               f"bytes, expected {leaf.nbytes}")
        data = payload
    else:
        import torch

        t = payload
        if t.dtype != torch_dtype(leaf.dtype) or tuple(t.shape) != leaf.shape:
            raise RuntimeError(f"internal error: {tree_name(leaf.path)} produced {t.dtype}{list(t.shape)}, "
                               f"planned {leaf.dtype}{list(leaf.shape)}")
        flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        data = flat.numpy().data  # the array's buffer, as memoryview(array) gives it
    name, item = DTYPE_NAMES[leaf.dtype], leaf.itemsize
    chunks = _chunks(leaf)
    if chunks is None:
        sink.put(_array_record_head(leaf.shape, name, leaf.nbytes))
        sink.data(data, 0, leaf.nbytes)
    else:
        sink.put(_chunked_head(leaf, len(chunks)))
        for i, (first, n) in enumerate(chunks):
            sink.put(_str(str(i)) + _array_record_head((n,), name, n * item))
            sink.data(data, first * item, n * item)
    if sink.progress and not isinstance(payload, list):
        sink.progress.update(leaf.nbytes if leaf.reads is None else leaf.reads)
