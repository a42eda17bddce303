"""``prune-experts`` and ``reorder-experts`` as library functions: each returns what its ``--json`` prints."""

from __future__ import annotations

import json
from pathlib import Path

from ..detect import find_ffns
from ..envelope import envelope
from ..errors import FFNToolsError
from ..executor import execute
from ..io.receipt import record
from ..io.run import Run
from ..io.shards import like_input
from ..io.writer import SAFETENSORS
from . import mapping
from .layers import moe_layers
from .planning import surgery_plan
from .routers import updated_config
from .selection import chosen, kept_share

STORED_KINDS = ("safetensors", "mlx")  # tensors stored as safetensors bytes: what the plan moves


def prune_experts(path, out, *, keep: str | None = None, drop: str | None = None, saliency: str | None = None,
                  keep_ratio: float | None = None, score: str = "reap", force: bool = False, dry_run: bool = False,
                  max_shard_size: int | None = None, scheme=None, layout=None) -> dict:
    """``ffn-tools prune-experts PATH -o OUT --keep SPEC | --drop SPEC | --saliency FILE --keep-ratio R --json``:
    each MoE layer's experts ``keep`` (or all but ``drop``, or the top ``keep_ratio`` by ``score`` in the scores
    file ``saliency``), renumbered in order; see ``ffn_tools.surgery``."""
    spec = dict(keep=keep, drop=drop, saliency=saliency, keep_ratio=keep_ratio, score=score)
    given = {"path": path, "out": out, **spec, "max_shard_size": max_shard_size}
    return _surgery("prune-experts", path, out, given, spec, force, dry_run, max_shard_size, scheme, layout)


def reorder_experts(path, out, *, order: str, force: bool = False, dry_run: bool = False,
                    max_shard_size: int | None = None, scheme=None, layout=None) -> dict:
    """``ffn-tools reorder-experts PATH --order FILE -o OUT --json``: each MoE layer's experts in the order
    ``order`` gives (a permutation per layer); the same function exactly."""
    given = {"path": path, "out": out, "order": order, "max_shard_size": max_shard_size}
    return _surgery("reorder-experts", path, out, given, dict(order=order), force, dry_run, max_shard_size,
                    scheme, layout)


def _surgery(command: str, path, out, given: dict, spec: dict, force: bool, dry_run: bool,
             max_shard_size: int | None, scheme, layout) -> dict:
    from ..formats import registry
    from ..hub import resolve

    with registry().open_any(resolve(str(path))) as ckpt:
        if ckpt.kind == "gguf":
            return _gguf(command, ckpt, out, given, spec, force, dry_run, max_shard_size)
        if ckpt.kind not in STORED_KINDS:
            raise FFNToolsError(f"{ckpt.path}: {ckpt.described} checkpoint: expert surgery moves safetensors "
                                "tensors (or a GGUF's _exps stacks)")
        layers = moe_layers(ckpt, find_ffns(ckpt, scheme, layout))
        stored = ckpt.stored  # the tensors as stored (a view reading them otherwise: MLX's stacks, FP8 decoded)
        counts = {m.experts for m in layers.values()}
        if len(counts) > 1:
            raise FFNToolsError(f"{ckpt.path}: MoE layers hold different numbers of experts ({sorted(counts)})")
        experts = counts.pop()
        picked = chosen({k: m.experts for k, m in layers.items()}, **spec)
        kept = len(next(iter(picked.values())))
        config, changes = updated_config(stored.config, experts, kept)
        plan = surgery_plan(stored, layers, picked, config, changes)
        identity = all(v == tuple(range(experts)) for v in picked.values())
        full, source_experts = mapping.composed(mapping.recorded(stored), picked)
        kept_map = mapping.as_json(full, source_experts or experts, command)
        text = json.dumps(kept_map)
        max_shard_size, sharded = like_input(ckpt.files, Path(out), max_shard_size)
        plan.changes.extend([sharded] if sharded else [])
        run = Run(command=record(command, given)).but(
            out=Path(out), force=force, max_shard_size=max_shard_size, desc=command,
            metadata=None if identity else {**stored.metadata, mapping.METADATA_KEY: text},
            extra_files=None if identity or Path(out).suffix == SAFETENSORS.suffix else {mapping.FILE: text + "\n"})
        written = [] if dry_run else execute(plan, run)
        verb = "would write" if dry_run else "wrote"
        line = (f"{verb} {out}: {len(layers)} MoE layers, {kept} of {experts} experts each"
                + (" (reordered)" if kept == experts and not identity else "") + f", {len(plan.entries)} tensors")
        result = {"experts": experts, "kept": kept, "layers": kept_map["layers"], "changes": plan.changes,
                  **_routing_kept(spec, picked, plan.changes), "files": written, "dry_run": dry_run,
                  "plan": plan.describe() if dry_run else None, **plan.summary}
        return envelope(command, str(path), None if dry_run else out, line, result)


def _routing_kept(spec: dict, picked, changes: list[str]) -> dict:
    """With ``--saliency``: ``{"kept_share": ...}``, what the ``picked`` experts keep of each score of the scores
    they were ranked on, per layer (``kept_share``), the least kept frequency said in ``changes``; else {}."""
    if not spec.get("saliency"):
        return {}
    share = kept_share(spec["saliency"], picked)
    worst = min(share, key=lambda k: share[k].get("frequency", 1.0))
    changes.append(f"routing kept (of the scores' tokens): layer {worst} keeps "
                   f"{share[worst].get('frequency', 1.0):.1%} of its routing frequency, the least")
    return {"kept_share": share}


def _gguf(command: str, ckpt, out, given: dict, spec: dict, force: bool, dry_run: bool,
          max_shard_size: int | None) -> dict:
    """The surgery of a GGUF file (``gguf``): its expert slabs sliced as stored, into the GGUF file ``out``."""
    from ..io.output import atomic_output
    from .gguf import prune_gguf

    out = Path(out)
    if len(ckpt.files) > 1:
        raise FFNToolsError(f"{ckpt.path}: a split GGUF ({len(ckpt.files)} files): join it first (llama.cpp's "
                            "gguf-split --merge); expert surgery writes one file")
    if max_shard_size is not None:
        raise FFNToolsError("--max-shard-size does not apply to a GGUF output: a GGUF is one file")
    if out.suffix != ".gguf":
        raise FFNToolsError(f"{out}: a GGUF input's surgery writes one file named *.gguf")
    source, reader = Path(ckpt.files[0]), ckpt.readers[0]  # its header as the checkpoint parsed it
    prior = mapping.recorded(ckpt)  # a GGUF's mapping key, read as the checkpoint's metadata
    if dry_run:
        r = prune_gguf(reader, source, None, spec, command, prior)
    else:
        run = Run(command=record(command, given))
        with atomic_output(out, inputs=[source], force=force, run=run) as tmp:
            r = prune_gguf(reader, source, tmp, spec, command, prior)
    kept, experts = r["kept"], r["experts"]
    verb = "would write" if dry_run else "wrote"
    line = (f"{verb} {out}: {r['moe_layers']} MoE layers, {kept} of {experts} experts each"
            + (" (reordered)" if kept == experts and not r["identity"] else "")
            + f", {r['tensors']} tensors ({r['sliced']} sliced as stored bytes)")
    result = {"experts": experts, "kept": kept, "layers": r["layers"], "changes": r["changes"],
              **_routing_kept(spec, r["picked"], r["changes"]), "files": [] if dry_run else [str(out)],
              "dry_run": dry_run, "plan": None,
              "experts_dropped": r["moe_layers"] * (experts - kept),
              "experts_moved": r["moved"]}
    return envelope(command, str(ckpt.path), None if dry_run else str(out), line, result)
