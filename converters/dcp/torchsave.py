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
    """name -> (data offset from ``start``, size) of each stored record of the zip at ``start`` (``length`` bytes)
    of ``f``, from its central directory (torch.save streams its records, so local headers may not hold sizes);
    None where it is not such a zip."""
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
        head = _pread(f, start + local, 30)
        if head[:4] != LOCAL or method != 0 or csize != usize:
            return None
        lnlen, lxlen = struct.unpack("<HH", head[26:30])
        out[name] = (local + 30 + lnlen + lxlen, csize)
    return out


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
    at, size = found["data.pkl"]
    try:
        call = _Args(io.BytesIO(_pread(f, start + at, size))).load()
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
    data_at, data_size = found["data/0"]
    if data_size != numel * itemsize or data_at + data_size > length:
        return None
    return Stored(start + data_at, data_size)


def _pread(f, start: int, n: int) -> bytes:
    import os

    return os.pread(f.fileno(), n, start)
