"""A GGUF's tensor data written by ffn-tools in chunks, where llama.cpp's converter would build each tensor whole.

The converter (run in ``worker``) still decides the file: tensor names, order, types, metadata, tokenizer, and
it writes the header. What it does to each tensor's values is, for the families ffn-tools declares
(``names.FAMILIES``), one of four things, each a recipe here:

- ``copy``: the tensor as it is (a rename);
- ``rotary``: q/k rows permuted into llama.cpp's rotary order, head by head (its ``LlamaModel.permute``);
- ``stack``: a layer's experts stacked into one (E, rows, cols) tensor (``ffn_{gate,up,down}_exps``);
- ``plus_one``: the weight plus one, added in its dtype after the cast to float32 unless float16 (Gemma's
  norms, ``Family.plus_one``): the recipe carries the steps (``values``) written from the ops that define it,
  ``checks.rounded.plus_ops`` (Cast, Affine: ``steps_of``), which ``encode`` runs in numpy as the ops run in torch;

then the cast every tensor goes through (to float32, then gguf-py's ``quants.quantize`` to F32, F16, BF16 or
Q8_0). All of them work on whole rows, so a tensor is written a few megabytes at a time, by a pool of threads
(numpy releases the GIL), each chunk read with ``pread`` from its place in the source file and written with
``pwrite`` at its place in the output: memory stays a few chunks whatever the model's size, and no torch is
imported. ``worker`` proves each recipe against the converter's own bytes before using it (``check_classes``).

Run by ``writer`` as ``python -m ffn_tools.converters.gguf.native REQUEST.json`` with llama.cpp's vendored
gguf-py on the path (the quantizer the converter uses); prints one JSON line.

The recipes are not ``ffn_tools.ops``, on purpose: an op's ``apply`` makes a whole torch tensor, a recipe here is
run a few rows at a time in numpy (``pieces``/``encode``: pread, permute, plus one, gguf-py's cast, pwrite) in a
process that imports no torch, and each is proved against the converter's own bytes (``worker.check_classes``).
Their ops would be Copy, Permute (``rotary_rows``), Stack and the plus one, then gguf-py's encoding (Q8_0), which no
op has: sending those ops would need a second, chunked numpy interpreter of them here, for no reader of the plan
(the converter, not the plan, decides the file). The one exception is the plus one, whose arithmetic (which dtype
it is added in) verify derives too: it is defined once, by ``plus_ops``, and its recipe's steps are written from
those ops (``steps_of``: Cast and Affine only, each a line of numpy in ``run_steps``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

CHUNK = 8 << 20  # source bytes per chunk: large enough for numpy, small enough to keep memory flat
SOURCE_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}  # what the cast reads; anything else the converter writes
QTYPES = ("F32", "F16", "BF16", "Q8_0")  # what the cast writes
Q8_0_BLOCK, Q8_0_BYTES = 32, 34  # 32 values -> one float16 scale + 32 int8


def tensor_class(name: str) -> str:
    """The tensor's name with its layer number as ``{L}``: one recipe check covers a class."""
    return re.sub(r"^blk\.\d+\.", "blk.{L}.", name)


def recipe(gguf_name: str, shape: list[int], family, config: dict, names: dict[str, str], info_of) -> dict | None:
    """How ``gguf_name``'s values come from the checkpoint, or None when no recipe here makes it.

    Args:
        shape: the tensor's shape as the converter declares it (numpy order; its experts first).
        family: the ``names.Family`` of the checkpoint.
        names: GGUF name -> Hugging Face name (``names.hf_names``).
        info_of: Hugging Face name -> ``TensorInfo`` (or KeyError).

    Returns:
        ``{"op", "sources": [{"file", "start", "dtype", "shape"}], "heads"}``; sources lie as stored (their
        bytes can be read in place) in a dtype the cast reads.
    """
    routed = route(gguf_name, shape, family, config, names)
    if routed is None:
        return None
    hf, op, heads = routed
    sources = []
    for n in hf:
        try:
            info = info_of(n)
        except KeyError:
            return None
        if info.start is None or info.st_dtype not in SOURCE_DTYPES:
            return None
        sources.append({"file": str(info.file), "start": info.start, "dtype": info.st_dtype,
                        "shape": list(info.shape)})
    if len({tuple(s["shape"]) for s in sources}) != 1:
        return None
    if heads is not None and sources[0]["shape"][0] % (2 * heads):
        return None  # rows that do not split into heads of two halves: the converter would fail too
    rec: dict = {"op": op, "sources": sources, "heads": heads}
    if op == "plus_one":
        rec["values"] = plus_steps(sources[0]["dtype"])
    return rec


def plus_steps(dtype: str) -> list[list]:
    """The steps by which the converter stores a weight of safetensors ``dtype`` plus one: ``plus_ops``'s, as
    ``steps_of`` writes them (run here by ``run_steps``)."""
    from ffn_tools.checks.rounded import plus_ops
    from ffn_tools.io.dtypes import torch_dtype

    return steps_of(plus_ops(torch_dtype(dtype), 1.0))


def steps_of(ops) -> list[list]:
    """Value ops (``ffn_tools.ops``: Cast, Affine) as a recipe's JSON steps: ``["cast", dtype]``,
    ``["affine", scale, shift]``.

    Raises:
        ValueError: an op that is not one of them (``run_steps`` runs no other).
    """
    from ffn_tools.ops import Affine, Cast

    steps: list[list] = []
    for op in ops:
        if isinstance(op, Cast) and op.dtype in STEP_DTYPES:
            steps.append(["cast", op.dtype])
        elif isinstance(op, Affine):
            steps.append(["affine", float(op.scale), float(op.shift)])
        else:
            raise ValueError(f"no recipe step runs {op.describe()}")
    return steps


STEP_DTYPES = {"F32": "float32", "F16": "float16"}  # numpy has no bfloat16: a step casts to these only


def run_steps(x, steps: list[list]):
    """Numpy ``x`` through a recipe's ``steps`` (``steps_of``), as their ops run in torch: a cast, or ``x * scale +
    shift`` computed in float32 and stored back in ``x``'s dtype (``Affine``)."""
    import numpy as np

    for step in steps:
        if step[0] == "cast":
            x = x.astype(STEP_DTYPES[step[1]], copy=False)
        elif step[0] == "affine":
            y = x.astype(np.float32)
            if step[1] != 1.0:
                y = y * np.float32(step[1])
            x = (y + np.float32(step[2])).astype(x.dtype, copy=False)
        else:
            raise ValueError(f"unknown recipe step {step!r}")
    return x


def route(gguf_name: str, shape: list[int], family, config: dict,
          names: dict[str, str]) -> tuple[list[str], str, int | None] | None:
    """Which Hugging Face tensors ``gguf_name`` is made of, and how: (names, op, heads to permute or None), op
    one of ``copy``, ``rotary``, ``stack``, ``plus_one``; None where no recipe here makes it (arguments as
    ``recipe``)."""
    from .names import expert_names, plus_one

    if m := re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", gguf_name):
        if family.experts is None:
            return None
        return expert_names(family, int(m.group(1)), m.group(2), shape[0]), "stack", None  # (E, rows, cols)
    if gguf_name not in names:
        return None
    hf, op, heads = [names[gguf_name]], "copy", None
    if plus_one(family, hf[0]):
        op = "plus_one"
    elif family.rotary and re.search(r"\.(q|k)_proj\.(weight|bias)$", hf[0]):
        heads = int(config["num_attention_heads"])
        if ".k_proj." in hf[0]:
            heads = int(config.get("num_key_value_heads") or heads)
        op = "rotary"
    return hf, op, heads


def shape_of(rec: dict) -> list[int]:
    """The shape the recipe makes (numpy order)."""
    shape = rec["sources"][0]["shape"]
    return [len(rec["sources"]), *shape] if rec["op"] == "stack" else list(shape)


def pieces(rec: dict) -> Iterator[tuple[dict, int, int, int | None]]:
    """The recipe's chunks in output order: (source, first row, end row, head size to permute or None).

    A tensor is taken as rows of its last dimension (a 1-D tensor as rows of one value); a rotary chunk is
    whole heads."""
    for src in rec["sources"]:
        shape = src["shape"]
        rows = shape[0]
        row_bytes = _count(shape[1:]) * SOURCE_DTYPES[src["dtype"]]
        step = max(1, CHUNK // max(row_bytes, 1))
        head = None
        if rec["op"] == "rotary":
            head = rows // rec["heads"]
            step = max(head, step // head * head)
        for r0 in range(0, rows, step):
            yield src, r0, min(rows, r0 + step), head


def encode(src: dict, r0: int, r1: int, head: int | None, qtype: str,
           steps: list[list] | None = None) -> bytes | bytearray | memoryview:
    """Rows [r0, r1) of ``src`` as the converter writes them in ``qtype`` (``steps``: the recipe's ``values``,
    the plus one, run on the values as read)."""
    import numpy as np

    from ffn_tools.io.store import read_bytes

    cols = _count(src["shape"][1:])
    size = SOURCE_DTYPES[src["dtype"]]
    raw: bytes | bytearray = read_bytes(src["file"], src["start"] + r0 * cols * size, (r1 - r0) * cols * size)
    if head is not None:
        raw = rotary_rows(np.frombuffer(raw, np.uint8).reshape(r1 - r0, cols * size), head).tobytes()
    if qtype == src["dtype"] and qtype in ("F32", "F16") and not steps:
        return raw  # the converter keeps a float32 or float16 tensor as it is
    if qtype == "BF16" and src["dtype"] == "BF16" and not steps:
        return _bf16_as_bf16(raw)
    if src["dtype"] == "BF16":  # bfloat16 -> float32 is exact: the bits, shifted
        bits = np.empty(len(raw) // 2, np.uint32)
        np.copyto(bits, np.frombuffer(raw, np.uint16), casting="unsafe")
        x = np.left_shift(bits, 16, out=bits).view(np.float32)
    elif src["dtype"] == "F16":
        x = np.frombuffer(raw, np.float16)
    else:
        x = np.frombuffer(raw, np.float32)
    if steps:
        x = run_steps(x, steps)  # bfloat16's exact float32 is what its Cast("F32") makes
    return encode_values(x.astype(np.float32, copy=False).reshape(r1 - r0, cols), qtype)


def encode_values(x, qtype: str) -> bytes | memoryview:
    """Float32 rows ``x`` in ``qtype``, the bytes gguf-py's ``quants.quantize`` gives (Q8_0 by ``q8_0``, the
    same bytes in half the time, where it can)."""
    if qtype == "Q8_0":
        blocks = q8_0(x)
        if blocks is not None:
            return blocks
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(x, getattr(GGMLQuantizationType, qtype)).tobytes()


HALF_BELOW = 0.49999997  # float32's largest value below 0.5 (nextafter(0.5, 0))


def q8_0(x):
    """Float32 ``x`` (whole blocks of 32) as Q8_0, the bytes gguf-py's ``quants.quantize`` makes (llama.cpp's
    ``quantize_row_q8_0_ref``), in about half its time; None where a block's scale or its inverse is not finite
    (NaN or infinite weights, or a scale so small its inverse overflows), which the caller leaves to gguf-py.

    Per block: ``d = max|x| / 127`` and ``q = roundf(x * (1 / d))`` as int8, in float32 as gguf-py does them.
    Three things differ in how, not in what: the maximum is taken over the bits as int32 (a non-negative
    float32 orders as its bits do; a NaN's bits lie above infinity's, and a NaN gives up to gguf-py anyway),
    which numpy does three times as fast; buffers are reused in place; and ``roundf`` (half away from zero;
    gguf-py's ``np_roundf``, eight passes) is one add of ``copysign(HALF_BELOW, y)`` before the int8 cast
    truncates.
    That add gives roundf's integer for every finite float32 of magnitude up to 128.5 (all 2.2 billion, against
    ``np_roundf``: ``benchmarks/prove_q8_0_rounding.py``; ``test_gguf_native`` compares the ties and their
    neighbours on every run), and
    here ``|y| <= 127`` plus rounding, because ``|x| <= max|x|``.
    """
    import numpy as np

    n = x.size // Q8_0_BLOCK
    b = x.reshape(n, Q8_0_BLOCK)
    a, t = _scratch(n)
    np.abs(b, out=a)
    with np.errstate(all="ignore"):  # NaN, infinity and an inverse's overflow are answered just below
        d = a.view(np.int32).max(axis=1, keepdims=True).view(np.float32) / np.float32(127)
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    if not (np.isfinite(d).all() and np.isfinite(inv).all()):
        return None
    y = np.multiply(b, inv, out=a)
    half = t.view(np.uint32)  # copysign(HALF_BELOW, y), as bits: numpy's copysign is a slower loop
    np.bitwise_and(y.view(np.uint32), np.uint32(0x80000000), out=half)
    np.bitwise_or(half, np.float32(HALF_BELOW).view(np.uint32), out=half)
    y += t
    out = np.empty((n, Q8_0_BYTES), np.uint8)
    with np.errstate(over="ignore"):  # a scale above float16's range is infinite, in gguf-py's bytes too
        out[:, :2] = d.astype(np.float16).view(np.uint8)
    np.copyto(out[:, 2:].view(np.int8), y, casting="unsafe")
    return out.reshape(-1).data


def rotary_rows(rows, head: int):
    """``rows`` (n, row bytes, whole heads of ``head`` rows) in llama.cpp's rotary order: each head's
    (2, head/2) rows as (head/2, 2), LlamaModel.permute on whole rows, whatever a row's encoding."""
    n = rows.shape[0]
    return rows.reshape(n // head, 2, head // 2, -1).swapaxes(1, 2).reshape(n, -1)


_THREAD = threading.local()


def _scratch(n: int):
    """Two (n, 32) float32 buffers of this thread's, kept between chunks: fresh ones would be pages the kernel
    zeroes and faults in for every chunk."""
    import numpy as np

    bufs = getattr(_THREAD, "q8_0", None)
    if bufs is None or len(bufs[0]) < n:
        bufs = _THREAD.q8_0 = (np.empty((n, Q8_0_BLOCK), np.float32), np.empty((n, Q8_0_BLOCK), np.float32))
    return bufs[0][:n], bufs[1][:n]


def _bf16_as_bf16(raw):
    """bfloat16 through float32 and gguf-py's BF16 rounding, bit for bit: every value comes back unchanged
    (its low 16 float32 bits are zero, so the round-to-nearest-even adds nothing) except NaNs, which the
    rounding makes quiet (bit 6 of the bfloat16 set). ``test_gguf_native`` proves it on all 65536 patterns."""
    import numpy as np

    u = np.frombuffer(raw, np.uint16)
    nan = (u & 0x7FFF) > 0x7F80
    if not nan.any():
        return raw
    u = u.copy()
    u[nan] |= 0x0040
    return u.tobytes()


def out_bytes(rec: dict, qtype: str) -> int:
    """The bytes the recipe writes in ``qtype``."""
    return _encoded_bytes(_count(shape_of(rec)), qtype)


def _encoded_bytes(n: int, qtype: str) -> int:
    """The bytes ``n`` values take in ``qtype`` (whole Q8_0 blocks: rows are multiples of 32)."""
    if qtype == "Q8_0":
        return n // Q8_0_BLOCK * Q8_0_BYTES
    return n * {"F32": 4, "F16": 2, "BF16": 2}[qtype]


def tensor_bytes(rec: dict, qtype: str) -> bytes:
    """The whole tensor as the recipe writes it (for the worker's check against the converter)."""
    return b"".join(encode(src, r0, r1, head, qtype, rec.get("values")) for src, r0, r1, head in pieces(rec))


def write(tensors: list[dict], out: Path, *, threads: int | None = None, progress: bool = False) -> int:
    """Write each ``{"offset", "type", "recipe"}`` at its offset in ``out`` (which exists, at its full size).

    Chunks are encoded by a pool of threads (one per core), a bounded number in flight, each written where it
    belongs as it completes. Returns the bytes written.

    Raises:
        OSError: reading a source or writing the output failed; ValueError: a chunk of the wrong size.
    """
    from ffn_tools.io.writer import write_at
    from ffn_tools.progress import Progress

    jobs = []
    for t in tensors:
        pos = t["offset"]
        for src, r0, r1, head in pieces(t["recipe"]):
            size = _encoded_bytes((r1 - r0) * _count(src["shape"][1:]), t["type"])
            jobs.append((src, r0, r1, head, t["type"], t["recipe"].get("values"), pos, size))
            pos += size
        if pos - t["offset"] != t["bytes"]:
            raise ValueError(f"{t['name']}: the recipe makes {pos - t['offset']} bytes, the header says {t['bytes']}")
    total = sum(j[-1] for j in jobs)
    bar = Progress(total, "Writing") if progress else None
    lock = threading.Lock()
    fd = os.open(out, os.O_WRONLY)
    try:
        def one(job) -> int:
            src, r0, r1, head, qtype, steps, pos, size = job
            data = encode(src, r0, r1, head, qtype, steps)
            if len(data) != size:
                raise ValueError(f"a chunk of {len(data)} bytes where {size} belong")
            write_at(fd, memoryview(data), pos)
            if bar is not None:
                with lock:
                    bar.update(size)
            return size

        workers = threads or os.cpu_count() or 1
        written = 0
        with ThreadPoolExecutor(workers) as pool:
            pending: set[Future] = set()
            for job in jobs:
                if len(pending) >= 2 * workers:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    written += sum(f.result() for f in done)
                pending.add(pool.submit(one, job))
            written += sum(f.result() for f in pending)
    finally:
        os.close(fd)
        if bar is not None:
            bar.close()
    return written


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    try:
        n = write(request["tensors"], Path(request["out"]), progress=request.get("progress", False))
    except (OSError, ValueError) as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        sys.exit(1)
    print(json.dumps({"written": n}))


if __name__ == "__main__":
    main()
