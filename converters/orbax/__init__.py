"""Orbax format: the checkpoints ``orbax.checkpoint`` saves (Flax / JAX training, MaxText), read and written one array
at a time through tensorstore, never restoring or saving the whole tree (``store``).

Three layouts: ``hf``, the Hugging Face Flax tree as a Flax model's params save; ``maxtext``, MaxText's scanned
decoder (``maxtext``: layers stacked on axis 1, its query scaling and rotary order); ``nnx``, the FFNs only, each the
state of a Flax NNX module of three ``nnx.Linear`` (gate, up, down: ``flax.nnx``'s ``nnx.state``, as the Flax
format's linen layout holds them as ``nn.Dense``). ``reader`` presents either with Hugging
Face PyTorch names, ``export`` writes either from any checkpoint. Needs tensorstore and ml_dtypes (the ``flax``
extra's orbax-checkpoint brings them). Round trips are bit-exact.
"""

from __future__ import annotations

from pathlib import Path

from ffn_tools.errors import FFNToolsError
from ffn_tools.formats import Format, Option
from ffn_tools.io.dtypes import parse_user_dtype
from ffn_tools.io.store import Checkpoint
from ffn_tools.estimate import priced
from ffn_tools.executor import execute
from ffn_tools.io.run import NO_RUN, Run

from .export import build_plan
from .export import LAYOUTS
from .reader import OrbaxCheckpoint
from .store import OWNED, is_orbax

__all__ = ["FORMAT", "LAYOUTS"]


class Orbax(Format):
    name, extra = "orbax", "flax"
    options = (Option("orbax_layout", "Orbax only: hf = the Hugging Face Flax tree (default); maxtext = MaxText's "
                      "scanned decoder (layers stacked on axis 1, its query scaling; Llama, Mistral, Mixtral, Qwen3, "
                      "Qwen3-MoE); nnx = each FFN as the NNX state of gate/up/down nnx.Linear (FFNs only).",
                      choices=LAYOUTS),)
    takes = frozenset({"scheme", "layout", "dry_run"})
    detect_order = 35
    owns = OWNED  # its metadata and OCDBT's manifest (its arrays are directories: never side files)

    def can_read(self, path: Path) -> bool:
        """An Orbax item directory (``_METADATA`` beside its arrays), a step directory or a CheckpointManager root."""
        return Path(path).is_dir() and is_orbax(Path(path))

    def read(self, path: Path, absent_shards: bool = False, like: Checkpoint | None = None) -> OrbaxCheckpoint:
        """An Orbax checkpoint opened lazily with Hugging Face names.

        Raises:
            CheckpointError: no ``_METADATA``, arrays of no known name, arrays that do not open.
        """
        return OrbaxCheckpoint(Path(path))

    def export(self, ckpt: Checkpoint, out: Path, **options) -> dict:
        return export(ckpt, out, **options)

    def recipe(self, ckpt: Checkpoint, dtype: str | None, quantized: bool) -> dict | None:
        layout = getattr(ckpt, "layout", "hf")
        return None if quantized or layout == "nnx" else {"dtype": dtype, "orbax_layout": layout}

    runtimes = ("transformers",)

    def load_runtime(self, name: str):
        from .client import OrbaxClient

        return OrbaxClient()


FORMAT = Orbax()


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, orbax_layout: str | None = None, scheme=None, layout=None,
           dry_run: bool = False, run: Run = NO_RUN) -> dict:
    """Write ``ckpt`` as an Orbax item directory (``_METADATA``, the OCDBT database) with config.json and the
    tokenizer beside: what ``orbax.checkpoint``'s checkpointers restore (MaxText: point ``load_parameters_path`` at
    it).

    Args:
        orbax_layout: "hf" (default: the Hugging Face Flax tree), "maxtext" (MaxText's scanned decoder) or "nnx"
            (the FFNs only, each the NNX state of a gate/up/down ``nnx.Linear`` module).
        scheme, layout: for "nnx", the FFN naming scheme and fused gate_up layout (detected when None).
        dry_run: plan only; ``plan`` in the summary lists every array (slab) and how it is made.

    Raises:
        FFNToolsError: --max-shard-size, an unknown layout, a model the layout has no place for.
    """
    if max_shard_size:
        raise FFNToolsError("--max-shard-size does not apply to --to orbax: OCDBT sizes its own data files")
    tree = orbax_layout or "hf"
    plan, writer = build_plan(ckpt, tree, parse_user_dtype(dtype) if dtype else None, scheme, layout)
    out = Path(out)
    made = run.but(out=out, force=force, desc=f"converting to orbax ({tree})", writer=writer, carry=tree != "nnx")
    files = [] if dry_run else execute(plan, made)
    summary = {"output": str(out), "format": "orbax", "layout": tree, "files": files, "tensors": len(plan.entries),
               "bytes": plan.total_bytes, "changes": plan.changes}
    return {**summary, "plan": plan.describe(), **priced(plan, made)} if dry_run else summary
