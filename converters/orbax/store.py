"""An Orbax checkpoint's arrays through tensorstore: opened one at a time without restoring the tree, written one
slab at a time.

What ``orbax.checkpoint``'s ``StandardCheckpointer`` / ``PyTreeCheckpointer`` write (OCDBT on, their default): the
item directory holds ``_METADATA`` (JSON: each leaf's key path, no shapes), ``manifest.ocdbt`` and ``d/`` (a
key-value database, per process ``ocdbt.process_N/`` merged into the root), where each leaf is a zarr array (v2, or
v3 where ``_METADATA`` says ``use_zarr3``: MaxText) named by its key path joined with ``.``. Without OCDBT each leaf
is a directory of its own. A CheckpointManager's step directory holds the item under ``items/`` (MaxText: ``0/items``),
Orbax v1's under ``state/``.

``OrbaxTree`` reads: names and key paths from ``_METADATA``, shape and dtype from each array's zarr metadata (no
data), an array or a slice of it when asked (bfloat16 comes back as ``ml_dtypes.bfloat16``, bit for bit).
``OrbaxWriter`` writes what both checkpointers restore: arrays created with the chunking the caller gives (one layer
of a scanned array a chunk, so each layer is written, and later read, alone), uncompressed, ``_METADATA`` and
``_CHECKPOINT_METADATA`` last. OCDBT names its data files at random, so two writes of one model hold the same keys
and values in files of other names.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ffn_tools.errors import CheckpointError

METADATA, CHECKPOINT_METADATA = "_METADATA", "_CHECKPOINT_METADATA"
# The files of an item (or step) directory that are orbax.checkpoint's own, beside its arrays
OWNED = (METADATA, CHECKPOINT_METADATA, "_ROOT_METADATA", "_sharding", "_strings.json", "manifest.ocdbt",
         "commit_success.txt", "_CHECKPOINT_DELETION")
ITEM_DIRS = ("", "items", "state", "default", "pytree")  # where a step directory keeps its item
HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"


def item_dir(path: Path) -> tuple[Path, str | None]:
    """The directory holding ``_METADATA`` for ``path`` (an item, a step directory, or a CheckpointManager root, whose
    latest step is taken: said in the second value), and None or that sentence."""
    path = Path(path)
    if path.name == METADATA:
        return path.parent, None
    for sub in ITEM_DIRS:
        if (path / sub / METADATA).is_file():
            return path / sub, None
    steps = sorted((int(p.name), p) for p in path.iterdir() if p.is_dir() and re.fullmatch(r"\d+", p.name)) \
        if path.is_dir() else []
    for _, step in reversed(steps):
        for sub in ITEM_DIRS:
            if (step / sub / METADATA).is_file():
                return step / sub, f"{path}: steps {', '.join(p.name for _, p in steps)}; read step {step.name}"
    raise CheckpointError(f"{path}: no {METADATA} here (nor in items/, state/ or a step directory); an Orbax "
                          "checkpoint's item directory holds one")


def is_orbax(path: Path) -> bool:
    """Cheap: ``path`` or one of its item / step directories holds ``_METADATA`` next to Orbax's files."""
    try:
        root, _ = item_dir(path)
    except (CheckpointError, OSError):
        return False
    return (root / "manifest.ocdbt").is_file() or any(root.glob("*/.zarray")) or any(root.glob("*/zarr.json"))


class OrbaxTree:
    """The arrays of one item directory (see the module docstring).

    Attributes:
        root: the item directory.
        paths: every array leaf's key path, in ``_METADATA``'s order (empty containers and skipped leaves out).
        scalars: leaves that are not arrays (the step, strings): key paths only.
        zarr3, ocdbt: how its arrays are stored.
    """

    def __init__(self, root: Path):
        import tensorstore as ts

        self.root = root
        try:
            meta = json.loads((root / METADATA).read_text())
            tree = meta["tree_metadata"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{root / METADATA}: not an Orbax tree metadata ({e})") from None
        self.zarr3 = bool(meta.get("use_zarr3", False))
        self.ocdbt = bool(meta.get("use_ocdbt", (root / "manifest.ocdbt").is_file()))
        self.paths: list[tuple[str, ...]] = []
        self.scalars: list[tuple[str, ...]] = []
        for entry in tree.values():
            keys = tuple(str(k["key"]) for k in entry.get("key_metadata", ()))
            value = entry.get("value_metadata") or {}
            if value.get("skip_deserialize"):
                continue
            (self.paths if value.get("value_type") in ("np.ndarray", "jax.Array") else self.scalars).append(keys)
        self._ts = ts
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        self._open: dict[tuple[str, ...], Any] = {}

    def _spec(self, keys: tuple[str, ...]) -> dict:
        name = ".".join(keys)
        kv = ({"driver": "ocdbt", "base": f"file://{self.root.resolve()}/", "path": name} if self.ocdbt
              else {"driver": "file", "path": f"{(self.root / name).resolve()}/"})
        return {"driver": "zarr3" if self.zarr3 else "zarr", "kvstore": kv,
                "recheck_cached_data": False, "recheck_cached_metadata": False}

    def array(self, keys: tuple[str, ...]):
        """The tensorstore of leaf ``keys`` (its metadata read, none of its data).

        Raises:
            CheckpointError: the leaf's array is not in the database.
        """
        if keys not in self._open:
            try:
                self._open[keys] = self._ts.open(self._spec(keys), read=True, open=True, context=self._context).result()
            except Exception as e:  # noqa: BLE001 - tensorstore's errors name the missing key
                raise CheckpointError(f"{self.root}: {'.'.join(keys)} cannot be opened ({e})") from None
        return self._open[keys]

    def shape_dtype(self, keys: tuple[str, ...]) -> tuple[tuple[int, ...], str]:
        """(shape, numpy dtype name: "bfloat16", "float32") of leaf ``keys``."""
        t = self.array(keys)
        return tuple(int(d) for d in t.shape), t.dtype.numpy_dtype.name

    def chunk(self, keys: tuple[str, ...]) -> tuple[int, ...]:
        """The shape of one stored chunk of leaf ``keys`` (what a slice of it decodes)."""
        return tuple(int(d) for d in self.array(keys).chunk_layout.read_chunk.shape)

    def read(self, keys: tuple[str, ...], index: Any = ...):
        """Leaf ``keys`` (or ``index`` of it) as a numpy array."""
        return self.array(keys)[index].read().result()


def _zarr2_dtype(dtype) -> str:
    import ml_dtypes
    import numpy as np

    dt = np.dtype(dtype)
    return "bfloat16" if dt == ml_dtypes.bfloat16 else dt.str


class OrbaxWriter:
    """Writes arrays into a new item directory ``root`` (see the module docstring); ``finish`` makes it a checkpoint."""

    def __init__(self, root: Path):
        import tensorstore as ts

        self.root = root
        self._ts = ts
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        self._kv = {"driver": "ocdbt", "base": f"file://{root.resolve()}/",
                    "config": {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100000000,
                               "manifest_kind": "single"},
                    "target_data_file_size": 2**31}
        self.paths: list[tuple[str, ...]] = []

    def create(self, keys: tuple[str, ...], shape: Sequence[int], dtype, chunks: Sequence[int] | None = None):
        """A new array leaf ``keys``; returns the tensorstore to write (whole, or slab by slab along its chunks)."""
        metadata = {"shape": list(shape), "chunks": list(chunks or shape), "dtype": _zarr2_dtype(dtype),
                    "compressor": None, "fill_value": None, "order": "C", "filters": None,
                    "dimension_separator": "."}
        spec = {"driver": "zarr", "kvstore": {**self._kv, "path": ".".join(keys)}, "metadata": metadata,
                "create": True}
        t = self._ts.open(spec, context=self._context).result()
        self.paths.append(tuple(keys))
        return t

    def finish(self) -> list[str]:
        """``_METADATA`` and ``_CHECKPOINT_METADATA``; returns the files of the item directory."""
        tree = {str(tuple(k)): {"key_metadata": [{"key": s, "key_type": 2} for s in k],
                                "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}
                for k in self.paths}
        (self.root / METADATA).write_text(json.dumps({"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": False,
                                                      "store_array_data_equal_to_fill_value": True,
                                                      "custom_metadata": None}))
        now = time.time_ns()
        (self.root / CHECKPOINT_METADATA).write_text(json.dumps(
            {"item_handlers": HANDLER, "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": now,
             "commit_timestamp_nsecs": now, "custom_metadata": {}}))
        return sorted(p.name for p in self.root.iterdir())
