"""Streaming safetensors writer: one tensor in memory at a time, untouched bytes copied by the kernel.

Each output tensor is an ``OutTensor`` whose ``produce()`` returns its bytes as a torch tensor, a numpy
array, a bytes-like object, or a list of ``ByteRange`` (pieces of input files copied verbatim with
``copy_file_range``, never entering Python). Shards are filled greedily in the given order so that every
file, header included, is at most ``max_shard_size`` bytes (a tensor larger than that gets a shard alone).

``Writer`` is the file format ``executor.execute`` streams into: ``SAFETENSORS`` (these functions) by default; a
format module gives its own (``converters.flax.writer.MsgpackWriter``) to reuse the executor unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..progress import Progress
from .resume import Ledger
from .safetensors_format import PAGE, build_header
from .outtensor import ByteRange, OutTensor, Payload, Placed, Sources  # noqa: F401  (callers import them here)
from .shards import index_text, kept, plan_shards, shard_names, write_index  # noqa: F401  (callers import them here too)


def write_file(path: Path, items: Sequence[OutTensor], metadata: dict | None, progress: Progress | None = None,
               announced: bool = False) -> None:
    """Write one safetensors file, streaming each tensor's bytes.

    Byte ranges that continue one another in the same input file (consecutive untouched tensors, the
    halves of a split) are merged into one ``copy_file_range`` run. Tensors with a ``place`` are told where their
    bytes go once the file has its full size, and their ``Placed`` bytes are stepped over. ``announced``: the file
    was made and its places told already (``prepare``): it is written into, not created again.
    """
    header = _header(items, metadata)
    sources: Sources = {}
    pending: list[ByteRange] = []
    try:
        with open(path, "r+b" if announced else "wb", buffering=0) as f:
            write_all(f, memoryview(header))
            if not announced:
                _announce(f, path, len(header), items)
            for t in items:
                if t.stream is not None:
                    _flush(f, pending, sources, progress)
                    written = _stream(f, t, progress)
                    if written != t.nbytes:
                        raise RuntimeError(f"internal error: {t.name} produced {written} bytes, expected {t.nbytes}")
                    continue
                payload = t.produce()
                if isinstance(payload, Placed):
                    _flush(f, pending, sources, progress)
                    f.seek(payload.nbytes, os.SEEK_CUR)
                    written = payload.nbytes
                    if progress:
                        progress.update(t.progress_bytes)
                elif isinstance(payload, list):
                    written = sum(r.nbytes for r in payload)
                    for r in payload:
                        last = pending[-1] if pending else None
                        if last and last.file == r.file and last.start + last.nbytes == r.start:
                            pending[-1] = ByteRange(r.file, last.start, last.nbytes + r.nbytes)
                        else:
                            pending.append(r)
                else:
                    _flush(f, pending, sources, progress)
                    written = _emit(f, payload)
                    if progress:
                        progress.update(t.progress_bytes)
                if written != t.nbytes:
                    raise RuntimeError(f"internal error: {t.name} produced {written} bytes, expected {t.nbytes}")
            _flush(f, pending, sources, progress)
    finally:
        for src in sources.values():
            src.close()


def _stream(f, t: OutTensor, progress: Progress | None) -> int:
    """Write ``t``'s chunks (``OutTensor.stream``) one after the other; progress moves as they do."""
    assert t.stream is not None
    written = counted = 0
    for chunk in t.stream():
        written += _emit(f, chunk)
        if progress and t.nbytes:
            now = min(written, t.nbytes) * t.progress_bytes // t.nbytes
            progress.update(now - counted)
            counted = now
    return written


def _header(items: Sequence[OutTensor], metadata: dict | None) -> bytes:
    return build_header([(t.name, t.dtype, t.shape, t.nbytes) for t in items], metadata, _data_start_mod(items))


def prepare(path: Path, items: Sequence[OutTensor], metadata: dict | None) -> bool:
    """Make the file of ``items`` now, at its full size with its header, and tell each tensor with a ``place`` where
    its bytes go, so that producers working ahead (4-bit MLX's quantization workers) can write a later shard's
    bytes before the writer reaches it, rather than send them back to wait in this process. False (nothing made)
    where no tensor has a ``place``."""
    if not any(t.place for t in items):
        return False
    header = _header(items, metadata)
    with open(path, "wb", buffering=0) as f:
        write_all(f, memoryview(header))
        _announce(f, path, len(header), items)
    return True


def _announce(f, path: Path, at: int, items: Sequence[OutTensor]) -> None:
    """Give the file its full size and tell each tensor with a ``place`` where its bytes begin."""
    if not any(t.place for t in items):
        return
    f.truncate(at + sum(t.nbytes for t in items))
    for t in items:
        if t.place:
            t.place(path, at)
        at += t.nbytes


def _data_start_mod(items: Sequence[OutTensor]) -> int | None:
    """The data start (mod PAGE) that puts the first copied tensor at its input offset's page position."""
    before = 0
    for t in items:
        if t.source_start is not None:
            return (t.source_start - before) % PAGE
        before += t.nbytes
    return None


def _flush(f, pending: list[ByteRange], sources: Sources, progress: Progress | None = None) -> None:
    for r in pending:
        if r.file not in sources:
            sources[r.file] = open(r.file, "rb", buffering=0)
        _copy_range(f, sources[r.file], r, progress)
    pending.clear()


def write_sharded(out_dir: Path, items: Sequence[OutTensor], *, max_shard_size: int | None,
                  metadata: dict | None, prefix: str = "model", progress: Progress | None = None,
                  ledger: Ledger | None = None) -> list[str]:
    """Write ``items`` into ``out_dir`` as HF-style shards (+ index when more than one).

    Args:
        ledger: the resume ledger of ``out_dir`` (``io.resume``): a shard it says is finished is kept, not
            written; each shard written is handed to it for its manifest.

    Returns:
        The shard file names written.
    """
    shards = plan_shards(items, max_shard_size, metadata)
    names = shard_names(len(shards), prefix)
    todo = [(name, shard) for name, shard in zip(names, shards) if not kept(ledger, name, shard, progress)]
    made = {name: prepare(out_dir / name, shard, metadata) for name, shard in todo}  # every place known at once
    for k, (name, shard) in enumerate(todo):
        write_file(out_dir / name, shard, metadata, progress, announced=made[name])
        if ledger is not None:
            ledger.finished(name, last=k == len(todo) - 1)
    write_index(out_dir, items, shards, names, prefix)
    return names


def output_bytes(items: Sequence[OutTensor], max_shard_size: int | None, metadata: dict | None,
                 single: bool) -> int:
    """The bytes ``write_file`` (``single``) or ``write_sharded`` writes for ``items``: every shard's header and
    data, and the index, computed as they compute them, before anything is written."""
    shards = [list(items)] if single else plan_shards(items, max_shard_size, metadata)
    text = None if single else index_text(items, shards, shard_names(len(shards)))
    return (sum(len(_header(shard, metadata)) + sum(t.nbytes for t in shard) for shard in shards)
            + (len(text.encode()) if text is not None else 0))


class Writer:
    """How ``executor.execute`` lays the tensor stream out on disk: one file, or shards (+ an index) in a directory.

    The executor owns everything around it (the atomic temporary output, --force, the lock, progress, side
    files, config.json, cleanup on errors and signals); a writer only turns ``OutTensor`` items, in plan order,
    into files. This one writes safetensors; a subclass overrides the three members for another format.

    Attributes:
        suffix: a single-file output ends in it (any other path is a directory of shards).
    """

    suffix = ".safetensors"
    resumable = True  # write_sharded takes a resume ledger (a subclass writing another layout says False)

    def write_file(self, path: Path, items: Sequence[OutTensor], metadata: dict | None,
                   progress: Progress | None = None) -> None:
        """Write ``items`` as the one file ``path``."""
        write_file(path, items, metadata, progress)

    def write_sharded(self, out_dir: Path, items: Sequence[OutTensor], *, max_shard_size: int | None,
                      metadata: dict | None, progress: Progress | None = None,
                      ledger: Ledger | None = None) -> list[str]:
        """Write ``items`` into the existing directory ``out_dir``; returns the weight file names written.
        ``ledger``: see ``write_sharded`` (given only where ``resumable``)."""
        return write_sharded(out_dir, items, max_shard_size=max_shard_size, metadata=metadata, progress=progress,
                             ledger=ledger)

    def output_bytes(self, items: Sequence[OutTensor], *, max_shard_size: int | None, metadata: dict | None,
                     single: bool) -> int | None:
        """The weight files' bytes (index included) that ``items`` make, exact, before a byte is written
        (``single``: one file); None where a writer cannot say (then ``--dry-run`` scales its sample's bytes). A
        subclass that writes another layout overrides it."""
        return output_bytes(items, max_shard_size, metadata, single)


SAFETENSORS = Writer()


def cut_ranges(ranges: Sequence[ByteRange], start: int, n: int) -> list[ByteRange]:
    """Bytes ``start:start+n`` of the concatenation of ``ranges``, as ranges (a piece of a copied tensor)."""
    out, at = [], 0
    for r in ranges:
        lo, hi = max(start, at), min(start + n, at + r.nbytes)
        if lo < hi:
            out.append(ByteRange(r.file, r.start + lo - at, hi - lo))
        at += r.nbytes
    return out


def produced_tensor(t: OutTensor):
    """The torch tensor ``t`` produces, contiguous: for writers of formats that take tensors (DCP's chunks,
    Orbax's tensorstore)."""
    return payload_tensor(t.produce(), t.dtype, t.shape)


def payload_tensor(payload: Payload, dtype: str, shape: tuple[int, ...]):
    """A produced payload as a contiguous torch tensor of safetensors ``dtype`` and ``shape`` (input byte ranges
    read into one)."""
    from .raw import RawTensor
    from .store import read_bytes

    if not isinstance(payload, list):
        return payload.contiguous()
    if len(payload) == 1:
        data = read_bytes(payload[0].file, payload[0].start, payload[0].nbytes)
    else:
        data = bytearray(sum(r.nbytes for r in payload))
        at = 0
        for r in payload:
            data[at: at + r.nbytes] = read_bytes(r.file, r.start, r.nbytes)
            at += r.nbytes
    return RawTensor(dtype, shape, data).to_torch()


def copy_ranges(f, ranges: Sequence[ByteRange], sources: Sources, progress: Progress | None = None) -> None:
    """Append ``ranges`` of input files to the unbuffered binary file ``f`` (``copy_file_range`` where the system
    has it): for writers of other formats. ``sources`` caches the inputs it opens; the caller closes them."""
    _flush(f, list(ranges), sources, progress)


WRITE_STEP = 256 << 10  # bytes per write call (see write_at)


def write_all(f, view: memoryview) -> None:
    """All of ``view`` appended to the unbuffered binary file ``f``, ``WRITE_STEP`` bytes a call (see ``write_at``):
    for every writer of a weight file."""
    while view:
        n = f.write(view[:WRITE_STEP])
        view = view[n:]


def write_at(fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` into the open file ``fd`` at ``offset`` (``pwrite``): for producers that write their bytes
    at their place themselves (``OutTensor.place``, GGUF's chunk writer).

    At most ``WRITE_STEP`` bytes a call: the page cache takes a write in folios as large as the write, and on a virtual
    machine whose host takes back free memory (free page reporting) large folios come from memory the host must fault
    in again: 2 GB written 8 MiB at a time took 6.2 s there, 256 KiB at a time 0.5 s (docs/performance.md#writes)."""
    while view:
        n = os.pwrite(fd, view[:WRITE_STEP], offset)
        view, offset = view[n:], offset + n


def _emit(f, payload: Payload) -> int:
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")  # a tensor/array means it is imported
    if torch is not None and isinstance(payload, torch.Tensor):
        t = payload.detach().cpu().contiguous().reshape(-1)
        payload = t.view(torch.uint8).numpy() if t.numel() else b""
        np = sys.modules["numpy"]
    if np is not None and isinstance(payload, np.ndarray):
        payload = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    view = memoryview(payload).cast("B")
    write_all(f, view)
    return len(view)


COPY_STEP = 256 << 20  # bytes per copy_file_range call: progress moves as the copy does (~0.1-0.5 s a step)


def _copy_range(f, src, r: ByteRange, progress: Progress | None = None) -> None:
    """Copy a byte range of an open input file with copy_file_range (falling back to read/write)."""
    offset, left = r.start, r.nbytes
    try:
        while left:
            n = os.copy_file_range(src.fileno(), f.fileno(), min(left, COPY_STEP), offset)
            if n == 0:
                raise OSError("short copy")
            offset += n
            left -= n
            if progress:
                progress.update(n)
    except (OSError, AttributeError):
        src.seek(offset)
        while left:
            chunk = src.read(min(left, 64 << 20))
            if not chunk:
                raise OSError(f"{r.file}: ended early while copying") from None
            write_all(f, memoryview(chunk))
            left -= len(chunk)
            if progress:
                progress.update(len(chunk))
