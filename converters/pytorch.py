"""PyTorch format: Hugging Face safetensors (single or sharded) and weights-only pickles.

Reading is ``ffn_tools.store``; exporting writes HF-named safetensors shards that transformers loads,
optionally casting floating tensors to ``dtype``.
"""

from __future__ import annotations

from pathlib import Path

from ffn_tools.io.dtypes import parse_user_dtype, short_name
from ffn_tools.errors import FFNToolsError
from ffn_tools.plan import Entry, Plan, copy_entry, execute
from ffn_tools.io.store import Checkpoint, open_checkpoint

FORMAT = "torch"
OPTIONS: frozenset[str] = frozenset({"dry_run"})


def can_read(path: Path) -> bool:
    """Anything ``open_checkpoint`` accepts; errors are left for ``open`` to report."""
    return True


def open(path: Path) -> Checkpoint:  # noqa: A001 - the converter surface's name
    """Open a PyTorch checkpoint lazily (see ``ffn_tools.io.store.open_checkpoint``); MXFP4 experts (GPT-OSS as
    OpenAI ships it) are seen dequantized, exactly (see ``ffn_tools.mxfp4``)."""
    from ffn_tools import mxfp4

    ckpt = open_checkpoint(path)
    return mxfp4.Mxfp4View(ckpt) if mxfp4.pairs(ckpt) else ckpt


def cast_entry(ckpt: Checkpoint, name: str, dtype) -> Entry:
    """Copy a tensor, casting it to ``dtype`` if it is floating and differs."""
    info = ckpt.info(name)
    if dtype is None or not info.dtype.is_floating_point or info.dtype == dtype:
        return copy_entry(ckpt, name)
    return Entry(name, dtype, info.shape, (name,), lambda ts: ts[0].to(dtype), None,
                 f"cast {short_name(info.dtype)} -> {short_name(dtype)}")


def unquantized_config(config: dict | None, target) -> tuple[dict | None, list[str]]:
    """A copy of ``config`` for unquantized weights in dtype ``target`` (None: unchanged), and what changed."""
    if config is None:
        return None, []
    config, changes = dict(config), []
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    if target is not None:
        config["dtype"] = short_name(target)
        config.pop("torch_dtype", None)
        changes.append(f"config.json: dtype set to {short_name(target)}")
    return config, changes


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, dry_run: bool = False) -> dict:
    """Write ``ckpt`` as Hugging Face PyTorch safetensors in directory ``out``.

    Args:
        dry_run: plan only; ``plan`` in the summary lists every output tensor and how it is made.

    Returns:
        Summary: output path, files, tensor count, bytes, dtype.
    """
    if Path(out).suffix == ".safetensors":
        raise FFNToolsError(f"{out}: convert writes a directory (config.json and tokenizer files travel with the "
                            "weights); give a directory path")
    target = parse_user_dtype(dtype) if dtype else None
    config, changes = unquantized_config(ckpt.config, target)
    plan = Plan(ckpt, [cast_entry(ckpt, n, target) for n in ckpt], config, changes)
    if dry_run:
        return {"output": str(out), "format": FORMAT, "files": [], "tensors": len(plan.entries),
                "bytes": plan.total_bytes, "changes": changes, "plan": plan.describe()}
    files = execute(plan, out, force=force, max_shard_size=max_shard_size, metadata={"format": "pt"},
                    desc="converting to torch")
    return {"output": str(out), "format": FORMAT, "files": files, "tensors": len(plan.entries),
            "bytes": plan.total_bytes, "changes": changes}
