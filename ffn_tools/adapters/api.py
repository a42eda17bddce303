"""The adapter commands as library functions, each returning what its ``--json`` prints (see ``ffn_tools.api``):
``inspect``, ``relayout`` (split-gateup / fuse-gateup of an adapter), ``convert`` (to another adapter format) and
``merge`` (base + scale·B·A into a new checkpoint). ``verify`` of adapters is ``adapters.verify``.

The base model, where one is needed or given (``base``), is any checkpoint ffn-tools reads; its config.json tells
the adapter's architecture, its tensor names where the adapter's targets must land.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from ..envelope import envelope
from ..errors import counted
from ..io.dtypes import short_name
from ..io.output import atomic_output
from ..io.run import NO_RUN, Run
from . import formats
from .formats import base_config, load, no_base
from .conform import conform
from .model import Adapter, AdapterError, Lora
from .places import places

ROLE_ORDER = ("gate", "up", "gate_up", "down")


def _lora_text(lora: Lora) -> str:
    return f"r{lora.rank} x{lora.scale:g}"


def inspect(path, base=None, scheme=None) -> dict:
    """``ffn-tools inspect ADAPTER [--base BASE] --json``: what each LoRA targets (layer, expert, projection),
    its rank and scale, and with a base every FFN that gets no factors (or only zero ones)."""
    adapter = load(path, base)
    where = places(adapter.loras, adapter.config, scheme)
    rows, lines, others = [], [], []
    by_ffn: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for target, lora in adapter.loras.items():
        p = where.get(target)
        row = {"target": target, "rank": lora.rank, "scale": lora.scale, "alpha": lora.alpha,
               "dtype": short_name(lora.a.dtype), "shape": list(lora.shape)}
        if p is None:
            others.append(f"{target} {_lora_text(lora)}")
            rows.append({**row, "role": None})
            continue
        rows.append({**row, "layer": p.layer, "expert": p.expert, "experts": lora.experts, "role": p.role,
                     "kind": p.group.kind})
        if lora.experts is not None:
            ffn = f"layer {p.layer} experts 0-{lora.experts - 1} (stacked)"
        else:
            ffn = f"layer {p.layer}" + (f" expert {p.expert}" if p.expert is not None else "") + \
                (" shared expert" if p.group.kind == "shared" else "")
        by_ffn[ffn].append((ROLE_ORDER.index(p.role), f"{p.role} {_lora_text(lora)}"))
    ranks = sorted({lora.rank for lora in adapter.loras.values()})
    scales = sorted({lora.scale for lora in adapter.loras.values()})
    head = (f"{adapter.format} LoRA adapter: {counted(len(adapter.loras), 'target')} ({len(rows) - len(others)} FFN "
            f"projections, {len(others)} other), rank {'/'.join(map(str, ranks))}, scale "
            f"{'/'.join(f'{s:g}' for s in scales)}, {short_name(adapter.dtype)}")
    lines.append(head)
    lines += [f"  {ffn}: {', '.join(text for _, text in sorted(parts))}" for ffn, parts in by_ffn.items()]
    lines += [f"  other: {o}" for o in others]
    result: dict[str, Any] = {"format": adapter.format, "targets": rows}
    if base is not None:
        result["base"] = _coverage(adapter, base, scheme)
        lines += [f"  base: {result['base']['line']}"]
        lines += [f"    no factors: {x}" for x in result["base"]["without"]]
    return envelope("inspect", str(path), None, head, {**result, "lines": lines})


def _coverage(adapter: Adapter, base, scheme) -> dict:
    """Which FFNs of the base get factors: every FFN, each projection with a non-zero delta or not."""
    from ..detect import find_ffns

    with formats.open_checkpoint(Path(base)) as ckpt:
        adapter, changes = conform(adapter, {n: ckpt.info(n).shape for n in ckpt}, scheme)
        ffns = find_ffns(ckpt, scheme).ffns
    without, partial = [], []
    for f in ffns:
        got = []
        for role, name in f.names.items():
            lora = adapter.loras.get(name)
            if role.endswith("_bias") or lora is None:
                continue
            b = lora.b if f.index is None or lora.b.ndim == 2 else lora.b[f.index]
            if bool(b.count_nonzero()):
                got += ["gate", "up"] if role == "gate_up" else [role]
        if not got:
            without.append(str(f.ref))
        elif len(got) < 3:
            partial.append(f"{f.ref} ({'/'.join(got)} only)")
    line = (f"{len(ffns) - len(without)} of {counted(len(ffns), 'FFN')} get factors"
            + (f"; {len(partial)} only some projections" if partial else ""))
    return {"ffns": len(ffns), "with_factors": len(ffns) - len(without), "without": without, "partial": partial,
            "line": line, "changes": changes}


def _write(adapter: Adapter, to: str, out: Path, force: bool, base=None, run: Run = NO_RUN, **options) -> list[str]:
    fmt = formats.get(formats.named(to))
    root, config = base_config(adapter.path, base)
    if fmt.needs_base and config is None:
        raise AdapterError(f"{adapter.path}: converting to {fmt.name} needs the base model's config.json "
                           f"({fmt.name} adapters name the base's tensors as their runtime does), and "
                           f"{no_base(adapter.path, base)}: give the base model's directory with base=",
                           flags={"base=": "--base"})
    read = [adapter.path] + ([root / "config.json"] if root and (root / "config.json").is_file() else [])
    with atomic_output(out, inputs=[adapter.path] + ([root] if root else []), force=force, sources=read,
                       run=run) as tmp:
        return fmt.write(adapter, tmp, config or adapter.config, root, **options)


def relayout(command: str, path, out, *, stack_experts: bool = False, force: bool = False, base=None,
             scheme=None, dry_run: bool = False, run: Run = NO_RUN) -> dict:
    """``ffn-tools split-gateup|fuse-gateup ADAPTER -o OUT``: the adapter re-laid out (``adapters.relayout``),
    written as a PEFT adapter."""
    from .relayout import fuse, split

    adapter = load(path, base)
    new, changes = split(adapter, scheme) if command == "split-gateup" else fuse(adapter, stack_experts, scheme)
    out = Path(out) if out else Path(str(path).rstrip("/") + ("-split" if command == "split-gateup" else "-fused"))
    plan = [f"{t}  A{list(x.a.shape)} B{list(x.b.shape)} x{x.scale:g}" for t, x in new.loras.items()]
    if not dry_run:
        _write(new, "peft", out, force, base, run)
    verb = "would write" if dry_run else "wrote"
    line = f"{verb} {out}: PEFT adapter, {counted(len(new.loras), 'LoRA target')} (from {len(adapter.loras)})"
    return envelope(command, str(path), None if dry_run else out, line,
                    {"changes": changes, "plan": plan if dry_run else None, "targets": list(new.loras)})


def convert(path, to: str, out, *, base=None, force: bool = False, scheme=None, run: Run = NO_RUN, **options) -> dict:
    """``ffn-tools convert ADAPTER --to torch|mlx|gguf -o OUT [--base BASE]``: the adapter in another runtime's
    format (torch: PEFT), its factors' bytes unchanged wherever the format stores them as they are."""
    adapter = load(path, base)
    given = {k: v.lower() if k == "outtype" else v for k, v in options.items() if v is not None}
    name = formats.named(to)
    if given and set(given) - (formats.get(name).options if name in formats.names() else frozenset()):
        raise AdapterError(f"{', '.join(sorted(given))} do not apply to converting an adapter to {to}")
    written = _write(adapter, to, Path(out), force, base, run, **given)
    line = f"wrote {out}: {name} adapter, {counted(len(adapter.loras), 'LoRA target')}"
    return envelope("convert", str(path), out, line, {"files": written, "format": name})


def merge(base, path, out, *, force: bool = False, max_shard_size: int | None = None, scheme=None,
          run: Run = NO_RUN) -> dict:
    """``ffn-tools merge BASE ADAPTER -o OUT``: see ``adapters.merge``."""
    from .merge import merge as merging

    r = merging(Path(base), Path(path), Path(out), force=force, max_shard_size=max_shard_size, scheme=scheme, run=run)
    line = (f"wrote {out}: {counted(r['merged'], 'tensor')} merged (base + scale·B·A, float32, rounded once to "
            f"{r['dtype']}), {r['copied']} copied")
    return envelope("merge", [str(base), str(path)], out, line, r)


def verify(a, b, *, tokens: int = 32, seed: int = 0, scheme=None, base=None, backends=None):
    """``ffn-tools verify BASE+ADAPTER MERGED`` or ``verify ADAPTER ADAPTER2``: the report (``adapters.verify``).

    Raises:
        AdapterError: one side is an adapter and the other neither an adapter nor BASE+ADAPTER.
    """
    from .verify import looks_like, verify_adapters, verify_merge

    if looks_like(str(a)):
        base_path, _, adapter = str(a).rpartition("+")
        return verify_merge(Path(base_path), Path(adapter), Path(b), tokens=tokens, seed=seed, scheme=scheme,
                            backends=backends)
    if formats.is_adapter(a) and formats.is_adapter(b):
        if backends:
            raise AdapterError("backends= runs FFNs: it applies to verify BASE+ADAPTER MERGED, not to two adapters "
                               "(whose deltas are compared)", flags={"backends=": "--backend"})
        return verify_adapters(Path(a), Path(b), base=base, scheme=scheme)
    raise AdapterError(f"verify of an adapter: give BASE+ADAPTER and the merged checkpoint, or two adapters "
                       f"({a} and {b} are neither)")
