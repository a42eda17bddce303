"""Flax format: ``flax.serialization`` msgpack parameter trees, in the ``hf`` or ``linen`` layout.

Files are those transformers 4.x's ``FlaxPreTrainedModel.save_pretrained`` wrote: ``flax_model.msgpack``, or
beyond ``--max-shard-size`` the shards ``flax_model-00001-of-0000N.msgpack`` (each an unflattened subtree) and
``flax_model.msgpack.index.json`` (``weight_map``: ``model/layers/0/mlp/gate_proj/kernel`` -> shard, sorted
keys). Here every file, headers included, is at most ``--max-shard-size`` bytes (a larger array gets a
file alone). The layouts are described in ``converters.flax.tree``, reading in ``converters.flax.reader``.
Export is a plan (``converters.flax.export``) run by the one executor, ``plan.execute``, with the msgpack
writer (``converters.flax.writer``); config.json gains the keys transformers 4 reads (``converters.flax.config``).
Neither jax nor flax is needed (``converters.flax.msgpack_format``); bytes are moved, never converted, so round
trips are bit-exact.
"""

from __future__ import annotations

from pathlib import Path

from ffn_tools.formats import Format, Option
from ffn_tools.io.dtypes import parse_user_dtype
from ffn_tools.io.store import Checkpoint
from ffn_tools.estimate import priced
from ffn_tools.executor import check_shardable, execute
from ffn_tools.io.run import NO_RUN, Run

from .export import LAYOUTS, build_plan
from .reader import FlaxCheckpoint
from .writer import MsgpackWriter

__all__ = ["FORMAT", "LAYOUTS"]

# A directory holding any of these is a PyTorch checkpoint (even with a flax_model.msgpack beside it).
TORCH_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class Flax(Format):
    name, extra = "flax", "flax"
    options = (Option("flax_layout", "Flax only: hf = the Hugging Face Flax parameter tree (default); linen = FFNs as "
                      "nn.Dense gate/up/down.", choices=LAYOUTS),)
    takes = frozenset({"scheme", "layout", "dry_run"})
    detect_order = 40

    def can_read(self, path: Path) -> bool:
        """A .msgpack file, a .msgpack.index.json, or a directory of .msgpack files without PyTorch weights."""
        path = Path(path)
        if path.is_dir():
            return any(path.glob("*.msgpack")) and not any((path / n).exists() for n in TORCH_FILES)
        return path.name.endswith((".msgpack", ".msgpack.index.json"))

    def read(self, path: Path, absent_shards: bool = False, like: Checkpoint | None = None) -> FlaxCheckpoint:
        """A Flax checkpoint opened lazily: a .msgpack file, an index, or a directory.

        Raises:
            CheckpointError: missing files, not a parameter tree, or kernels whose shapes do not fit.
        """
        return FlaxCheckpoint(Path(path))

    def export(self, ckpt: Checkpoint, out: Path, **options) -> dict:
        return export(ckpt, out, **options)

    def recipe(self, ckpt: Checkpoint, dtype: str | None, quantized: bool) -> dict | None:
        """Its dtype (Flax trees are not quantized here); the hf layout only (linen holds FFNs only)."""
        return {"dtype": dtype} if dtype and getattr(ckpt, "layout", "hf") == "hf" and not quantized else None

    runtimes = ("transformers",)

    def load_runtime(self, name: str):
        from .client import FlaxWeights

        return FlaxWeights()


FORMAT = Flax()


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, flax_layout: str | None = None, scheme=None, layout=None,
           dry_run: bool = False, run: Run = NO_RUN) -> dict:
    """Write ``ckpt`` as a Flax msgpack tree: a directory (``flax_model.msgpack`` or shards + index, plus
    config.json and, for ``hf``, the tokenizer and generation files), or one ``.msgpack`` file.

    Args:
        flax_layout: "hf" (default: the whole model as Hugging Face Flax models named it) or "linen"
            (the FFNs only, one ``nn.Dense`` gate/up/down module tree each).
        scheme, layout: for "linen", the FFN naming scheme and the layout of fused gate_up tensors
            (detected / the scheme's when None), as ``find_ffns`` takes them.
        dry_run: plan only; ``plan`` in the summary lists every leaf (by tree path) and how it is made.

    Returns:
        Summary: output, format, layout, files, tensors, bytes, changes (rendered from the plan).

    Raises:
        FFNToolsError: unknown layout, a name the layout cannot hold, mixed FFN dtypes (linen, without
            ``dtype``), no FFN found (linen), or the output exists.
    """
    tree_layout = flax_layout or "hf"
    out = Path(out)
    plan, writer = build_plan(ckpt, tree_layout, parse_user_dtype(dtype) if dtype else None, scheme, layout,
                              with_config=out.suffix != MsgpackWriter.suffix)
    made = run.but(out=out, force=force, max_shard_size=max_shard_size, carry=tree_layout == "hf",
                   desc=f"converting to flax ({tree_layout})", writer=writer)
    if dry_run:
        check_shardable(out, max_shard_size, writer.suffix)  # what the run would refuse, the plan refuses
        files = []
    else:
        files = execute(plan, made)
    summary = {"output": str(out), "format": "flax", "layout": tree_layout, "files": files,
               "tensors": len(plan.entries), "bytes": plan.total_bytes, "changes": plan.changes}
    return {**summary, "plan": plan.describe(), **priced(plan, made)} if dry_run else summary
