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
from functools import partial
from pathlib import Path
from typing import NoReturn, TypedDict

from ffn_tools.io.dtypes import DTYPE_CHOICES, USER_DTYPES, short_name
from ffn_tools.errors import FFNToolsError, listing
from ffn_tools.plan import Entry, Plan, copy_entry, execute
from ffn_tools.ctview import CompressedView
from ffn_tools.io.store import Checkpoint, Format
from ffn_tools.io.writer import OutTensor, plan_shards

from . import names as mlx_names
from .card import model_card
from .config import added_metadata, mlx_config
from .models import TIE_KEY, Target, parameters, target
from .recipe import decide, resolve

FORMAT = "mlx"
MAX_SHARD_SIZE = 5 << 30  # mlx_lm's save_model shards at 5 GiB
METADATA = {"format": "mlx"}
_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


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


def _views(ckpt: Checkpoint):
    """The input as the model may want it: as it is, FFNs split, FFNs fused (name, entries)."""
    yield "as it is", [copy_entry(ckpt, n) for n in ckpt]
    from ffn_tools.detect import find_ffns
    from ffn_tools.errors import NothingToDoError
    from ffn_tools.gateup import plan_fuse, plan_split

    try:
        ffns = find_ffns(ckpt)
    except FFNToolsError:
        return
    stacked = partial(plan_fuse, stack_experts=True)
    for label, fn in (("with gate_up split", plan_split), ("with gate/up fused", plan_fuse),
                      ("with gate/up fused and experts stacked", stacked)):
        try:
            yield label, fn(ckpt, ffns).entries
        except NothingToDoError:
            continue
        except FFNToolsError:
            continue
    if any(f.form.transposed for f in ffns.ffns):
        yield "with stacked experts turned to (E, out, in) .weight", _out_in(ckpt, ffns)


def _out_in(ckpt: Checkpoint, ffns) -> list[Entry]:
    """Stacked experts stored (E, in, out) (transformers' GPT-OSS) as OpenAI's layout, (E, out, in) named
    ``.weight``, which mlx_lm's GPT-OSS sanitize reads; everything else as it is."""
    turned = {f.names[r] for f in ffns.ffns if f.form.transposed and f.index is not None for r in ("gate_up", "down")
              if r in f.names}
    out = []
    for n in ckpt:
        if n not in turned:
            out.append(copy_entry(ckpt, n))
            continue
        info = ckpt.info(n)
        out.append(Entry(f"{n}.weight", info.st_dtype, (info.shape[0], info.shape[2], info.shape[1]), (n,),
                         lambda ts: ts[0].transpose(1, 2).contiguous(), None, f"{n} turned to (E, out, in)"))
    return out


def _problems(tg: Target, outputs, ckpt: Checkpoint) -> tuple[list[str], list[str], int]:
    """(what does not match the model's parameters, changes, how many tensors that is) for one view's outputs."""
    got = {o.name: o.shape for o in outputs}
    missing = sorted(set(tg.params) - set(got))
    extra = sorted(set(got) - set(tg.params))
    changes = []
    if extra == [HEAD] and HEAD not in tg.params and EMBED in ckpt and HEAD in ckpt:
        same = ckpt.info(HEAD).shape == ckpt.info(EMBED).shape and _bytes(ckpt, HEAD) == _bytes(ckpt, EMBED)
        if same:
            extra = []
            changes.append(f"dropped {HEAD}: it equals {EMBED} byte for byte, and mlx_lm's {tg.module} model ties "
                           "its output head to the embedding")
        else:
            return [f"{HEAD} differs from {EMBED} but mlx_lm's {tg.module} model always ties its output head to the "
                    "embedding, so it would compute different logits; tie the head or use another format"], [], 1
    bad = [f"{n}: {list(got[n])}, model wants {list(tg.params[n])}" for n in sorted(got)
           if n in tg.params and tuple(got[n]) != tuple(tg.params[n])]
    out = []
    if missing:
        out.append(f"missing {len(missing)} parameter(s) mlx_lm's {tg.module} model has: {listing(missing)}")
    if extra:
        out.append(f"{len(extra)} tensor(s) mlx_lm's {tg.module} model has no parameter for: {listing(extra)}")
    if bad:
        out.append(f"{len(bad)} shape(s) differ: {listing(bad)}")
    return out, changes, len(missing) + len(extra) + len(bad)


def _bytes(ckpt: Checkpoint, name: str) -> bytes:
    return bytes(ckpt.read_raw(name))


def _match(ckpt: Checkpoint, where: str) -> tuple[Target, list[Entry], list, list[str], list[str]]:
    """mlx_lm's model and the first view of the input that gives exactly its parameters (else the problems
    of the view closest to them).

    Returns:
        (target, view entries, outputs, unused view names, changes).

    Raises:
        FFNToolsError: no view fits (what the plain input lacks or has too much, all listed).
    """
    tg = target(ckpt.config, where, has_head=HEAD in ckpt)
    closest: tuple[float, list[str]] = (float("inf"), [])
    for label, entries in _views(ckpt):
        shapes = {e.name: (tuple(e.shape), e.st_dtype) for e in entries}
        tg.model, tg.prequant = tg.fresh(), None
        try:
            outputs, unused = mlx_names.map_outputs(tg.model, shapes)
        except FFNToolsError as e:
            closest = min(closest, (float("inf") if closest[1] else 10**9, [str(e)]))
            continue
        tg.params = parameters(tg.model)  # sanitize may change the model (Gemma 3 drops its unused lm_head)
        _prequantized(tg, outputs)
        problems, changes, n = _problems(tg, outputs, ckpt)
        if not problems:
            if label != "as it is":
                changes.insert(0, f"FFNs {label.removeprefix('with ')} for mlx_lm's {tg.module} model "
                                  "(byte copies, as split-gateup/fuse-gateup do)")
            return tg, entries, outputs, unused, changes
        closest = min(closest, (n, problems))
    raise FFNToolsError(f"{where}: does not fit mlx_lm's {tg.module} model (mlx_lm.load would refuse it): "
                        + "; ".join(closest[1]))


class _Prequant(TypedDict):
    group_size: int
    bits: int
    mode: str


# quantization_config methods mlx_lm.load keeps quantized, as its load_model maps them (mode, group, bits)
PREQUANTIZED: dict[str, _Prequant] = {"mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
                "mxfp8": {"group_size": 32, "bits": 8, "mode": "mxfp8"}}


def _prequantized(tg: Target, outputs) -> None:
    """As ``mlx_lm.load`` does for a checkpoint quantized in a form MLX runs (GPT-OSS's MXFP4): quantize the
    lazy model's modules whose ``.scales`` sanitize produced, so its parameters are the packed ones; the
    config then carries mlx_lm's ``quantization`` block (``tg.prequant``)."""
    method = ((tg.config.get("quantization_config") or {}) if isinstance(tg.config.get("quantization_config"), dict)
              else {}).get("quant_method")
    names = {o.name for o in outputs}
    if method not in PREQUANTIZED or not any(n.endswith(".scales") for n in names):
        return
    import mlx.nn as nn

    q = PREQUANTIZED[method]
    nn.quantize(tg.model, q["group_size"], q["bits"], mode=q["mode"],
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in names)
    tg.params, tg.prequant = parameters(tg.model), dict(q)


def _match_or_dequantize(ckpt: Checkpoint, quantizing: bool = False):
    """``_match`` on the input as it is (models whose sanitize reads FP8 scales, as DeepSeek-V3's, dequantize
    it themselves; MXFP4 experts, read dequantized by default, are tried first as stored, which mlx_lm keeps
    MXFP4 unless ``quantizing``); failing that, on the input with its FP8 weights dequantized
    (``scales.Dequantized``).

    Returns:
        ``_match``'s result, then the checkpoint the plan reads.
    """
    from ffn_tools.scales import Dequantized, describe

    mxfp4 = [d["weights"] for d in ckpt.decoded() if d["dtype"] == "MXFP4"]
    if mxfp4 and not quantizing:
        try:
            found = _match(ckpt.stored, str(ckpt.path))
            if found[0].prequant:
                found[4].insert(0, f"kept {mxfp4[0]} MXFP4 tensors as MLX's own mxfp4 (as mlx_lm.load does)")
                return (*found, ckpt.stored)
        except FFNToolsError:
            pass
    try:
        return (*_match(ckpt, str(ckpt.path)), ckpt)
    except FFNToolsError:
        scaled = describe(ckpt)
        if not scaled:
            raise
    deq = Dequantized(ckpt)
    found = _match(deq, str(ckpt.path))
    n = sum(q["weights"] for q in scaled)
    found[4].insert(0, f"dequantized {n} {scaled[0]['dtype']} weights (times their _{scaled[0]['scales']}) to "
                       f"float32: mlx_lm's {found[0].module} model has no FP8 form (pass --dtype to store them "
                       "smaller, -q to quantize)")
    return (*found, deq)


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
    kept = [q for q in ckpt.decoded() if ckpt.format is Format.MLX]
    if kept and not quant and not dequantize:
        return _keep_quantized(ckpt, out, kept, target_st, force, max_shard_size, dry_run)
    tg, view, outputs, unused, changes, ckpt = _match_or_dequantize(ckpt, quantizing=bool(quant))
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
    ct_kept: dict = {}  # --- compressed-tensors input: group-wise int codes kept as MLX affine (from_ct) ---
    if isinstance(ckpt, CompressedView):
        config.pop("quantization_config", None)  # compressed-tensors' own: mlx_lm reads only its block
        if not quant and not dequantize:
            from . import from_ct

            ct_kept, refused = from_ct.kept(ckpt, outputs, view)
            if target_st is not None:  # scales and biases would be cast: the codes' values change
                ct_kept, refused = {}, {n: "--dtype given" for n in ckpt.modules}
            block = from_ct.block(ct_kept) or block
            changes += from_ct.changes(ct_kept, refused)
        else:
            changes.append(f"read {len(ckpt.modules)} quantized weights dequantized"
                           + (" (-d)" if dequantize else ", then quantized as asked"))

    from .tensors import plan_outputs

    entries, jobs = plan_outputs(ckpt, tg, view, outputs, target_st, chosen, d.shapes if d else {})
    if ct_kept and isinstance(ckpt, CompressedView):
        from .from_ct import replace

        entries = replace(ckpt, entries, ct_kept)
    if quant and d:
        n = sum(e.name.endswith(".scales") for e in entries)
        changes.append(f"quantized {n} weights with mx.quantize: {quant.bits} bits, group size {quant.group_size} "
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
    summary = {"output": str(out), "format": FORMAT, "model_type": config.get("model_type"), "mlx_model": tg.module,
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
    if ckpt.format is Format.GGUF:  # its tokenizer is tokenizer.ggml.*: as transformers writes it from there
        from ffn_tools.converters.gguf import side_files
        from ffn_tools.converters.gguf.record import plus_one_record

        rebuilt, said = side_files(ckpt)
        extra = {**rebuilt, **extra}
        changes += said
        recorded, said = plus_one_record(ckpt)  # Gemma's norms: back within 2**-24, not bit for bit
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


def mlx_entries(ckpt: Checkpoint) -> tuple[Checkpoint, dict[str, Entry], set[str]]:
    """``ckpt``'s tensors as mlx_lm's model holds them, unquantized and uncast (what ``verify`` pairs an MLX B
    with): the checkpoint the entries read, output name -> entry, and the input names the model's sanitize
    does not carry over by name (dropped, or used for a computed tensor).

    Raises:
        FFNToolsError: ``ckpt`` does not export to MLX (no mlx_lm model for its config, a misfit).
    """
    tg, view, outputs, unused, _, source = _match_or_dequantize(ckpt)
    from .tensors import plan_outputs

    entries, _ = plan_outputs(source, tg, view, outputs, None, {}, {})
    return source, {e.name: e for e in entries}, set(unused)


def _keep_quantized(ckpt: Checkpoint, out: Path, kept: list[dict], target_st, force, max_shard_size,
                    dry_run) -> dict:
    """An MLX-quantized input exported without -q or -d: kept as it is stored, every tensor copied byte for
    byte with its config.json (``mlx_lm.convert`` keeps a quantized model quantized), not silently
    dequantized."""
    if target_st is not None:
        raise FFNToolsError(f"{ckpt.path}: is MLX-quantized; --dtype would cast its scales: pass -d/--dequantize to "
                            "write it dequantized in that dtype, or -q to re-quantize")
    from .view import MLXCheckpoint

    raw = ckpt.raw if isinstance(ckpt, MLXCheckpoint) else ckpt  # the files as stored, packed weights included
    entries = [copy_entry(raw, n) for n in raw]
    what = ", ".join(f"{q['weights']} weights {q['dtype']}" for q in kept)
    changes = [f"kept the input's quantization ({what}): every tensor copied byte for byte, as mlx_lm.convert keeps "
               "a quantized model quantized (-d/--dequantize writes it dequantized, -q re-quantizes)"]
    plan = Plan(raw, entries, dict(raw.config or {}), changes)
    summary = {"output": str(out), "format": FORMAT, "model_type": (raw.config or {}).get("model_type"),
               "mlx_model": None, "tensors": len(entries), "bytes": plan.total_bytes, "dtype": None,
               "quantization": (raw.config or {}).get("quantization"), "quantized": sum(q["weights"] for q in kept),
               "unquantized": [], "changes": changes}
    if dry_run:
        return {**summary, "files": [], "plan": plan.describe()}
    files = execute(plan, out, force=force, max_shard_size=max_shard_size or MAX_SHARD_SIZE,
                    metadata={**METADATA, **raw.metadata}, desc="copying mlx")
    return {**summary, "files": files}
