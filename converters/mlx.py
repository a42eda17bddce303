"""MLX format: the model directories mlx-lm reads and writes (``mlx_lm.load`` / ``mlx_lm.convert``).

Export writes what ``mlx_lm.convert`` would, tensor by tensor: mlx-lm's names (routed experts stacked
into ``switch_mlp``, rotary buffers and tied heads dropped, see ``mlx_arch``), safetensors shards with
``{"format": "mlx"}`` metadata and an index, ``config.json`` as mlx-lm's ``save_config`` writes it, and the
tokenizer/generation files. With ``quantize`` each weight mlx-lm would quantize is packed with
``mx.quantize`` in row chunks, bit for bit what ``mlx_lm.convert`` writes: layers with ``to_quantized``
whose last dimension is a multiple of the group size, with the model's ``quant_predicate`` overrides;
the rest stay unquantized and the summary says so. Untouched tensors, and stacked experts, are byte
copies. Without ``quantize``/``dtype`` export is lossless (``mlx_lm.convert`` would also cast to a legacy
``torch_dtype`` in config.json; this only does so when quantizing, where it decides the scales' bits).

Reading (``open``) is ``mlx_view.MLXCheckpoint``: Hugging Face names, per-expert, dequantized.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ffn_tools.dtypes import DTYPE_CHOICES, USER_DTYPES, short_name
from ffn_tools.errors import FFNToolsError
from ffn_tools.plan import Entry, Plan, copy_entry, execute
from ffn_tools.store import Checkpoint, open_checkpoint
from ffn_tools.writer import OutTensor, plan_shards

from .mlx_arch import (DROPPED, TIE_KEY, Arch, added_metadata, added_tie_key, arch_for, head_is_tied, legacy_config,
                       quantize_override, wrong_form)

FORMAT = "mlx"
OPTIONS: frozenset[str] = frozenset({"quantize", "group_size"})
QUANT_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64  # mlx_lm.convert's default for affine quantization
MAX_SHARD_SIZE = 5 << 30  # mlx_lm's save_model shards at 5 GiB
METADATA = {"format": "mlx"}
_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_FLOATS = ("F32", "F16", "BF16", "F64")


def can_read(path: Path) -> bool:
    """A safetensors checkpoint whose metadata says "mlx", whose config has a ``quantization`` block, or
    whose names contain ``switch_mlp``. Plain Hugging Face checkpoints have none of these."""
    path = Path(path)
    try:
        if path.is_dir():
            if not any(path.glob("*.safetensors")):
                return False
        elif not path.name.endswith((".safetensors", ".safetensors.index.json")):
            return False
        with open_checkpoint(path) as raw:
            if raw.metadata.get("format") == "mlx" or isinstance((raw.config or {}).get("quantization"), dict):
                return True
            return any(".switch_mlp." in n for n in raw)
    except (FFNToolsError, OSError, ValueError):
        return False


def open(path: Path) -> Checkpoint:  # noqa: A001 - the converter surface's name
    """Open an MLX model directory as a lazy Hugging Face-named view (see ``mlx_view``).

    Raises:
        CheckpointError: no config.json, quantized weights without a ``quantization`` block, or
            tensors that do not fit it.
    """
    from .mlx_view import MLXCheckpoint

    return MLXCheckpoint(Path(path))


def _options(dtype: str | None, quantize: int | None, group_size: int | None) -> tuple[str | None, int | None, int]:
    target = None
    if dtype is not None:
        name = USER_DTYPES.get(str(dtype).lower().removeprefix("torch."))
        if name not in _ST:
            raise FFNToolsError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_CHOICES)}")
        target = _ST[name]
    if quantize is None:
        if group_size is not None:
            raise FFNToolsError("--group-size applies only with --quantize; add --quantize 4 or 8")
        return target, None, DEFAULT_GROUP_SIZE
    if int(quantize) not in QUANT_BITS:
        raise FFNToolsError(f"cannot quantize to {quantize} bits; use one of {', '.join(map(str, QUANT_BITS))}")
    group_size = DEFAULT_GROUP_SIZE if group_size is None else int(group_size)
    if group_size not in GROUP_SIZES:
        raise FFNToolsError(f"group size {group_size} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}")
    return target, int(quantize), group_size


def _collapse(names) -> str:
    """'model.layers.*.mlp.down_proj.weight (x2)' for model.layers.0/1.mlp.down_proj.weight."""
    counts: dict[str, int] = {}
    for n in names:
        p = re.sub(r"\.\d+\.", ".*.", n)
        counts[p] = counts.get(p, 0) + 1
    return ", ".join(p + (f" (x{c})" if c > 1 else "") for p, c in counts.items())


def _outputs(ckpt: Checkpoint, arch: Arch, config: dict, changes: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(mlx-lm name, input names stacked in order) for every output tensor, in input order.

    Raises:
        FFNToolsError: experts missing or mismatched (all listed).
    """
    names = list(ckpt)
    drop = {n for n in names if any(rx.fullmatch(n) for rx in DROPPED)}
    if drop:
        changes.append(f"dropped {_collapse(sorted(drop))}: mlx_lm recomputes rotary frequencies")
    if "lm_head.weight" in names and arch.tie == "always" and config.get("tie_word_embeddings") is False:
        raise FFNToolsError(f"{ckpt.path}: lm_head.weight is not tied to model.embed_tokens "
                            "(tie_word_embeddings false) but mlx_lm's model always ties them, so it would compute "
                            "different logits; tie the head or use another format")
    if "lm_head.weight" in names and head_is_tied(arch, config):
        drop.add("lm_head.weight")
        changes.append("dropped lm_head.weight: mlx_lm's model ties the output head to model.embed_tokens")
    groups: dict[str, dict[int, str]] = {}
    if arch.switch:
        rx = arch.switch.expert_pattern()
        for n in names:
            if m := rx.fullmatch(n):
                groups.setdefault(arch.switch.stacked_name(int(m["layer"]), m["proj"]), {})[int(m["expert"])] = n
    problems, member = [], {}
    for stacked, experts in groups.items():
        count = arch.switch.count(config) or max(experts) + 1
        missing = sorted(set(range(count)) - set(experts))
        extra = sorted(set(experts) - set(range(count)))
        if missing or extra:
            problems.append(f"{stacked}: expects experts 0..{count - 1}"
                            f"{'; missing ' + str(missing) if missing else ''}{'; unexpected ' + str(extra) if extra else ''}")
            continue
        srcs = tuple(experts[e] for e in range(count))
        first = ckpt.info(srcs[0])
        bad = [s for s in srcs if (ckpt.info(s).shape, ckpt.info(s).st_dtype) != (first.shape, first.st_dtype)]
        if bad:
            problems.append(f"{bad[0]}: {ckpt.info(bad[0]).st_dtype}{list(ckpt.info(bad[0]).shape)} differs from "
                            f"{srcs[0]} {first.st_dtype}{list(first.shape)}; experts must match to be stacked")
        member.update({s: (stacked, srcs) for s in srcs})
    if problems:
        raise FFNToolsError(f"{ckpt.path}: cannot stack routed experts: " + "; ".join(sorted(problems)))
    if groups:
        changes.append(f"stacked {len(member)} expert tensors into {len(groups)} switch_mlp tensors (E, out, in)")
    out, seen = [], set()
    for n in names:
        if n in drop:
            continue
        name, srcs = member.get(n, (n, (n,)))
        if name not in seen:
            seen.add(name)
            out.append((name, srcs))
    return out


def _plan_tensor(ckpt, arch: Arch, name: str, srcs: tuple[str, ...], target: str | None, bits: int | None,
                 group_size: int, qblock: dict, left: list, jobs: list) -> list[Entry]:
    """The entries of one output tensor: a byte copy/stack, a cast, or a quantized weight's three parts."""
    info = ckpt.info(srcs[0])
    st, stacked = info.st_dtype, len(srcs) > 1
    shape = (len(srcs), *info.shape) if stacked else info.shape
    cast = target if st in _FLOATS and target not in (None, st) else None
    how = f"stacked from {srcs[0]} .. {srcs[-1]}" if stacked else (f"from {srcs[0]}" if srcs[0] != name else "")
    quantizable = bits and st in _FLOATS and name.endswith(".weight") and len(shape) == (3 if stacked else 2)
    if quantizable and shape[-1] % group_size:
        left.append((name, shape[-1]))
    elif quantizable:
        from .mlx_quant import QuantJob, quantized_shapes

        module = name[: -len(".weight")]
        override = quantize_override(arch, module)
        if override:
            qblock[module] = override
        g, b = (override or {}).get("group_size", group_size), (override or {}).get("bits", bits)
        if shape[-1] % g:
            raise FFNToolsError(f"{name}: the model's quantization override {override} needs the last dimension "
                                f"({shape[-1]}) to be a multiple of {g}; mlx_lm.convert fails on it too")
        job = QuantJob(ckpt, srcs, shape, st, cast, g, b)
        jobs.append(job)
        wshape, sshape = quantized_shapes(shape, g, b)
        note = f"mx.quantize {b}-bit group {g}{' after cast to ' + cast if cast else ''} {how}".rstrip()
        return [Entry(f"{module}.{part}", dt, shp, (), lambda _, j=job, k=k: j.part(k), None, f"{part} of {note}")
                for k, (part, dt, shp) in enumerate((("weight", "U32", wshape), ("scales", cast or st, sshape),
                                                     ("biases", cast or st, sshape)))]
    if cast:
        from .mlx_quant import cast_fn, stream

        return [Entry(name, cast, shape, (), lambda _: stream(ckpt, srcs, [(cast, shape)], cast_fn(cast))[0], None,
                      f"cast {short_name(st)} -> {short_name(cast)} {how}".rstrip())]
    if not stacked:
        return [copy_entry(ckpt, srcs[0], name)]

    def stack(ts):
        import torch

        return torch.stack(ts)

    return [Entry(name, st, shape, srcs, stack, tuple((k, 0, info.nbytes) for k in range(len(srcs))), how)]


def mlx_config(ckpt: Checkpoint, config: dict, quantization: dict | None) -> str:
    """config.json as ``mlx_lm.convert`` writes it: generation_config's eos_token_id merged in (mlx-lm's
    ``load_config``), ``_name_or_path``/``vision_config`` dropped, ``quantization`` (and its copy
    ``quantization_config``) added, keys sorted, 4-space indent."""
    config = dict(config)
    gen = ckpt.root / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (ValueError, AttributeError):
            eos = None
        if eos:
            config["eos_token_id"] = eos
    config.pop("_name_or_path", None)
    config.pop("vision_config", None)
    if quantization is not None:
        config["quantization"] = config["quantization_config"] = quantization
    return json.dumps(dict(sorted(config.items())), indent=4)


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, quantize: int | None = None, group_size: int | None = None) -> dict:
    """Write ``ckpt`` as an MLX model directory ``out`` that ``mlx_lm.load`` opens.

    Args:
        dtype: cast floating tensors to float32/float16/bfloat16 (with MLX's ``astype``, as mlx-lm).
        quantize: bits (4 or 8; 2, 3, 5, 6 also work) for ``mx.quantize`` affine quantization.
        group_size: quantization group size (32, 64 or 128; default 64).

    Returns:
        Summary: output, format, model_type, files, tensors, bytes, dtype, quantization, quantized,
        unquantized (names left so), changes (human-readable lines).

    Raises:
        FFNToolsError: bad options, no config.json or an unsupported model_type, FFNs in a form mlx-lm
            cannot load, missing experts, an existing output.
    """
    out = Path(out)
    if out.suffix == ".safetensors":
        raise FFNToolsError(f"{out}: MLX models are directories (weights, config.json, tokenizer); "
                            "give a directory path to -o")
    target, bits, group_size = _options(dtype, quantize, group_size)
    model_type, arch = arch_for(ckpt.config, str(ckpt.path))
    config, changes = legacy_config(ckpt.config, arch)
    if bits and target is None:  # mlx_lm.convert casts to a legacy torch_dtype before quantizing
        legacy = config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
        if legacy in _ST:
            target = _ST[legacy]
            changes.append(f"cast floating tensors to {legacy} (config.json torch_dtype), as mlx_lm.convert does")
    if msg := wrong_form(arch, ckpt):
        raise FFNToolsError(f"{ckpt.path}: {msg}")
    if (tie := added_tie_key(arch, config, "lm_head.weight" in ckpt)) is not None:
        config[TIE_KEY] = tie
        changes.append(f"config.json: added {TIE_KEY} {str(tie).lower()} (the source has no such key; that is "
                       f"transformers' choice for {model_type}, and mlx-lm's default would differ); reading the "
                       "MLX model back drops it again")
    metadata = {**METADATA, **added_metadata(ckpt.config, config)}  # what reading back removes
    entries, qblock, left, jobs = [], {}, [], []
    for name, srcs in _outputs(ckpt, arch, config, changes):
        entries += _plan_tensor(ckpt, arch, name, srcs, target, bits, group_size, qblock, left, jobs)
    quantization = None
    if bits:
        quantization = {"group_size": group_size, "bits": bits, "mode": "affine", **qblock}
        n = sum(e.name.endswith(".scales") for e in entries)
        changes.append(f"quantized {n} weights with mx.quantize: {bits} bits, group size {group_size} (affine); "
                       "config.json gets the quantization block")
        for module, params in qblock.items():
            changes.append(f"{module}: {params}, the model's quant_predicate (as mlx_lm.convert)")
        for last in sorted({d for _, d in left}):
            changes.append(f"left unquantized, as mlx_lm.convert does (last dimension {last} is not a multiple of "
                           f"group size {group_size}): {_collapse(n for n, d in left if d == last)}")
    if dtype is not None:
        changes.append(f"floating tensors cast to {short_name(target)} with MLX's astype, as mlx_lm.convert --dtype")
    plan = Plan(ckpt, entries, None, changes)
    shard = max_shard_size or MAX_SHARD_SIZE
    items = [OutTensor(e.name, e.st_dtype, tuple(e.shape), e.nbytes, None) for e in entries]
    extra = {"config.json": mlx_config(ckpt, config, quantization)}
    if len(plan_shards(items, shard, metadata)) == 1:  # mlx-lm writes an index even for one shard
        index = {"metadata": {"total_size": plan.total_bytes},
                 "weight_map": {e.name: "model.safetensors" for e in sorted(entries, key=lambda e: e.name)}}
        extra["model.safetensors.index.json"] = json.dumps(index, indent=4)
    pool = None
    if jobs:
        from .mlx_quant import start_pool

        pool = start_pool(jobs)
    try:
        files = execute(plan, out, force=force, max_shard_size=shard, metadata=metadata, desc="converting to mlx",
                        extra_files=extra)
    finally:
        if pool is not None:
            pool.close()
    return {"output": str(out), "format": FORMAT, "model_type": model_type, "files": files,
            "tensors": len(entries), "bytes": plan.total_bytes, "dtype": short_name(target) if target else None,
            "quantization": quantization, "quantized": sum(e.name.endswith(".scales") for e in entries),
            "unquantized": [n for n, _ in left], "changes": changes}
