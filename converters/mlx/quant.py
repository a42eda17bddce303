"""Streaming casts and quantization with MLX's own ops, a few rows at a time, without torch or numpy.

An output tensor made from input tensors (one, or E experts stacked on dim 0) is computed in row chunks of
about ``CHUNK_BYTES``: input bytes are read with ``pread`` (or taken from a decoded tensor when the input
is not a plain safetensors file), wrapped as an ``mx.array``, cast with ``astype`` and/or packed with
``mx.quantize``, and the results are appended to the outputs' byte buffers. Affine quantization works per
row group along the last axis, so chunking rows gives the same bits as ``mlx_lm.convert``'s whole-tensor
call (the tests compare them). Memory stays at one chunk plus the (packed) outputs of one tensor.

Quantizing a whole weight once for its parts (``quantize.QuantJob``) and in worker processes (``workers``) is
built on ``stream``.

Reading goes the other way: ``dequantize`` unpacks one module's weight, scales and biases.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import mlx.core as mx

from ffn_tools.io.dtypes import itemsize, nbytes
from ffn_tools.io.raw import RawTensor  # noqa: F401 - re-exported: the MLX modules' tensors
from ffn_tools.io.chunked import read_chunks
from ffn_tools.io.writer import write_at

CHUNK_BYTES = 4 << 20
# safetensors dtype <-> mx dtype
MX_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "F64": mx.float64, "U32": mx.uint32,
             "U8": mx.uint8, "U16": mx.uint16, "I32": mx.int32, "I64": mx.int64, "I8": mx.int8, "I16": mx.int16,
             "U64": mx.uint64, "BOOL": mx.bool_}
ST_DTYPES = {v: k for k, v in MX_DTYPES.items()}
_UINT: dict[int, tuple[Literal["B", "H", "I", "Q"], mx.Dtype]] = {
    1: ("B", mx.uint8), 2: ("H", mx.uint16), 4: ("I", mx.uint32), 8: ("Q", mx.uint64)}


def to_mx(data: memoryview, st: str, shape: Sequence[int]) -> mx.array:
    """An mx array of dtype ``st`` from raw little-endian bytes (copied)."""
    code, utype = _UINT[itemsize(st)]
    a = mx.array(data.cast(code, shape=list(shape) or [1]))  # type: ignore[arg-type]  # mlx's stub omits buffers
    a = a if MX_DTYPES[st] == utype else a.view(MX_DTYPES[st])
    return a if shape else a.reshape(())


def torch_bytes(t) -> memoryview:
    """A torch tensor's bytes (C order)."""
    import torch

    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def torch_to_mx(t) -> mx.array:
    """An mx array with a torch tensor's dtype, shape and bytes (bf16 included, never through float32)."""
    from ffn_tools.io.dtypes import as_st

    return to_mx(torch_bytes(t), as_st(t.dtype), tuple(t.shape))


def raw_bytes(a: mx.array) -> memoryview:
    """The bytes of an (evaluated, row-contiguous) mx array, through its buffer (bf16 included)."""
    return memoryview(a).cast("B")  # type: ignore[arg-type]  # mlx's stub omits array.__buffer__


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """(last dim, product of the others): a tensor seen as rows; a scalar is one row of one."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return (shape[-1] if shape else 1), rows


def row_chunks(ckpt, name: str, max_bytes: int | None = None, first: int = 0,
               last: int | None = None) -> Iterator[tuple[memoryview, int]]:
    """(bytes, rows) chunks of whole rows (``first`` to ``last``, default all) of a tensor viewed as (rows, last dim).
    A chunk read from its file is read into one buffer, used again for the next chunk (no fresh pages to fault in
    and zero for each): the view holds until the next one is asked for."""
    info = ckpt.info(name)
    max_bytes = max_bytes or CHUNK_BYTES
    cols, rows = _rows_cols(info.shape)
    row_bytes = cols * itemsize(info.st_dtype)
    last = rows if last is None else last
    if last <= first or not row_bytes:
        return
    step = max(1, max_bytes // row_bytes)
    if info.start is not None:
        for view in read_chunks(info, step * row_bytes, first * row_bytes, last * row_bytes):
            yield view, len(view) // row_bytes
        return
    data = memoryview(ckpt.read_raw(name))  # decoded by the reader (torch only where it needs it)
    for r in range(first, last, step):
        n = min(step, last - r)
        yield data[r * row_bytes:(r + n) * row_bytes], n


def stream(ckpt, sources: Sequence[str], outputs: Sequence[tuple[str, tuple[int, ...]]],
           fn: Callable[[mx.array], Sequence[mx.array]], max_bytes: int | None = None,
           dests: dict[int, tuple[str, int]] | None = None,
           rows: tuple[int, int] | None = None) -> list[RawTensor | None]:
    """Apply ``fn`` to row chunks of ``sources`` (rows concatenated in order) and collect its outputs.

    Args:
        sources: input tensor names; their rows, in order, are the rows of the logical input.
        outputs: (dtype, shape) of each output of ``fn``, for the whole logical input.
        fn: maps an (rows, last dim) chunk to per-output arrays whose first axis is those rows.
        dests: output -> (file, offset): that output is written there chunk by chunk (the file exists, at least
            that long), and None returned in its place.
        rows: only these rows (start, end) of the logical input, where every output has a ``dests``: each output's
            bytes of those rows are written where the whole output's would be (a ``quantize.QuantJob``'s piece).

    Raises:
        RuntimeError: the outputs did not come out at their planned sizes (a bug).
    """
    dests = dests or {}
    outs: list[RawTensor | None] = [None if k in dests else RawTensor(st, shape)
                                    for k, (st, shape) in enumerate(outputs)]
    sizes = [nbytes(st, shape) for st, shape in outputs]
    total = _rows_cols(outputs[0][1])[1] if outputs else 0  # every output has the input's rows
    lo, hi = rows or (0, total)
    if rows is not None and (len(dests) < len(outputs) or not 0 <= lo <= hi <= total):
        raise RuntimeError(f"internal error: rows {rows} of {total} asked of {', '.join(sources)[:200]}")
    per_row = [size // total if total else 0 for size in sizes]
    fds = {k: os.open(path, os.O_WRONLY) for k, (path, _) in dests.items()}  # never created here
    pos = [lo * b for b in per_row]
    try:
        at = 0  # the logical row the next source begins at
        for name in sources:
            info = ckpt.info(name)
            cols, n = _rows_cols(info.shape)
            first, last, at = max(lo - at, 0), min(hi - at, n), at + n
            for data, chunk_rows in row_chunks(ckpt, name, max_bytes, first, max(first, last)):
                results = fn(to_mx(data, info.st_dtype, (chunk_rows, cols)))
                mx.eval(*results)
                for k, r in enumerate(results):
                    b = raw_bytes(r)
                    if k in fds:
                        write_at(fds[k], b, dests[k][1] + pos[k])
                    else:
                        outs[k][pos[k]:pos[k] + len(b)] = b  # type: ignore[index]
                    pos[k] += len(b)
                del results
    finally:
        for fd in fds.values():
            os.close(fd)
    if pos != ([hi * b for b in per_row] if rows is not None else sizes):
        raise RuntimeError(f"internal error: {', '.join(sources)[:200]} produced {pos} bytes, planned {sizes}")
    return outs


def cast_fn(target: str | None) -> Callable[[mx.array], list[mx.array]]:
    """Chunk function: cast to ``target`` (None: unchanged)."""
    return lambda a: [a.astype(MX_DTYPES[target]) if target else a]


def quantize_fn(target: str | None, group_size: int, bits: int, mode: str = "affine") -> Callable[[mx.array], list[mx.array]]:
    """Chunk function: optional cast, then ``mx.quantize`` -> (packed weight, scales[, biases]: affine)."""
    def fn(a: mx.array) -> list[mx.array]:
        a = a.astype(MX_DTYPES[target]) if target else a
        return list(mx.quantize(a, group_size=group_size, bits=bits, mode=mode))

    return fn


def part_specs(shape: tuple[int, ...], dtype: str, group_size: int, bits: int, mode: str) -> list[tuple[str, tuple]]:
    """(dtype, shape) of the packed weight, the scales and (affine only) the biases of a weight of ``shape``
    and (after any cast) ``dtype``: the other modes keep 8-bit exponent scales and no biases."""
    wshape, sshape = quantized_shapes(shape, group_size, bits)
    if mode == "affine":
        return [("U32", wshape), (dtype, sshape), (dtype, sshape)]
    return [("U32", wshape), ("U8", sshape)]


def from_mx(a: mx.array) -> RawTensor:
    """An mx array's bytes (evaluated, made row-contiguous) as a ``RawTensor``."""
    a = mx.contiguous(a)
    mx.eval(a)
    raw = RawTensor(ST_DTYPES[a.dtype], a.shape)
    if raw:
        raw[:] = raw_bytes(a if a.ndim else a.reshape(1))
    return raw


def quantized_shapes(shape: tuple[int, ...], group_size: int, bits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(packed weight shape, scales/biases shape) of a weight of ``shape`` quantized along its last axis."""
    lead, cols = shape[:-1], shape[-1]
    return (*lead, cols * bits // 32), (*lead, cols // group_size)


def dequantize(w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
               mode: str = "affine", dtype: str | None = None) -> RawTensor:
    """Unpack one quantized weight with ``mx.dequantize``, in safetensors dtype ``dtype`` (None: the scales',
    which only affine scales have: the other modes' are 8-bit floats)."""
    return from_mx(mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode,
                                 dtype=MX_DTYPES[dtype] if dtype else None))
