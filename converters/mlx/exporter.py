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

Besides weights: safetensors shards with ``{"format": "mlx"}`` metadata (and what reading back needs: the keys
config.json gained, how the source named its experts, ``inverse.saved_as``) and an index, ``config.json`` as
mlx_lm's ``save_config`` writes it, the tokenizer/generation files, and a model card README.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

from ffn_tools import mtp as heads_of
from ffn_tools.errors import FFNToolsError, counted
from ffn_tools.io import nogc
from ffn_tools.io.dtypes import DTYPE_CHOICES, USER_DTYPES, short_name
from ffn_tools.io.store import Checkpoint
from ffn_tools.io.writer import OutTensor, plan_shards
from ffn_tools.plan import Plan, copy_entry
from ffn_tools.estimate import estimate, priced
from ffn_tools.executor import execute
from ffn_tools.io.run import NO_RUN, Run

from . import from_ct, said
from .card import model_card
from .config import added_metadata, mlx_config
from .inverse import saved_as
from .matching import fp8_said, match_or_dequantize
from .models import check_runs
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


def _sizing_only() -> NoReturn:
    """The ``produce`` of the ``OutTensor``s ``plan_shards`` sizes the shards with: never written."""
    raise RuntimeError("internal error: a tensor made only to size the shards was written")


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, quantize=None, q_bits: int | None = None,
           q_group_size: int | None = None, q_mode: str | None = None, quant_predicate: str | None = None,
           group_size: int | None = None, dequantize: bool = False, dry_run: bool = False, mtp: str | None = None,
           run: Run = NO_RUN) -> dict:
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
        mtp: ``--mtp``: the MTP heads (``ffn_tools.mtp``), which mlx_lm's model has no place for: keep (default)
            writes them beside the model as ``mtp.HEAD_FILE``, drop leaves them out (recorded); only is refused.

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

    heads, source = heads_of.find_heads(ckpt, ckpt.config), ckpt
    if heads and mtp == "only":
        raise FFNToolsError(f"{ckpt.path}: --mtp only: mlx_lm has no model of an MTP head alone; --to torch --mtp "
                            "only writes it")
    beside = {heads_of.HEAD_FILE: heads_of.head_file(source, heads)} if heads and mtp != "drop" and not dry_run else {}
    kept = [q for q in ckpt.decoded() if ckpt.format is FORMAT]
    if kept and not quant and not dequantize:
        if heads and mtp == "drop":
            raise FFNToolsError(f"{ckpt.path}: --mtp drop of an MLX-quantized model kept as it is: give -d or -q")
        r = _keep_quantized(ckpt, out, kept, target_st, force, max_shard_size, dry_run,
                            run.but(extra_files=beside) if beside else run)  # its heads' file carried again
        return {**r, "changes": [*r["changes"], *heads_of.placed(heads, "mlx_lm's model has no place for it")]}
    from .workers import early

    started = early(ckpt)  # the workers ``Mlx.preparing`` started for this checkpoint, if it did
    if heads:  # mlx_lm's model has no place for them: the model written without them, they beside it (or dropped)
        ckpt = heads_of.without(ckpt, heads)
    # decide: mlx_lm's model and the view of the input that fits it, what is quantized, what keeps its codes
    with nogc.paused():  # mlx_lm's import (transformers, torch) and its model: a quarter of it was the collector's
        tg, view, outputs, unused, changes, ckpt = match_or_dequantize(ckpt, quantizing=bool(quant))
    if untried := check_runs(tg, str(ckpt.path)):
        changes.append(untried)
    if quant and target_st is None:  # mlx_lm.convert casts to a legacy torch_dtype before quantizing
        legacy = tg.config.get("torch_dtype") or (tg.config.get("text_config") or {}).get("dtype")
        if legacy in _ST:
            target_st = _ST[legacy]
            changes.append(f"cast floating tensors to {legacy} (config.json torch_dtype), as mlx_lm.convert does")
    changes += said.config_changes(tg) + said.output_changes(outputs, unused)
    if mtp == "drop":
        changes += heads_of.said("drop", heads)
    else:
        changes += heads_of.placed(heads, "mlx_lm's model has no place for it")
    d = decide(tg.model, quant) if quant else None
    chosen, block = (d.chosen, d.block) if d else ({}, tg.prequant)
    ct_kept, block = _kept_codes(ckpt, tg.config, outputs, view, quant, dequantize, target_st, block, changes, tg.module)
    from .tensors import plan_outputs

    entries, jobs = plan_outputs(ckpt, tg, view, outputs, target_st, chosen, d.shapes if d else {})
    if ct_kept:
        entries = from_ct.replace(ckpt, entries, ct_kept)
    changes += said.quant_changes(entries, quant, d, block) + said.cast_changes(dtype, target_st)
    plan = Plan(ckpt, entries, None, changes)
    summary = {"output": str(out), "format": "mlx", "model_type": tg.config.get("model_type"), "mlx_model": tg.module,
               "tensors": len(entries), "bytes": plan.total_bytes, "dtype": short_name(target_st) if target_st else None,
               "quantization": block, "quantized": len(chosen),
               "unquantized": [f"{m}.weight" for m in d.skipped] if d else [], "changes": changes}
    if dry_run and run.estimate is None:
        return {**summary, "files": [], "plan": plan.describe()}
    # act: the directory, written atomically (or, for a dry run's estimate, a sample of it); the summary reports
    # from the plan
    made = _write(ckpt, tg.config, plan, block, out, force, max_shard_size, jobs, started, run, dry_run, beside,
                  {**heads_of.record(mtp or "keep", heads, source.metadata), **_kept_record(ct_kept)})
    if dry_run:
        return {**summary, "files": [], "plan": plan.describe(), "estimate": made}
    return {**summary, "files": made}


def _kept_codes(ckpt: Checkpoint, config: dict, outputs, view, quant, dequantize: bool, target_st,
                block, changes: list[str], tg_module: str) -> tuple[dict, dict | None]:
    """A compressed-tensors, GPTQ or AWQ input's group-wise int codes kept as MLX affine where they fit
    (``from_ct``): (output module -> its module, the quantization block); the config loses the quantizer's own
    block (mlx_lm reads only its own); what happens to each is said in ``changes`` (FP8 weights no MLX form holds
    first, ``fp8_said``: mlx_lm's ``tg_module`` model has no FP8 form)."""
    ct_modules = from_ct.modules(ckpt)
    changes[:0] = fp8_said(ckpt, tg_module, set(ct_modules), bool(quant))  # the FP8 the lines below do not name
    if not ct_modules:
        return {}, block
    config.pop("quantization_config", None)
    if quant or dequantize:
        changes.append(f"read {len(ct_modules)} quantized weights dequantized"
                       + (" (-d)" if dequantize else ", then quantized as asked"))
        return {}, block
    ct_kept, refused = from_ct.kept(ct_modules, outputs, view)
    if target_st is not None:  # scales and biases would be cast: the codes' values change
        ct_kept, refused = {}, {n: "--dtype given" for n in ct_modules}
    changes += from_ct.changes(ct_kept, refused)
    return ct_kept, from_ct.block(ct_kept) or block


def _kept_record(kept: dict) -> dict[str, str]:
    """The safetensors metadata that says which tensors hold the source's codes (``quant.base.KEPT_KEY``: a
    JSON list of the names the MLX view reads them by, the source's), so verify proves them exactly, not within a
    tolerance row; {} where none is kept."""
    from ffn_tools.quant.base import KEPT_KEY

    return {KEPT_KEY: json.dumps(sorted(m.weight for m in kept.values()))} if kept else {}


def _write(ckpt: Checkpoint, config: dict, plan: Plan, block, out: Path, force: bool, max_shard_size, jobs,
           started, run: Run = NO_RUN, pricing: bool = False, beside: dict[str, bytes] | None = None,
           recorded_mtp: dict[str, str] | None = None):
    """The MLX directory of ``plan``: its shards (an index even for one, as mlx-lm writes), config.json as mlx_lm
    writes it, the model card, the side files the input rebuilds, quantizing in worker processes (``started``: the
    ones started early, if any). ``pricing``: a dry run's estimate of that (``ffn_tools.estimate``: a sample of the
    plan streamed as the run would, its pool included), returned instead of the files written. ``beside``: files
    written beside the model (the MTP heads' file); ``recorded_mtp``: the metadata saying they were dropped (and
    which tensors keep the source's codes: ``_kept_record``)."""
    shard = max_shard_size or MAX_SHARD_SIZE
    if ckpt.config is None:  # target() refused it already
        raise FFNToolsError(f"{ckpt.path}: no config.json; MLX export needs it")
    metadata = {**METADATA, **added_metadata(ckpt.config, config),  # what reading back removes
                **saved_as(ckpt), **(recorded_mtp or {})}  # and how it names the experts
    items = [OutTensor(e.name, e.st_dtype, tuple(e.shape), e.nbytes, _sizing_only) for e in plan.entries]
    extra: dict[str, str | bytes] = {"config.json": mlx_config(ckpt, config, block), "README.md": model_card(ckpt)}
    rebuilt, lines = ckpt.rebuilt_files()  # a GGUF's tokenizer, as transformers writes it from tokenizer.ggml.*
    extra = {**rebuilt, **extra, **(beside or {})}
    plan.changes += [line for line in lines if not line.startswith("README.md")]  # mlx_lm's card is written
    from . import FORMAT

    recorded, lines = ckpt.carried_metadata() if ckpt.format is not FORMAT else ({}, [])  # a GGUF's Gemma norms:
    # back within 2**-24, not bit for bit (an MLX input's own record is made again: ``saved_as``)
    metadata.update(recorded)
    plan.changes += lines
    if len(plan_shards(items, shard, metadata)) == 1:  # mlx-lm writes an index even for one shard
        index = {"metadata": {"total_size": plan.total_bytes},
                 "weight_map": {e.name: "model.safetensors" for e in sorted(plan.entries, key=lambda e: e.name)}}
        extra["model.safetensors.index.json"] = json.dumps(index, indent=4)
    from .workers import start_pool

    pool = start_pool(jobs, started)
    try:
        return (estimate if pricing else execute)(plan, run.but(out=out, force=force, max_shard_size=shard,
                                                                metadata=metadata, desc="converting to mlx",
                                                                extra_files=extra))
    finally:
        if pool is not None:
            pool.close()


def _keep_quantized(ckpt: Checkpoint, out: Path, kept: list[dict], target_st, force, max_shard_size,
                    dry_run, run: Run = NO_RUN) -> dict:
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
    made = run.but(out=out, force=force, max_shard_size=max_shard_size or MAX_SHARD_SIZE,
                   metadata={**METADATA, **raw.metadata}, desc="copying mlx")
    if dry_run:
        return {**summary, "files": [], "plan": plan.describe(), **priced(plan, made)}
    return {**summary, "files": execute(plan, made)}
