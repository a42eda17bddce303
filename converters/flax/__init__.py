"""Flax format: ``flax.serialization`` msgpack parameter trees, in the ``hf`` or ``linen`` layout.

Files are those transformers 4.x's ``FlaxPreTrainedModel.save_pretrained`` wrote: ``flax_model.msgpack``, or
beyond ``--max-shard-size`` the shards ``flax_model-00001-of-0000N.msgpack`` (each an unflattened subtree)
and ``flax_model.msgpack.index.json`` (``weight_map``: ``model/layers/0/mlp/gate_proj/kernel`` -> shard, sorted
keys). Here every file, headers included, is at most ``--max-shard-size`` bytes (a larger array gets a
file alone). The layouts are described in ``converters.flax.tree``, reading in ``converters.flax.reader``.
Neither jax nor flax is needed (``converters.flax.msgpack_format``, ``converters.flax.writer``); bytes are moved,
never converted, so round trips are bit-exact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ffn_tools.detect import find_ffns
from ffn_tools.io.dtypes import as_st, parse_user_dtype, short_name
from ffn_tools.errors import FFNToolsError
from ffn_tools.ffn import canonical_weights
from ffn_tools.io.output import atomic_output
from ffn_tools.plan import side_files
from ffn_tools.progress import Progress
from ffn_tools.io.store import Checkpoint

from . import tree
from .reader import INDEX_NAME, WEIGHTS_NAME, FlaxCheckpoint
from .writer import OutLeaf, nest, shard_cost, write_tree
from ..pytorch import unquantized_config

if TYPE_CHECKING:
    import torch

FORMAT = "flax"
OPTIONS: frozenset[str] = frozenset({"flax_layout", "scheme", "layout"})
LAYOUTS = ("hf", "linen")
# A directory holding any of these is a PyTorch checkpoint (even with a flax_model.msgpack beside it).
TORCH_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def can_read(path: Path) -> bool:
    """A .msgpack file, a .msgpack.index.json, or a directory of .msgpack files without PyTorch weights."""
    path = Path(path)
    if path.is_dir():
        return any(path.glob("*.msgpack")) and not any((path / n).exists() for n in TORCH_FILES)
    return path.name.endswith((".msgpack", ".msgpack.index.json"))


def open(path: Path) -> FlaxCheckpoint:  # noqa: A001 - the converter surface's name
    """Open a Flax checkpoint lazily: a .msgpack file, an index, or a directory.

    Raises:
        CheckpointError: missing files, not a parameter tree, or kernels whose shapes do not fit.
    """
    return FlaxCheckpoint(Path(path))


FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.dtype.is_floating_point else t


def _out_dtype(ckpt: Checkpoint, name: str, dtype: torch.dtype | None) -> str:
    """The safetensors dtype string a tensor is written in (floating ones cast to ``dtype``)."""
    d = ckpt.info(name).st_dtype
    return as_st(dtype) if dtype is not None and d in FLOATING else d


def _hf_leaves(ckpt: Checkpoint, dtype: torch.dtype | None) -> list[OutLeaf]:
    out = []
    for name in ckpt:
        info = ckpt.info(name)
        path, transpose = tree.hf_path(name, len(info.shape))

        def produce(name=name, transpose=transpose):
            t = _cast(ckpt[name], dtype)
            return t.T.contiguous() if transpose else t  # kernel = W.T: a pure move

        out.append(OutLeaf(path, _out_dtype(ckpt, name, dtype), info.shape[::-1] if transpose else info.shape, produce))
    return out


class _FFNReader:
    """Canonical weights of one FFN at a time; keeps the input tensors the current FFN shares with the next
    (a stacked expert tensor is read once for all its experts)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, self.ref, self.tensors, self.weights = ckpt, None, {}, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            self.tensors[name] = self.ckpt[name]
        return self.tensors[name]

    def get(self, ffn) -> dict[str, torch.Tensor]:
        if self.ref != ffn.ref:
            keep = set(ffn.names.values())
            self.tensors = {n: t for n, t in self.tensors.items() if n in keep}
            self.weights, self.ref = canonical_weights(self, ffn), ffn.ref
        return self.weights


def _linen_leaves(ckpt: Checkpoint, dtype: torch.dtype | None, scheme=None,
                  layout=None) -> tuple[list[OutLeaf], dict]:
    ffns = find_ffns(ckpt, scheme, layout)
    mixed = []
    for f in ffns.ffns:
        kinds = {n: ckpt.info(n).st_dtype for n in f.names.values()}
        if len(set(kinds.values())) > 1 and dtype is None:
            mixed.append(f"{f.ref}: " + ", ".join(f"{n} {short_name(d)}" for n, d in sorted(kinds.items())))
    if mixed:
        raise FFNToolsError(f"{ckpt.path}: the linen layout writes each FFN in one dtype but "
                            f"{'; '.join(mixed)}; pass --dtype to choose one")
    reader, out = _FFNReader(ckpt), []
    for f in ffns.ffns:
        prefix = tree.linen_subtree(f.ref.layer, f.ref.kind, f.ref.expert)
        src_dtype = _out_dtype(ckpt, f.names["down"], dtype)
        h, i = f.d_model, f.d_ffn
        has = {r: f"{r}_bias" in f.names or (r != "down" and "gate_up_bias" in f.names) for r in tree.ROLES}
        for role in tree.ROLES:
            kernel = (i, h) if role == "down" else (h, i)
            leaves = [("kernel", kernel)] + ([("bias", (kernel[1],))] if has[role] else [])
            for leaf, shape in leaves:
                key = role if leaf == "kernel" else f"{role}_bias"

                def produce(f=f, key=key):
                    t = _cast(reader.get(f)[key], dtype)
                    return t.T.contiguous() if t.ndim == 2 else t.contiguous()  # kernel = W.T (in, out)

                out.append(OutLeaf((*prefix, role, leaf), src_dtype, shape, produce))
    chosen = ffns.ffns
    manifest = {
        "flax_layout": "linen", "source": str(ckpt.path), "scheme": ffns.scheme.name,
        "naming": "params/layers_{L}[_experts_{E}|_shared_expert]/{gate,up,down}/{kernel,bias}, kernels (in, out)",
        "activation": ffns.activation.config_name, "gated_unit": ffns.activation.unit,
        "dtype": "/".join(sorted({short_name(leaf.dtype) for leaf in out})), "d_model": chosen[0].d_model, "d_ffn": sorted({f.d_ffn for f in chosen}),
        "layers": sorted({f.ref.layer for f in chosen}),
        "experts": sorted({f.ref.expert for f in chosen if f.ref.kind == "expert"}),
        "shared_expert": any(f.ref.kind == "shared" for f in chosen), "ffns": len(chosen), "tensors": len(out),
    }
    config = {"ffn_tools_manifest": manifest}
    if not ffns.activation.assumed:
        config["hidden_act"] = ffns.activation.config_name
    return out, config


def _shards(leaves: list[OutLeaf], max_shard_size: int | None) -> list[list[OutLeaf]]:
    if not max_shard_size:
        return [leaves]
    shards, cur, size = [], [], 5  # 5: the root map header, at most
    for leaf in leaves:
        cost = shard_cost(leaf)
        if cur and size + cost > max_shard_size:
            shards.append(cur)
            cur, size = [], 5
        cur.append(leaf)
        size += cost
    return [*shards, cur]


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, flax_layout: str | None = None, scheme=None, layout=None) -> dict:
    """Write ``ckpt`` as a Flax msgpack tree: a directory (``flax_model.msgpack`` or shards + index, plus
    config.json and, for ``hf``, the tokenizer and generation files), or one ``.msgpack`` file.

    Args:
        flax_layout: "hf" (default: the whole model as Hugging Face Flax models named it) or "linen"
            (the FFNs only, one ``nn.Dense`` gate/up/down module tree each).
        scheme, layout: for "linen", the FFN naming scheme and the layout of fused gate_up tensors
            (detected / the scheme's when None), as ``find_ffns`` takes them.

    Returns:
        Summary: output, format, layout, files, tensors, bytes, changes.

    Raises:
        FFNToolsError: unknown layout, a name the layout cannot hold, mixed FFN dtypes (linen, without
            ``dtype``), no FFN found (linen), or the output exists.
    """
    tree_layout = flax_layout or "hf"
    if tree_layout not in LAYOUTS:
        raise FFNToolsError(f"unknown Flax layout {tree_layout!r}; use one of {', '.join(LAYOUTS)}")
    out = Path(out)
    target = parse_user_dtype(dtype) if dtype else None
    changes = []
    if tree_layout == "hf":
        leaves = _hf_leaves(ckpt, target)
        changes.append("layout hf: 2-D weights stored as kernel = W.T (in, out), embeddings as embedding")
        config, more = unquantized_config(ckpt.config, target)
        changes += more
    else:
        leaves, config = _linen_leaves(ckpt, target, scheme, layout)
        changes.append(f"layout linen: {config['ffn_tools_manifest']['ffns']} FFNs as "
                       "params/layers_{L}[_experts_{E}|_shared_expert]/{gate,up,down}; other tensors not written")
    if target is not None:
        changes.append(f"floating tensors cast to {short_name(target)}")
    nest(leaves)  # every path is an array or a subtree, never both: checked before anything is written
    single = out.suffix == ".msgpack"
    if single and max_shard_size:
        raise FFNToolsError(f"{out}: --max-shard-size needs a directory output, not a .msgpack file")
    shards = _shards(leaves, max_shard_size)
    files = [WEIGHTS_NAME] if len(shards) == 1 else [
        WEIGHTS_NAME.replace(".msgpack", f"-{k:05d}-of-{len(shards):05d}.msgpack") for k in range(1, len(shards) + 1)]
    total = sum(leaf.nbytes for leaf in leaves)
    progress = Progress(total, f"converting to flax ({tree_layout})")
    try:
        with atomic_output(out, inputs=[ckpt.path, *ckpt.files], force=force) as tmp:
            if single:
                write_tree(tmp, leaves, progress.update)
                files = [out.name]
            else:
                tmp.mkdir()
                for name, shard in zip(files, shards):
                    write_tree(tmp / name, shard, progress.update)
                if len(shards) > 1:
                    weight_map = {"/".join(leaf.path): name for name, shard in zip(files, shards) for leaf in shard}
                    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
                for p in side_files(ckpt) if tree_layout == "hf" else []:
                    if p.name != "config.json":
                        shutil.copy2(p, tmp / p.name)
                if config is not None:
                    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    finally:
        progress.close()
    return {"output": str(out), "format": FORMAT, "layout": tree_layout, "files": files, "tensors": len(leaves),
            "bytes": total, "changes": changes}
