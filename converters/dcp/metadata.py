"""A DCP directory's ``.metadata``: read without arbitrary unpickling, written as torch's ``FileSystemWriter`` does.

``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``: per key, a
``TensorStorageMetadata`` (dtype, global size, the chunks ranks saved: offsets and sizes) or a
``BytesStorageMetadata`` (a pickled object: the step, the data loader's state); and ``storage_data``, where each
chunk lies (``MetadataIndex(fqn, offsets)`` -> ``_StorageInfo(file, offset, length)``, the chunk being a
``torch.save`` of that piece of the tensor). torch reads it with ``pickle.load``; here an unpickler that
knows only what a DCP metadata holds (``ALLOWED``) reads it, building records of fields rather than torch's classes
(so reading imports neither torch.distributed.checkpoint nor anything a pickle names), and anything else is
refused: a crafted ``.metadata`` cannot run code (as weights load with ``weights_only=True``).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path

from ffn_tools.errors import CheckpointError

METADATA = ".metadata"
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint's CURRENT_DCP_VERSION when this was written (torch 2.13)

_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "complex64", "complex128", "uint16", "uint32", "uint64")
# What a DCP .metadata pickles, and what each is read as: the classes of torch.distributed.checkpoint as records
# (``_Record``: their fields, without importing that package), torch's dtypes as their names, Size as a tuple.
RECORDS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"StreamTransformExtension"},
}
ALLOWED = {**RECORDS, "torch.serialization": {"_get_layout"}, "torch": {"Size", "strided", *_DTYPES},
           "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
           "collections": {"OrderedDict"}}


class _Record:
    """A pickled torch.distributed.checkpoint object read as its fields (``TensorProperties`` pickles a tuple whose
    first item is the dtype)."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and state:
            self.dtype = state[0]


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name not in ALLOWED.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name} is not something a DCP .metadata holds")
        if module in RECORDS:
            return type(name, (_Record,), {})
        if module == "torch":
            return tuple if name == "Size" else name  # a dtype by its name ("bfloat16")
        if module == "torch.serialization":
            return str  # _get_layout("torch.strided"): the layout's name
        return super().find_class(module, name)


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a tensor: where it sits in the whole (``offsets``, ``sizes``) and in the files."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: Path
    start: int
    length: int


@dataclass(frozen=True)
class Entry:
    """One key of the checkpoint: a tensor (``dtype`` a torch dtype name, ``shape``, ``chunks``) or an object."""

    key: str
    dtype: str | None  # None: a pickled object (BytesStorageMetadata)
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


def read_metadata(root: Path) -> dict[str, Entry]:
    """The keys of the DCP checkpoint in directory ``root``, in the order the metadata lists them.

    Raises:
        CheckpointError: no ``.metadata``, one that is not a DCP metadata, or one naming data files not there.
    """
    path = root / METADATA
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e})") from None
    try:
        md = _Unpickler(io.BytesIO(raw)).load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure means: not a DCP metadata we can trust
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint metadata ({e})") from None
    state, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint metadata (no state_dict_metadata)")
    where = {(idx.fqn, tuple(o) if (o := getattr(idx, "offset", None)) is not None else None): info
             for idx, info in storage.items()}
    out: dict[str, Entry] = {}
    missing: set[str] = set()
    for key, meta in state.items():
        if not hasattr(meta, "chunks"):  # BytesStorageMetadata: a pickled object, not read here
            out[key] = Entry(key, None, (), ())
            continue
        chunks = []
        for c in meta.chunks:
            info = where.get((key, tuple(c.offsets)))
            if info is None:
                raise CheckpointError(f"{path}: {key} has a chunk at {list(c.offsets)} that storage_data does not "
                                      "place; the checkpoint is incomplete")
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{path}: {key} is stored through DCP extensions {info.transform_descriptors} "
                                      "(compressed or encrypted chunks), which ffn-tools does not read")
            file = root / info.relative_path
            if not file.is_file():
                missing.add(info.relative_path)
            chunks.append(Chunk(tuple(c.offsets), tuple(c.sizes), file, int(info.offset), int(info.length)))
        dtype = str(meta.properties.dtype).removeprefix("torch.")
        out[key] = Entry(key, dtype, tuple(meta.size), tuple(chunks))
    if missing:
        raise CheckpointError(f"{root}: data files the metadata names are not there: {', '.join(sorted(missing))}")
    return out


def write_metadata(root: Path, tensors: list[tuple[str, str, tuple[int, ...], list[Chunk]]]) -> None:
    """Write ``root/.metadata`` for ``tensors`` (key, torch dtype name, shape, chunks as written), as torch's
    ``FileSystemWriter.finish`` does for a flat state dict, without the save's random id (the same checkpoint
    gives the same bytes)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    state: dict = {}
    storage, planner = {}, {}
    for key, dtype, shape, chunks in tensors:
        state[key] = TensorStorageMetadata(
            TensorProperties(dtype=getattr(torch, dtype)), torch.Size(shape),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in chunks])
        planner[key] = (key,)
        for k, c in enumerate(chunks):
            storage[MetadataIndex(key, torch.Size(c.offsets), k)] = _StorageInfo(c.file.name, c.start, c.length)
    md = Metadata(state, planner_data=planner, storage_data=storage, storage_meta=StorageMeta(), version=DCP_VERSION)
    with open(root / METADATA, "wb") as f:
        pickle.dump(md, f)
