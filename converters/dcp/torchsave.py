"""Where a ``torch.save`` of one tensor keeps its bytes, found without loading it.

A DCP chunk is a ``torch.save`` zip: ``archive/data.pkl`` (a pickle calling ``torch._utils._rebuild_tensor_v2``
on a storage, an offset, a size and a stride) and the storage's bytes stored uncompressed as ``archive/data/0``.
``locate`` reads the zip's central directory and that pickle (through an unpickler that builds nothing but the call's
arguments: nothing runs) and gives the absolute offset of the tensor's bytes where they are the tensor, C-order,
whole (a contiguous tensor at storage offset 0 filling its storage). The reader then reads those bytes with
``pread`` and conversions copy them with ``copy_file_range``, as safetensors' bytes; any other chunk is read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from dataclasses import dataclass

from ffn_tools.io.writer import write_all

LOCAL, CENTRAL, EOCD = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"
_STORAGES = {"BFloat16Storage", "HalfStorage", "FloatStorage", "DoubleStorage", "LongStorage", "IntStorage",
             "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage", "UntypedStorage"}


@dataclass(frozen=True)
class Stored:
    """A saved tensor's bytes: ``start`` in the file, ``nbytes`` long."""

    start: int
    nbytes: int


class _Call:
    def __init__(self, *args):
        self.args = args


class _Args(pickle.Unpickler):
    """Unpickles ``data.pkl`` into the arguments of its ``_rebuild_tensor_v2`` call; refuses anything else."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Call
        if module == "torch" and name in _STORAGES:
            return name
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid


def _records(f, start: int, length: int) -> dict[str, tuple[int, int]] | None:
    """name -> (local header offset from ``start``, size) of each record of the zip at ``start`` (``length`` bytes)
    of ``f``, from its central directory (torch.save streams its records, so local headers may not hold sizes);
    None where it is not such a zip or a record is compressed."""
    tail = _pread(f, start + max(0, length - 4096), min(length, 4096))
    end = tail.rfind(EOCD)
    if end < 0 or end + 22 > len(tail):
        return None
    count, cd_size, cd_at = struct.unpack("<HII", tail[end + 10: end + 20])
    if cd_at == 0xFFFFFFFF or count == 0xFFFF:  # zip64: the locator before the EOCD points at its record
        loc = tail.rfind(b"PK\x06\x07", 0, end)
        if loc < 0:
            return None
        (rec,) = struct.unpack("<Q", tail[loc + 8: loc + 16])
        z64 = _pread(f, start + rec, 56)
        if z64[:4] != b"PK\x06\x06":
            return None
        count, cd_size, cd_at = struct.unpack("<QQQ", z64[32:56])
    if cd_at + cd_size > length or cd_size > 1 << 20:
        return None
    cd = _pread(f, start + cd_at, cd_size)
    out, at = {}, 0
    for _ in range(count):
        if cd[at: at + 4] != CENTRAL:
            return None
        method, = struct.unpack("<H", cd[at + 10: at + 12])
        csize, usize, nlen, xlen, clen = struct.unpack("<IIHHH", cd[at + 20: at + 34])
        (local,) = struct.unpack("<I", cd[at + 42: at + 46])
        name = cd[at + 46: at + 46 + nlen].decode("utf-8", "replace")
        extra = cd[at + 46 + nlen: at + 46 + nlen + xlen]
        x = 0
        while x + 4 <= len(extra):  # zip64 extra: the fields that overflowed, in this order
            tag, size = struct.unpack("<HH", extra[x: x + 4])
            if tag == 1:
                vals, y = extra[x + 4: x + 4 + size], 0
                if usize == 0xFFFFFFFF:
                    (usize,), y = struct.unpack("<Q", vals[y: y + 8]), y + 8
                if csize == 0xFFFFFFFF:
                    (csize,), y = struct.unpack("<Q", vals[y: y + 8]), y + 8
                if local == 0xFFFFFFFF:
                    (local,), y = struct.unpack("<Q", vals[y: y + 8]), y + 8
            x += 4 + size
        at += 46 + nlen + xlen + clen
        if method != 0 or csize != usize:
            return None
        out[name] = (local, csize)
    return out


def _data_at(f, start: int, local: int) -> int | None:
    """Where the data of the record whose local header is at ``local`` (from ``start``) begins, from ``start``."""
    head = _pread(f, start + local, 30)
    if head[:4] != LOCAL:
        return None
    lnlen, lxlen = struct.unpack("<HH", head[26:30])
    return local + 30 + lnlen + lxlen


def locate(f, start: int, length: int, itemsize: int, shape: tuple[int, ...]) -> Stored | None:
    """The bytes of the tensor ``torch.save`` wrote at ``start`` (``length`` bytes) of open file ``f``, when they are
    the whole tensor in C order (``shape``, ``itemsize`` bytes an element); None otherwise (read it with torch.load).
    Reads the zip's directory and the pickle only."""
    records = _records(f, start, length)
    if records is None:
        return None
    found = {("data/" if "/data/" in n else "") + n.rsplit("/", 1)[-1]: v for n, v in records.items()}
    if "data.pkl" not in found or {k for k in found if k.startswith("data/")} != {"data/0"}:
        return None
    pkl_at, data_at = (_data_at(f, start, found[k][0]) for k in ("data.pkl", "data/0"))  # the two records read
    if pkl_at is None or data_at is None:
        return None
    try:
        call = _Args(io.BytesIO(_pread(f, start + pkl_at, found["data.pkl"][1]))).load()
    except Exception:  # noqa: BLE001 - anything unexpected: torch.load reads it instead
        return None
    if not isinstance(call, _Call) or len(call.args) < 4:
        return None
    storage, offset, size_, stride = call.args[:4]
    numel = math.prod(shape)
    contiguous = tuple(stride) == tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
    if (not isinstance(storage, tuple) or len(storage) < 5 or storage[2] != "0" or offset != 0
            or tuple(size_) != tuple(shape) or not (contiguous or numel <= 1) or storage[4] * (
                1 if storage[1] == "UntypedStorage" else itemsize) != numel * itemsize):
        return None
    data_size = found["data/0"][1]
    if data_size != numel * itemsize or data_at + data_size > length:
        return None
    return Stored(start + data_at, data_size)


def _pread(f, start: int, n: int) -> bytes:
    import os

    return os.pread(f.fileno(), n, start)


# ---- writing: what torch.save writes for one tensor, its bytes streamed in blocks -------------------------------

ALIGN = 64  # torch.save's storage alignment: every record's data starts at a multiple of it
BLOCK = 16 << 20  # bytes read, checksummed and written at a time
_STORAGE = {"bfloat16": "BFloat16Storage", "float16": "HalfStorage", "float32": "FloatStorage",
            "float64": "DoubleStorage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
            "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage"}


def writable(dtype: str) -> bool:
    """``write`` writes tensors of this dtype (others go through torch.save)."""
    return dtype in _STORAGE


class _Storage:
    """The storage of the tensor being pickled: ``_Pickler.persistent_id`` names it as torch.save does."""

    def __init__(self, dtype: str, numel: int):
        self.dtype, self.numel = dtype, numel


class _Tensor:
    def __init__(self, storage: _Storage, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        import collections

        import torch

        stride = tuple(math.prod(self.shape[k + 1:]) for k in range(len(self.shape)))
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, tuple(self.shape), stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        import torch

        if isinstance(obj, _Storage):
            return ("storage", getattr(torch, _STORAGE[obj.dtype]), "0", "cpu", obj.numel)
        return None


def data_pkl(dtype: str, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of a torch.save of a C-contiguous tensor (the call ``_rebuild_tensor_v2`` on storage "0")."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_Tensor(_Storage(dtype, math.prod(shape)), tuple(shape)))
    return buf.getvalue()


def _local(name: bytes, start: int, size: int, crc: int, zip64: bool) -> bytes:
    """A local header whose data begins at a multiple of ``ALIGN`` from the zip's start, the record at ``start``."""
    extra64 = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
    base = 30 + len(name) + len(extra64)
    pad = (-(start + base + 4)) % ALIGN  # "FB" padding extra: 4 bytes of header and the padding
    extra = extra64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    small = 0xFFFFFFFF if zip64 else size
    return (LOCAL + struct.pack("<HHHHHIIIHH", 45 if zip64 else 20, 0x800, 0, 0, 0x21, crc, small, small, len(name),
                                len(extra)) + name + extra)


class _Zip:
    """Records appended to ``f`` from its current position, then the central directory (zip64 where needed)."""

    def __init__(self, f, zip64: bool):
        self.f, self.zip64, self.origin = f, zip64, f.tell()
        self.records: list[tuple[bytes, int, int, int]] = []  # name, header offset, size, crc

    def _at(self) -> int:
        return self.f.tell() - self.origin

    def small(self, name: str, data: bytes) -> None:
        import zlib

        self.stream(name, len(data), [memoryview(data)], zlib.crc32(data))

    def stream(self, name: str, size: int, blocks, crc: int | None = None) -> None:
        """A record of ``size`` bytes written from ``blocks`` (buffers, or input ``ByteRange``s: checksummed as read,
        then copied file to file with ``copy_file_range``); its CRC computed as they pass and written into the
        header afterwards, unless given."""
        import os
        import zlib

        from ffn_tools.io.writer import ByteRange, copy_ranges

        key = name.encode()
        at = self._at()
        header = _local(key, at, size, crc or 0, self.zip64)
        _write(self.f, header)
        running, done = 0, 0
        sources: dict = {}
        try:
            for b in blocks:
                if isinstance(b, ByteRange):
                    for block in range_blocks(b.file, b.start, b.nbytes):
                        running = zlib.crc32(block, running)
                    copy_ranges(self.f, [b], sources)
                    done += b.nbytes
                    continue
                if crc is None:
                    running = zlib.crc32(b, running)
                _write(self.f, b)
                done += len(b)
        finally:
            for src in sources.values():
                src.close()
        if done != size:
            raise RuntimeError(f"internal error: {name} wrote {done} bytes, planned {size}")
        if crc is None:
            crc = running
            os.pwrite(self.f.fileno(), struct.pack("<I", crc), self.origin + at + 14)
        self.records.append((key, at, size, crc))

    def close(self) -> None:
        cd_at = self._at()
        for key, at, size, crc in self.records:
            if self.zip64:
                extra = struct.pack("<HHQQQ", 1, 24, size, size, at)
                small, off = 0xFFFFFFFF, 0xFFFFFFFF
            else:
                extra, small, off = b"", size, at
            _write(self.f, CENTRAL + struct.pack("<HHHHHHIIIHHHHHII", 45 if self.zip64 else 20, 45 if self.zip64
                                                 else 20, 0x800, 0, 0, 0x21, crc, small, small, len(key), len(extra),
                                                 0, 0, 0, 0, off) + key + extra)
        cd_size = self._at() - cd_at
        n = len(self.records)
        if self.zip64:
            z64 = self._at()
            _write(self.f, b"PK\x06\x06" + struct.pack("<QHHIIQQQQ", 44, 45, 45, 0, 0, n, n, cd_size, cd_at))
            _write(self.f, b"PK\x06\x07" + struct.pack("<IQI", 0, z64, 1))
            _write(self.f, EOCD + struct.pack("<HHHHIIH", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
        else:
            _write(self.f, EOCD + struct.pack("<HHHHIIH", 0, 0, n, n, cd_size, cd_at, 0))


def _write(f, data) -> None:
    write_all(f, memoryview(data).cast("B"))


def write(f, dtype: str, shape: tuple[int, ...], blocks, nbytes: int, zip64: bool | None = None) -> None:
    """Append to ``f`` what ``torch.save`` writes for a C-contiguous tensor of ``dtype`` and ``shape`` whose bytes
    are ``blocks`` (buffers or input ``ByteRange``s, ``nbytes`` in all), which ``torch.load(weights_only=True)``
    reads back: the same records (``data.pkl``, the format version, the storage alignment, the byte order,
    ``data/0``, the version, a serialization id), data aligned to 64 bytes, each record's CRC-32, zip64 where a size
    or offset needs it. The bytes are streamed: never more than a block in memory here."""
    import hashlib

    pkl = data_pkl(dtype, shape)
    z = _Zip(f, nbytes >= 0xFFFF0000 if zip64 is None else zip64)
    z.small("archive/data.pkl", pkl)
    z.small("archive/.format_version", b"1")
    z.small("archive/.storage_alignment", b"64")
    z.small("archive/byteorder", b"little")
    z.stream("archive/data/0", nbytes, blocks)
    z.small("archive/version", b"3\n")
    ident = hashlib.sha1(pkl + z.records[-2][3].to_bytes(4, "little")).hexdigest()[:40]  # of the tensor written
    z.small("archive/.data/serialization_id", ident.encode())
    z.close()


def range_blocks(file, start: int, n: int):
    """Bytes ``start:start+n`` of ``file`` in blocks of at most ``BLOCK`` (one buffer reused)."""
    import os

    buf = bytearray(min(BLOCK, n) or 1)
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as src:
        done = 0
        while done < n:
            k = os.preadv(src.fileno(), [view[: min(BLOCK, n - done)]], start + done)
            if k <= 0:
                raise OSError(f"{file}: ended early at byte {start + done}")
            yield view[:k]
            done += k
