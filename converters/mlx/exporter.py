"""MLX export: the model directory ``mlx_lm.convert`` writes, streamed tensor by tensor.

The spec is mlx_lm's own model class for the config (``models.target``), built lazily: its parameter
names and shapes are what the export must write, checked before anything is written. Names come from
the model's own ``sanitize`` run on stand-ins (``names``): renamed and stacked inputs are byte copies,
anything else ``sanitize`` computes is evaluated from the lazily loaded input. A checkpoint whose FFNs are in
another form than the model's (fused ``gate_up_proj``, transformers v5 stacked experts) is split or fused
in the same plan. With ``-q`` the modules mlx_lm.convert would quantize (``recipe.decide``) are packed
with ``mx.quantize`` in row chunks (``quant``): bit for bit what ``mlx_lm.convert`` writes. Without
``-q``/``--dtype`` export is lossless (``mlx_lm.convert`` would also cast to a legacy ``torch_dtype`` in
config.json; this only does so when quantizing, where it decides the scales' bits).

Besides weights: safetensors shards with ``{"format": "mlx"}`` metadata and an index, ``config.json`` as
mlx_lm's ``save_config`` writes it, the tokenizer/generation files, and a model card README.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NoReturn

from ffn_tools.errors import FFNToolsError, counted
from ffn_tools.io.dtypes import DTYPE_CHOICES, USER_DTYPES, short_name
from ffn_tools.io.store import Checkpoint
from ffn_tools.io.writer import OutTensor, plan_shards
from ffn_tools.plan import Plan, copy_entry, execute

from . import from_ct
from .card import model_card
from .config import added_metadata, mlx_config
from .matching import HEAD, match_or_dequantize
from .models import TIE_KEY, check_runs
from .recipe import decide, resolve

MAX_SHARD_SIZE = 5 << 30  # mlx_lm's save_model shards at 5 GiB
METADATA = {"format": "mlx"}
_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _dtype(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    name = USER_DTYPES.get(str(dtype).lower().removeprefix("torch."))
    if name not in _ST:
        raise FFNToolsError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_CHOICES)}")
    return _ST[name]


def collapse(names) -> str:
    """'model.layers.*.mlp.down_proj.weight (x2)' for model.layers.0/1.mlp.down_proj.weight."""
    counts: dict[str, int] = {}
    for n in names:
        p = re.sub(r"\.\d+(?=\.|$)", ".*", n)
        counts[p] = counts.get(p, 0) + 1
    return ", ".join(p + (f" (x{c})" if c > 1 else "") for p, c in counts.items())


def _sizing_only() -> NoReturn:
    """The ``produce`` of the ``OutTensor``s ``plan_shards`` sizes the shards with: never written."""
    raise RuntimeError("internal error: a tensor made only to size the shards was written")


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, quantize=None, q_bits: int | None = None,
           q_group_size: int | None = None, q_mode: str | None = None, quant_predicate: str | None = None,
           group_size: int | None = None, dequantize: bool = False, dry_run: bool = False) -> dict:
    """Write ``ckpt`` as an MLX model directory ``out`` that ``mlx_lm.load`` opens (see the module doc).

    Args:
        dtype: cast floating tensors to float32/float16/bfloat16 (MLX's ``astype``, as mlx_lm.convert).
        quantize: True (``-q``), or bits (the older ``--quantize 4``).
        q_bits, q_group_size, q_mode: as mlx_lm.convert's flags (defaults per mode: affine 4 bits, group 64).
        quant_predicate: a mixed recipe of mlx_lm (mixed_3_6, ...).
        group_size: the older name of ``q_group_size``.
        dequantize: an MLX-quantized input is written dequantized (``-d``); without it (and without ``-q``)
            it stays quantized as it is, as ``mlx_lm.convert`` keeps it.
        dry_run: plan and check only; ``plan`` in the summary lists every output tensor.

    Returns:
        Summary: output, format, model_type, mlx_model, files, tensors, bytes, dtype, quantization,
        quantized, unquantized (weights left so), changes (human-readable lines).

    Raises:
        FFNToolsError: bad options, no config.json or no mlx_lm model for it, an input that does not fit the
            model (listed), an existing output.
    """
    out = Path(out)
    if out.suffix == ".safetensors":
        raise FFNToolsError(f"{out}: MLX models are directories (weights, config.json, tokenizer); "
                            "give a directory path to -o")
    if group_size is not None and q_group_size is not None and int(group_size) != int(q_group_size):
        raise FFNToolsError("--group-size and --q-group-size disagree; give one")
    target_st = _dtype(dtype)
    quant = resolve(quantize, q_bits, q_group_size if q_group_size is not None else group_size, q_mode,
                    quant_predicate)
    from . import FORMAT

    kept = [q for q in ckpt.decoded() if ckpt.format is FORMAT]
    if kept and not quant and not dequantize:
        return _keep_quantized(ckpt, out, kept, target_st, force, max_shard_size, dry_run)
    tg, view, outputs, unused, changes, ckpt = match_or_dequantize(ckpt, quantizing=bool(quant))
    if untried := check_runs(tg, str(ckpt.path)):
        changes.append(untried)
    config = tg.config
    if tg.renamed:
        changes.append(f"config.json: model_type {config['model_type']} (was {tg.renamed}): mlx_lm has no "
                       f"{tg.renamed} model and loads this one as {config['model_type']}; reading back restores it")
    v5 = [k for k in tg.added if k != TIE_KEY]
    if v5:
        changes.append(f"config.json: added {', '.join(v5)} from transformers v5 keys (mlx_lm's {tg.module} ModelArgs "
                       "reads the old names); reading the MLX model back drops them again")
    if TIE_KEY in tg.added:
        changes.append(f"config.json: added {TIE_KEY} {str(config[TIE_KEY]).lower()} (the source has no such key; "
                       f"transformers ties the head exactly when the checkpoint has no {HEAD}, and mlx_lm's default "
                       "would differ); reading the MLX model back drops it again")
    if quant and target_st is None:  # mlx_lm.convert casts to a legacy torch_dtype before quantizing
        legacy = config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
        if legacy in _ST:
            target_st = _ST[legacy]
            changes.append(f"cast floating tensors to {legacy} (config.json torch_dtype), as mlx_lm.convert does")
    computed = [o.name for o in outputs if o.computed]
    unused = [n for n in unused if n not in set(computed)]  # recomputed under their own name: listed below
    if unused:
        how = (f"dropped by mlx_lm's sanitize: {collapse(unused)}" if not computed else
               f"not carried over by name: {collapse(unused)} (mlx_lm's sanitize drops them or computes "
               "the tensors below from them)")
        changes.append(how)
    stacked = [o for o in outputs if len(o.sources) > 1]
    if stacked:
        changes.append(f"stacked {sum(len(o.sources) for o in stacked)} expert tensors into {len(stacked)} "
                       "tensors (E, out, in), as mlx_lm's sanitize does")
    if computed:
        changes.append(f"computed by mlx_lm's sanitize (evaluated from the input): {collapse(computed)}")
    d = decide(tg.model, quant) if quant else None
    chosen, block = (d.chosen, d.block) if d else ({}, tg.prequant)
    left = [f"{m}.weight" for m in d.skipped] if d else []
    ct_kept: dict = {}  # --- compressed-tensors, GPTQ, AWQ input: group-wise int codes kept as MLX affine ---
    ct_modules = from_ct.modules(ckpt)
    if ct_modules:
        config.pop("quantization_config", None)  # the quantizer's own: mlx_lm reads only its block
        if not quant and not dequantize:
            ct_kept, refused = from_ct.kept(ct_modules, outputs, view)
            if target_st is not None:  # scales and biases would be cast: the codes' values change
                ct_kept, refused = {}, {n: "--dtype given" for n in ct_modules}
            block = from_ct.block(ct_kept) or block
            changes += from_ct.changes(ct_kept, refused)
        else:
            changes.append(f"read {len(ct_modules)} quantized weights dequantized"
                           + (" (-d)" if dequantize else ", then quantized as asked"))

    from .tensors import plan_outputs

    entries, jobs = plan_outputs(ckpt, tg, view, outputs, target_st, chosen, d.shapes if d else {})
    if ct_kept:
        entries = from_ct.replace(ckpt, entries, ct_kept)
    if quant and d:
        n = sum(e.name.endswith(".scales") for e in entries)
        changes.append(f"quantized {counted(n, 'weight')} with mx.quantize: {quant.bits} bits, group size {quant.group_size} "
                       f"({quant.mode}{', recipe ' + quant.recipe if quant.recipe else ''}); config.json gets the "
                       "quantization block")
        for module, params in block.items():
            if isinstance(params, dict) and module not in ("group_size", "bits", "mode"):
                if not quant.recipe:
                    changes.append(f"{module}: {params}, the model's quant_predicate (as mlx_lm.convert)")
        for why in dict.fromkeys(d.skipped.values()):
            changes.append(f"left unquantized, as mlx_lm.convert does ({why}): "
                           f"{collapse(m + '.weight' for m, w in d.skipped.items() if w == why)}")
    if dtype is not None:
        changes.append(f"floating tensors cast to {short_name(target_st)} with MLX's astype, as mlx_lm.convert "
                       "--dtype")
    plan = Plan(ckpt, entries, None, changes)
    summary = {"output": str(out), "format": "mlx", "model_type": config.get("model_type"), "mlx_model": tg.module,
               "tensors": len(entries), "bytes": plan.total_bytes, "dtype": short_name(target_st) if target_st else None,
               "quantization": block, "quantized": len(chosen), "unquantized": left, "changes": changes}
    if dry_run:
        return {**summary, "files": [], "plan": plan.describe()}
    shard = max_shard_size or MAX_SHARD_SIZE
    if ckpt.config is None:  # target() refused it already
        raise FFNToolsError(f"{ckpt.path}: no config.json; MLX export needs it")
    metadata = {**METADATA, **added_metadata(ckpt.config, config)}  # what reading back removes
    items = [OutTensor(e.name, e.st_dtype, tuple(e.shape), e.nbytes, _sizing_only) for e in entries]
    extra: dict[str, str | bytes] = {"config.json": mlx_config(ckpt, config, block), "README.md": model_card(ckpt)}
    rebuilt, said = ckpt.rebuilt_files()  # a GGUF's tokenizer, as transformers writes it from tokenizer.ggml.*
    extra = {**rebuilt, **extra}
    changes += [line for line in said if not line.startswith("README.md")]  # mlx_lm's card is written
    recorded, said = ckpt.carried_metadata()  # a GGUF's Gemma norms: back within 2**-24, not bit for bit
    metadata.update(recorded)
    changes += said
    if len(plan_shards(items, shard, metadata)) == 1:  # mlx-lm writes an index even for one shard
        index = {"metadata": {"total_size": plan.total_bytes},
                 "weight_map": {e.name: "model.safetensors" for e in sorted(entries, key=lambda e: e.name)}}
        extra["model.safetensors.index.json"] = json.dumps(index, indent=4)
    from .quant import start_pool

    pool = start_pool(jobs)
    try:
        files = execute(plan, out, force=force, max_shard_size=shard, metadata=metadata, desc="converting to mlx",
                        extra_files=extra)
    finally:
        if pool is not None:
            pool.close()
    return {**summary, "files": files}


def _keep_quantized(ckpt: Checkpoint, out: Path, kept: list[dict], target_st, force, max_shard_size,
                    dry_run) -> dict:
    """An MLX-quantized input exported without -q or -d: kept as it is stored, every tensor copied byte for
    byte with its config.json (``mlx_lm.convert`` keeps a quantized model quantized), not silently
    dequantized."""
    if target_st is not None:
        raise FFNToolsError(f"{ckpt.path}: is MLX-quantized; --dtype would cast its scales: pass -d/--dequantize to "
                            "write it dequantized in that dtype, or -q to re-quantize")
    raw = ckpt.stored  # the files as stored, packed weights included
    entries = [copy_entry(raw, n) for n in raw]
    what = ", ".join(f"{counted(q['weights'], 'weight')} {q['dtype']}" for q in kept)
    changes = [f"kept the input's quantization ({what}): every tensor copied byte for byte, as mlx_lm.convert keeps "
               "a quantized model quantized (-d/--dequantize writes it dequantized, -q re-quantizes)"]
    plan = Plan(raw, entries, dict(raw.config or {}), changes)
    summary = {"output": str(out), "format": "mlx", "model_type": (raw.config or {}).get("model_type"),
               "mlx_model": None, "tensors": len(entries), "bytes": plan.total_bytes, "dtype": None,
               "quantization": (raw.config or {}).get("quantization"), "quantized": sum(q["weights"] for q in kept),
               "unquantized": [], "changes": changes}
    if dry_run:
        return {**summary, "files": [], "plan": plan.describe()}
    files = execute(plan, out, force=force, max_shard_size=max_shard_size or MAX_SHARD_SIZE,
                    metadata={**METADATA, **raw.metadata}, desc="copying mlx")
    return {**summary, "files": files}
