"""Export to Hugging Face PyTorch safetensors shards that transformers loads, from any format's view, optionally
casting floating tensors to ``dtype``; weights read dequantized are recorded as such in the metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

from ffn_tools.io.dtypes import parse_user_dtype, short_name
from ffn_tools.errors import FFNToolsError
from ffn_tools.plan import DEQUANTIZED, Entry, Plan, cast_entry, execute, unquantized_config
from ffn_tools.io.store import Checkpoint, config_dtype

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
    dequantized = [m.params for n in ckpt if (m := ckpt.quantized(n))]
    if dequantized:  # recorded, so verify against the quantized model's source knows B carries its error
        p = dequantized[0]
        record = {"format": ckpt.kind, **{k: p.get(k) for k in ("bits", "group_size", "mode")},
                  "weights": len(dequantized)}
        metadata[DEQUANTIZED] = json.dumps(record)
        changes.append(f"dequantized {len(dequantized)} {ckpt.kind}-quantized weights ({p.get('bits')}-bit "
                       f"{p.get('mode', 'affine')}, group {p.get('group_size')}): recorded in the safetensors "
                       f"metadata as {DEQUANTIZED}")
    changes += _config_dtype(config, entries)
    plan = Plan(ckpt, entries, config, changes)
    if dry_run:
        return {"output": str(out), "format": "torch", "files": [], "tensors": len(plan.entries),
                "bytes": plan.total_bytes, "changes": changes, "plan": plan.describe()}
    extra, said = ckpt.rebuilt_files()  # what the input stores otherwise: a GGUF's tokenizer, an MLX card
    changes += said
    recorded, said = ckpt.carried_metadata()  # a GGUF's Gemma norms: back within 2**-24, not bit for bit
    metadata.update(recorded)
    changes += said
    files = execute(plan, out, force=force, max_shard_size=max_shard_size, metadata=metadata,
                    desc="converting to torch", extra_files=extra or None)
    return {"output": str(out), "format": "torch", "files": files, "tensors": len(plan.entries),
            "bytes": plan.total_bytes, "changes": changes}
