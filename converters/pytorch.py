"""PyTorch format: Hugging Face safetensors (single or sharded) and weights-only pickles.

Reading is ``ffn_tools.store``; exporting writes HF-named safetensors shards that transformers loads,
optionally casting floating tensors to ``dtype``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ffn_tools.io.dtypes import parse_user_dtype, short_name
from ffn_tools.errors import FFNToolsError
from ffn_tools.plan import Entry, Plan, copy_entry, execute
from ffn_tools.io.store import Checkpoint, Format, config_dtype, open_checkpoint

FORMAT = "torch"
OPTIONS: frozenset[str] = frozenset({"dry_run"})


def can_read(path: Path) -> bool:
    """Anything ``open_checkpoint`` accepts; errors are left for ``open`` to report."""
    return True


def open(path: Path, absent_shards: bool = False) -> Checkpoint:  # noqa: A001 - the converter surface's name
    """Open a PyTorch checkpoint lazily (see ``ffn_tools.io.store.open_checkpoint``, ``absent_shards`` too); MXFP4 experts (GPT-OSS as
    OpenAI ships it) are seen dequantized, exactly (see ``ffn_tools.mxfp4``), and compressed-tensors packed
    weights as compressed-tensors dequantizes them (``ffn_tools.ctview``)."""
    from ffn_tools import ctview, mxfp4

    ckpt = open_checkpoint(path, absent_shards)
    if mxfp4.pairs(ckpt):
        return mxfp4.Mxfp4View(ckpt)
    try:
        return ctview.view(ckpt)
    except Exception:
        ckpt.close()
        raise


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


DEQUANTIZED = "ffn_tools_dequantized_from"  # safetensors metadata: the quantization the weights were read from
FLOATS = ("F64", "F32", "F16", "BF16")


def _config_dtype(config: dict | None, entries: list[Entry]) -> list[str]:
    """Set ``config``'s dtype to the one most of the written float bytes have, where it says another (an f16
    MLX model's config keeps its source's bfloat16: transformers would load the f16 weights cast)."""
    sizes: dict[str, int] = {}
    for e in entries:
        if e.st_dtype in FLOATS:
            sizes[e.st_dtype] = sizes.get(e.st_dtype, 0) + e.nbytes
    if config is None or not sizes:
        return []
    stored = short_name(max(sizes, key=lambda st: sizes[st]))
    said = config_dtype(config)
    if said in (None, stored):
        return []
    config["dtype"] = stored
    config.pop("torch_dtype", None)
    return [f"config.json: dtype {stored}, the weights' (the input's config said {said})"]


def _card(ckpt: Checkpoint) -> str | None:
    """The input's model card with MLX's labels replaced by transformers' (``library_name: mlx`` and the
    ``mlx`` tag, as mlx_lm writes them), so an uploaded PyTorch repo is not labelled MLX; None: nothing to
    change."""
    readme = Path(ckpt.root) / "README.md"
    if ckpt.format is not Format.MLX or not readme.is_file():
        return None
    text = readme.read_text()
    head = re.match(r"---\n(.*?\n)---\n", text, re.S)
    if head is None:
        return None
    front = re.sub(r"(?m)^library_name:\s*mlx\s*$", "library_name: transformers", head[1])
    front = re.sub(r"(?m)^\s*-\s*mlx\s*\n", "", front)
    front = re.sub(r"(?m)^tags:\s*\n(?!\s*-)", "", front)  # a tags list left empty
    return None if front == head[1] else f"---\n{front}---\n{text[head.end():]}"


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
    entries = [cast_entry(ckpt, n, target) for n in ckpt]
    metadata = {"format": "pt"}
    dequantized = [q for n in ckpt if (q := ckpt.quant_params(n))]
    if dequantized:  # recorded, so verify against the quantized model's source knows B carries its error
        q = dequantized[0]
        record = {"format": str(ckpt.format), **{k: q.get(k) for k in ("bits", "group_size", "mode")},
                  "weights": len(dequantized)}
        metadata[DEQUANTIZED] = json.dumps(record)
        changes.append(f"dequantized {len(dequantized)} {ckpt.format}-quantized weights ({q.get('bits')}-bit "
                       f"{q.get('mode', 'affine')}, group {q.get('group_size')}): recorded in the safetensors "
                       f"metadata as {DEQUANTIZED}")
    changes += _config_dtype(config, entries)
    plan = Plan(ckpt, entries, config, changes)
    if dry_run:
        return {"output": str(out), "format": FORMAT, "files": [], "tensors": len(plan.entries),
                "bytes": plan.total_bytes, "changes": changes, "plan": plan.describe()}
    card = _card(ckpt)
    extra: dict[str, str | bytes] = {"README.md": card} if card else {}
    if ckpt.format is Format.GGUF:  # config.json comes from the metadata, tokenizer and generation config too
        from .gguf import side_files
        from .gguf.record import plus_one_record

        rebuilt, said = side_files(ckpt)
        extra.update(rebuilt)
        changes += said
        recorded, said = plus_one_record(ckpt)  # Gemma's norms: back within 2**-24, not bit for bit
        metadata.update(recorded)
        changes += said
    files = execute(plan, out, force=force, max_shard_size=max_shard_size, metadata=metadata,
                    desc="converting to torch", extra_files=extra or None)
    if card:
        changes.append("README.md: the model card names transformers, not mlx, as its library")
    return {"output": str(out), "format": FORMAT, "files": files, "tensors": len(plan.entries),
            "bytes": plan.total_bytes, "changes": changes}
