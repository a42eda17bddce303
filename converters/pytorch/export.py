"""Export to Hugging Face PyTorch safetensors shards that transformers loads, from any format's view, optionally
casting floating tensors to ``dtype``; weights read dequantized are recorded as such in the metadata.

Weights a PyTorch checkpoint keeps quantized as stored (FP8 blocks: F8_E4M3 codes beside their
``weight_scale_inv``) travel as they are with the config's ``quantization_config``, which is what makes
transformers read them through its FP8 quantizer rather than take the codes for weights. ``--dtype`` on them
dequantizes, as DeepSeek's ``fp8_cast_bf16.py`` and transformers' FP8 dequantize do: codes times their block's
scale in float32, rounded once to the dtype; the scales are dropped and ``quantization_config`` removed. A cast of
the codes alone would drop their scales.
"""

from __future__ import annotations

import json
from pathlib import Path

from ffn_tools import mtp as heads_of, quant
from ffn_tools.io.dtypes import parse_user_dtype, short_name
from ffn_tools.errors import FFNToolsError
from ffn_tools.plan import DEQUANTIZED, Entry, Plan, cast_entry, unquantized_config
from ffn_tools.estimate import estimate
from ffn_tools.executor import execute
from ffn_tools.io.run import NO_RUN, Run
from ffn_tools.io.store import Checkpoint, config_dtype
from ffn_tools.quant.fp8 import is_companion

FLOATS = ("F64", "F32", "F16", "BF16")


def _config_dtype(config: dict | None, entries: list[Entry], scales: frozenset[str] = frozenset()) -> list[str]:
    """Set ``config``'s dtype to the one most of the written float bytes have, where it says another (an f16
    MLX model's config keeps its source's bfloat16: transformers would load the f16 weights cast); ``scales``
    (of weights kept quantized: their scheme's dtype, not the model's) are not counted."""
    sizes: dict[str, int] = {}
    for e in entries:
        if e.st_dtype in FLOATS and e.name not in scales:
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


def _kept_line(kept: list[dict], config: dict | None) -> str:
    """The changes line of FP8 weights written as stored, with the quantization config that reads them."""
    n = sum(k["weights"] for k in kept)
    q = (config or {}).get("quantization_config")
    how = (f"config.json's quantization_config ({q.get('quant_method')}) kept, so transformers reads them through "
           "its quantizer" if isinstance(q, dict) else
           "the input's config.json has no quantization_config: transformers would read the codes as weights")
    return (f"kept {n} {kept[0]['dtype']} weights as stored, with their _{kept[0]['scales']} ({how}); --dtype "
            "writes them dequantized")


def _dequantized_line(kept: list[dict], target) -> str:
    """The changes line of FP8 weights dequantized by ``--dtype``."""
    n = sum(k["weights"] for k in kept)
    blocks = ", ".join(sorted({"x".join(map(str, k["block"])) for k in kept}))
    return (f"dequantized {n} {kept[0]['dtype']} weights to {short_name(target)} (--dtype): each code times its "
            f"_{kept[0]['scales']} per {blocks} block in float32, rounded once (DeepSeek's fp8_cast_bf16.py, "
            "transformers' FP8 dequantize); the scales dropped, quantization_config removed")


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, dry_run: bool = False, mtp: str | None = None,
           run: Run = NO_RUN) -> dict:
    """Write ``ckpt`` as Hugging Face PyTorch safetensors in directory ``out``.

    Args:
        dry_run: plan only; ``plan`` in the summary lists every output tensor and how it is made.
        mtp: ``--mtp``: keep (default), drop or only the MTP heads (``ffn_tools.mtp``); said, and recorded
            in the metadata where not kept.

    Returns:
        Summary: output path, files, tensor count, bytes, dtype.
    """
    if Path(out).suffix == ".safetensors":
        raise FFNToolsError(f"{out}: convert writes a directory (config.json and tokenizer files travel with the "
                            "weights); give a directory path")
    target = parse_user_dtype(dtype) if dtype else None
    kept = quant.kept(ckpt)  # FP8 blocks: codes and scales as stored
    scales: frozenset[str] = frozenset()
    cast_codes = bool(kept) and target is not None
    if cast_codes:  # a cast of the codes would drop their scales: dequantized first
        ckpt = quant.decoded(ckpt, every=True)
        config, changes = unquantized_config(ckpt.config, target)
        changes.append(_dequantized_line(kept, target))
    elif kept:
        config, changes = (dict(ckpt.config) if ckpt.config is not None else None), [_kept_line(kept, ckpt.config)]
        scales = frozenset(n for n in ckpt if is_companion(n, ckpt))
    else:
        config, changes = unquantized_config(ckpt.config, target)
    heads = heads_of.find_heads(ckpt, ckpt.config)
    entries = [cast_entry(ckpt, n, target) for n in heads_of.select(ckpt, heads, mtp or "keep")]
    metadata = {"format": "pt", **heads_of.record(mtp or "keep", heads, ckpt.metadata)}
    changes += heads_of.said(mtp or "keep", heads)
    dequantized = [m.params for n in ckpt if (m := ckpt.quantized(n))]
    if dequantized:  # recorded, so verify against the quantized model's source knows B carries its error
        p = dequantized[0]
        record = {"format": ckpt.kind, **{k: p.get(k) for k in ("bits", "group_size", "mode")},
                  "weights": len(dequantized)}
        metadata[DEQUANTIZED] = json.dumps(record)
        where = f"recorded in the safetensors metadata as {DEQUANTIZED}"
        if cast_codes:  # its own line, said above
            changes[-1] += f"; {where}"
        else:
            changes.append(f"dequantized {len(dequantized)} {ckpt.kind}-quantized weights ({p.get('bits')}-bit "
                           f"{p.get('mode', 'affine')}, group {p.get('group_size')}): {where}")
    changes += _config_dtype(config, entries, scales)
    plan = Plan(ckpt, entries, config, changes)
    summary = {"output": str(out), "format": "torch", "files": [], "tensors": len(plan.entries),
               "bytes": plan.total_bytes, "changes": changes}
    if dry_run and run.estimate is None:
        return {**summary, "plan": plan.describe()}
    extra, said = ckpt.rebuilt_files()  # what the input stores otherwise: a GGUF's tokenizer, an MLX card
    changes += said
    recorded, said = ckpt.carried_metadata()  # a GGUF's Gemma norms: back within 2**-24, not bit for bit
    metadata.update(recorded)
    changes += said
    made = run.but(out=out, force=force, max_shard_size=max_shard_size, metadata=metadata,
                   desc="converting to torch", extra_files=extra or None)
    if dry_run:  # the estimate asked for: a sample of this plan streamed as the run would stream it
        return {**summary, "plan": plan.describe(), "estimate": estimate(plan, made)}
    return {**summary, "files": execute(plan, made)}
