"""Reading Flax checkpoints: a msgpack file, a sharded index, or a directory, as a lazy ``Checkpoint``.

The tree's layout (``hf`` or ``linen``, see ``converters.flax.tree``) is recognised from its paths and
presented with PyTorch names and (out, in) weights; kernels are transposed back when read (a pure move).
Shapes are checked when opening, so a kernel stored (out, in) is reported before anything is written.
config.json reads as the config the export was made from: the transformers-4 keys export added are removed
(``converters.flax.config``).
"""

from __future__ import annotations

import builtins
import io
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ffn_tools.detect import choose_scheme, find_ffns
from ffn_tools.errors import CheckpointError, SchemeError
from ffn_tools.io.store import Checkpoint, TensorInfo, read_config
from ffn_tools.io.readers import index_shards

from . import tree as tree
from .config import restore_source_config
from .msgpack_format import DTYPES, Leaf, read_leaf, read_tree

if TYPE_CHECKING:
    import torch

WEIGHTS_NAME = "flax_model.msgpack"
INDEX_NAME = "flax_model.msgpack.index.json"


def _resolve(path: Path) -> tuple[Path, list[Path], dict[str, str] | None]:
    """(root, weight files, index weight_map or None) of a Flax checkpoint path."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            return path, *index_shards(path / INDEX_NAME)
        if (path / WEIGHTS_NAME).is_file():
            return path, [path / WEIGHTS_NAME], None
        found = sorted(path.glob("*.msgpack"))
        if len(found) != 1:
            raise CheckpointError(f"{path}: {'no' if not found else 'several'} .msgpack files and no {INDEX_NAME}; "
                                  "point at one .msgpack file or an index")
        return path, found, None
    if path.name.endswith(".index.json"):
        return path.parent, *index_shards(path)
    return path.parent, [path], None


class FlaxCheckpoint(Checkpoint):
    """A Flax tree presented with PyTorch names and (out, in) weights (see ``converters.flax.tree``).

    Attributes:
        layout: "hf" or "linen".
    """

    kind, described = "flax", "a Flax"

    def __init__(self, path: Path):
        root, files, weight_map = _resolve(path)
        leaves: dict[tuple[str, ...], Leaf] = {}
        for f in files:
            for leaf in read_tree(f):
                if leaf.path in leaves:
                    raise CheckpointError(f"{'/'.join(leaf.path)} appears in both {leaves[leaf.path].file} and {f}")
                leaves[leaf.path] = leaf
        if weight_map is not None:
            _check_index(path, weight_map, leaves)
        config = restore_source_config(read_config(root), str(root / "config.json"))  # without the v4 keys export added
        if config and isinstance(config.get("architectures"), list):  # transformers 4.x wrote FlaxLlamaForCausalLM
            config["architectures"] = [a.removeprefix("Flax") if isinstance(a, str) else a for a in config["architectures"]]
        self._leaves: dict[str, tuple[Leaf, bool]] = {}
        linen = tree.linen_ffns(list(leaves))
        self.layout = "hf" if linen is None else "linen"
        if linen is None:
            for p, leaf in leaves.items():
                self._add(*tree.hf_name(p, len(leaf.shape), leaf.file), leaf)
        else:
            shapes = {p: (leaf.dtype, leaf.shape) for p, leaf in leaves.items()}
            problems = [msg for ffn in linen.values() for msg in tree.check_linen(ffn, shapes)]
            if problems:
                raise CheckpointError(f"{path}: not a linen FFN tree: " + "; ".join(sorted(problems)))
            for p, leaf in leaves.items():
                ffn = linen[p[: len(p) - 2]]
                self._add(f"{ffn.canonical}.{p[-2]}.{'weight' if p[-1] == 'kernel' else 'bias'}", p[-1] == "kernel", leaf)
        infos = {}
        for name, (leaf, transpose) in self._leaves.items():
            start = leaf.pieces[0][0] if len(leaf.pieces) == 1 and not transpose else None
            infos[name] = TensorInfo(name, DTYPES[leaf.dtype], leaf.shape[::-1] if transpose else leaf.shape, leaf.file, start)
        super().__init__(path, root, files, infos, {}, config)
        self._handles: dict[Path, io.BufferedReader] = {}
        if linen is None:
            self._check_ffns()

    def _add(self, name: str, transpose: bool, leaf: Leaf) -> None:
        if name in self._leaves:
            other = "/".join(self._leaves[name][0].path)
            raise CheckpointError(f"{leaf.file}: {'/'.join(leaf.path)} and {other} both read as {name}; keep one")
        self._leaves[name] = (leaf, transpose)

    def _check_ffns(self) -> None:
        """Shapes of FFN kernels must fit together (a kernel stored (out, in) is caught here)."""
        try:
            scheme = choose_scheme(list(self), self.config)
        except SchemeError:
            return  # no FFN naming recognised: nothing to check (inspect will say so)
        try:
            find_ffns(self, scheme)
        except SchemeError as e:
            msg = str(e)
            for name, (leaf, transposed) in self._leaves.items():  # name the Flax leaves too
                if transposed:
                    msg = re.sub(rf"(?<![\w.]){re.escape(name)}(?![\w.])", f"{name} (= {'/'.join(leaf.path)}.T)", msg)
            hint = (". Shapes are PyTorch (out, in) = kernel.T: every Flax kernel must be stored (in, out); "
                    "re-export the tree with W.T kernels") if "shape" in msg else ""
            raise CheckpointError(msg + hint) from None

    def _read(self, info: TensorInfo) -> torch.Tensor:
        leaf, transpose = self._leaves[info.name]
        handle = self._handles.get(leaf.file)
        if handle is None:
            handle = self._handles[leaf.file] = builtins.open(leaf.file, "rb")  # noqa: SIM115 - closed in close()
        t = read_leaf(handle, leaf)
        return t.T.contiguous() if transpose else t  # (in, out) -> (out, in): a pure move

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()


def _check_index(path: Path, weight_map: dict[str, str], leaves: dict[tuple[str, ...], Leaf]) -> None:
    found = {"/".join(p): leaf.file.name for p, leaf in leaves.items()}
    problems = [f"{k}: listed in {v} but not there" for k, v in weight_map.items() if k not in found]
    problems += [f"{k}: in {v}, the index says {weight_map[k]}" for k, v in found.items() if k in weight_map and weight_map[k] != v]
    problems += [f"{k}: in {v} but not in the index" for k, v in found.items() if k not in weight_map]
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise CheckpointError(f"{path}: index and shards disagree: {'; '.join(sorted(problems)[:8])}{more}; "
                              "re-export the checkpoint")
