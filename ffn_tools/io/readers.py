"""Reading PyTorch checkpoint files lazily: a .safetensors file, a sharded index, a directory, or a weights-only
pickle (``pytorch_model.bin``, ``*.pth``, ``*.pt``). Safetensors tensors are read with ``pread`` at their offset;
pickles only through ``torch.load(weights_only=True, mmap=True)``. ``open_checkpoint`` is the entry point.
"""

from __future__ import annotations

import json
import pickle
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from .safetensors_format import lfs_pointer, read_header
from .store import PICKLE_SUFFIXES, WEIGHT_INDEXES, Checkpoint, TensorInfo, read_bytes

if TYPE_CHECKING:
    import torch
    from safetensors import safe_open


class SafetensorsCheckpoint(Checkpoint):
    """One or more safetensors files."""

    rewritable = preads = True

    def __init__(self, path: Path, root: Path, files: list[Path]):
        infos: dict[str, TensorInfo] = {}
        metadata: dict[str, str] = {}
        for i, f in enumerate(files):
            entries, meta = read_header(f)
            if i == 0:
                metadata = meta
            for e in entries.values():
                if e.name in infos:
                    raise CheckpointError(f"tensor {e.name!r} appears in both {infos[e.name].file} and {f}; "
                                          "point at one file (or an index) instead of the directory")
                infos[e.name] = TensorInfo(e.name, e.dtype, e.shape, f, e.start)
        super().__init__(path, root, files, infos, metadata)
        self._handles: dict[Path, safe_open] = {}

    def _read(self, info: TensorInfo) -> "torch.Tensor":
        """The tensor read with ``pread`` into memory of its own (so reading a whole checkpoint keeps one
        tensor resident, not every page of a mapping); safetensors' reader where its bytes have no offset."""
        if info.start is not None:
            import torch

            if not info.nbytes:
                return torch.empty(info.shape, dtype=info.dtype)
            try:
                data = read_bytes(info.file, info.start, info.nbytes)
            except OSError as e:
                raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r} ({e})") from None
            return torch.frombuffer(data, dtype=info.dtype).reshape(info.shape)
        from safetensors import SafetensorError, safe_open

        try:
            handle = self._handles.get(info.file)
            if handle is None:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            return handle.get_tensor(info.name)
        except (SafetensorError, OSError) as e:  # changed on disk since its header was read, or unreadable
            raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r} ({' '.join(str(e).split())})") \
                from None

    def close(self) -> None:
        self._handles.clear()


class PickleCheckpoint(Checkpoint):
    """PyTorch pickles, loaded with ``weights_only=True`` (memory-mapped where the file allows).

    In torch.save's zip format each storage is an uncompressed zip member, so a contiguous tensor's bytes
    sit at a known offset of the file (``_zip_starts``): those tensors are read with ``pread`` into memory of
    their own (pages of the mapping are never touched, so reading a whole checkpoint does not leave it all
    resident) and copied byte for byte by writers, as from safetensors.
    """

    kind, described = "pickle", "a pickle"
    rewritable = preads = True

    def __init__(self, path: Path, root: Path, files: list[Path]):
        self._tensors: dict[str, "torch.Tensor"] = {}
        infos: dict[str, TensorInfo] = {}
        for f in files:
            tensors = _load_pickle(f)
            starts = _zip_starts(f, tensors)
            for name, t in tensors.items():
                self._tensors[name] = t
                infos[name] = TensorInfo(name, t.dtype, tuple(t.shape), f, starts.get(name))
        super().__init__(path, root, files, infos)

    def _read(self, info: TensorInfo) -> "torch.Tensor":
        if info.start is None or not info.nbytes:
            return self._tensors[info.name]
        import torch

        try:
            data = read_bytes(info.file, info.start, info.nbytes)
        except OSError as e:
            raise CheckpointError(f"{info.name}: {e}") from None
        return torch.frombuffer(data, dtype=info.dtype).reshape(info.shape)

    def close(self) -> None:
        self._tensors.clear()


def _zip_starts(path: Path, tensors: dict) -> dict[str, int]:
    """Absolute file offsets of the contiguous tensors' bytes in a zip-format pickle, or {} when the file is
    not laid out as expected (legacy format, compressed members, storages not mapped from it)."""
    import zipfile

    try:
        members = {}
        with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
            for zi in zf.infolist():
                if "/data/" not in zi.filename or zi.compress_type != zipfile.ZIP_STORED:
                    continue
                f.seek(zi.header_offset)
                head = f.read(30)
                if head[:4] != b"PK\x03\x04":
                    return {}
                start = zi.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
                members[start] = zi.file_size
    except (zipfile.BadZipFile, OSError):
        return {}
    backed = {n: t for n, t in tensors.items() if t.untyped_storage().nbytes()}
    if not members or not backed or sys.byteorder != "little":
        return {}
    base = min(t.untyped_storage().data_ptr() for t in backed.values()) - min(members)
    out = {}
    for name, t in backed.items():
        storage = t.untyped_storage().data_ptr() - base
        if storage not in members:
            return {}  # storages not where the zip says: no offsets at all
        start = storage + t.storage_offset() * t.element_size()
        if t.is_contiguous() and start + t.numel() * t.element_size() <= storage + members[storage]:
            out[name] = start
    return out


def _load_pickle(path: Path) -> dict[str, "torch.Tensor"]:
    import torch

    if lfs := lfs_pointer(path):  # a text file: torch.load would call it a pickle that could run code
        raise CheckpointError(lfs)
    try:
        with warnings.catch_warnings():  # torch's own UserWarnings about the refusal: our one line says it
            warnings.simplefilter("ignore")
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                obj = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: refused to load: the pickle holds more than tensors and could run code "
            f"(weights_only=True: {first[:160]}); convert it to safetensors in a trusted environment"
        ) from None
    except Exception as e:  # zipfile/EOF errors: not a checkpoint, or truncated
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and set(obj) == {key} and isinstance(obj[key], dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors (found {type(obj).__name__})")
    return obj


def index_shards(index: Path, absent_ok: bool = False) -> tuple[list[Path], dict[str, str]]:
    """The shards an index names, in order, and its weight_map.

    ``absent_ok``: the shards not on disk are left out of the list instead of refused (the caller says which
    are absent, from the weight_map). A shard is named relative to the index's directory and must stay inside it: an absolute name or one
    that climbs out (``../other/x.safetensors``) is refused before anything is opened. A name inside that is
    a symbolic link (a Hugging Face cache snapshot's shards point into ``../../blobs/``) is followed.

    Raises:
        CheckpointError: not an index, a shard name outside the directory, or a missing shard.
    """
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid index (needs a 'weight_map' object: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: not a valid index ('weight_map' must map tensor names to shard file names)")
    for tensor, name in weight_map.items():
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts or "\\" in name:
            raise CheckpointError(f"{index}: weight_map entry {tensor!r} -> {name!r} points outside the index's "
                                  "directory; shards must be named relative to it, inside it")
    files = [index.parent / n for n in dict.fromkeys(weight_map.values())]
    missing = [str(f.relative_to(index.parent)) for f in files if not f.is_file()]
    if missing and absent_ok:
        return [f for f in files if f.is_file()], weight_map
    if missing:
        raise CheckpointError(f"{index}: names shard(s) that do not exist: {', '.join(sorted(missing))}")
    return files, weight_map


def _check_index(index: Path, infos: dict[str, TensorInfo], weight_map: dict[str, str],
                 absent: Mapping[str, object] = MappingProxyType({})) -> None:
    """The weight_map and the shards' own headers must agree, tensor by tensor (all problems at once); the
    tensors mapped to ``absent`` shards are not on disk to check.

    Raises:
        CheckpointError: a mapped tensor its shard lacks, or a shard tensor the map puts elsewhere or omits.
    """
    problems = []
    for tensor, name in sorted(weight_map.items()):
        info = infos.get(tensor)
        if name in absent:
            continue
        if info is None:
            problems.append(f"{tensor!r} is mapped to {name}, which lacks it")
        elif info.file != index.parent / name:
            problems.append(f"{tensor!r} is mapped to {name} but lies in {info.file.name}")
    extra = sorted(set(infos) - set(weight_map))
    if extra:
        problems.append(f"{len(extra)} tensor(s) in the shards are missing from the weight_map "
                        f"({', '.join(map(repr, extra[:4]))}{', ...' if len(extra) > 4 else ''})")
    if problems:
        raise CheckpointError(f"{index}: the index and its shards disagree: " + "; ".join(problems[:8])
                              + (f"; ... ({len(problems) - 8} more)" if len(problems) > 8 else ""))


def open_checkpoint(path: str | Path, absent_shards: bool = False) -> Checkpoint:
    """Open a PyTorch checkpoint lazily: a .safetensors file, an index, a pickle, or a directory.

    Args:
        path: the checkpoint.
        absent_shards: an index may name shards that are not on disk: the checkpoint holds the tensors of
            those that are, and ``absent`` says which are not (``verify --layers`` on part of a model's
            shards). By default a missing shard is refused: a user who lost one must hear it.

    Raises:
        CheckpointError: the path is missing or holds no checkpoint, or a file is unreadable or unsafe.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir():
        root = path
        for name in WEIGHT_INDEXES[:2]:
            if (path / name).is_file():
                return _open_index(path, root, path / name, absent_shards)
        for main, pattern in (("model.safetensors", "*.safetensors"), ("pytorch_model.bin", "pytorch_model*.bin"),
                              (None, "*.pth"), (None, "*.pt"), (None, "*.bin")):
            if main and (path / main).is_file():  # beside it may lie outputs like model.split.safetensors
                return _open_files(path, root, [path / main])
            files = sorted(path.glob(pattern))
            if files:
                return _open_files(path, root, files)
        raise CheckpointError(
            f"{path}: no checkpoint here (looked for *.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin, *.pth, *.pt)"
        )
    root = path.parent
    if path.name.endswith(".index.json"):
        return _open_index(path, root, path, absent_shards)
    if path.suffix in (".safetensors", *PICKLE_SUFFIXES):
        return _open_files(path, root, [path])
    raise CheckpointError(f"{path}: not a checkpoint (expected .safetensors, .index.json, .bin, .pth, .pt or "
                          ".gguf)")


def _open_index(path: Path, root: Path, index: Path, absent_shards: bool = False) -> Checkpoint:
    files, weight_map = index_shards(index, absent_ok=absent_shards)
    ckpt = _open_files(path, root, files, index)
    absent: dict[str, list[str]] = {}
    for tensor, name in weight_map.items():
        if index.parent / name not in files:
            absent.setdefault(name, []).append(tensor)
    if absent:
        ckpt.absent = MappingProxyType({k: tuple(v) for k, v in sorted(absent.items())})
    try:
        _check_index(index, ckpt._infos, weight_map, ckpt.absent)
    except CheckpointError:
        ckpt.close()
        raise
    return ckpt


def _open_files(path: Path, root: Path, files: list[Path], index: Path | None = None) -> Checkpoint:
    # no file at all (every shard of an index absent): the reader the index's name says
    if all(f.suffix == ".safetensors" for f in files) and (files or index is None or "safetensors" in index.name):
        return SafetensorsCheckpoint(path, root, files)
    if all(f.suffix in PICKLE_SUFFIXES for f in files):
        return PickleCheckpoint(path, root, files)
    raise CheckpointError(f"{path}: mixes safetensors and pickle files; point at one of them")


Checkpoint.opener = staticmethod(open_checkpoint)  # how a checkpoint no format opened is opened again (``reopen``)
