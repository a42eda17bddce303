"""``inspect``: what a checkpoint holds, as a dict (printed as text or JSON by the CLI)."""

from __future__ import annotations

from collections import Counter, defaultdict

from .detect import FFNSet, find_ffns
from . import mtp
from .io.dtypes import short_name
from . import quant
from .quant.fp8 import is_companion
from .layouts import GateUpLayout
from .registry import Scheme
from .io.store import Checkpoint, config_dtype


def tensor_table(ckpt: Checkpoint, ffns: FFNSet) -> list[dict]:
    """Every tensor: name, dtype, shape, bytes, and its role (``layer 3 expert 5: gate_up``, ``outside``, or
    ``FFN-like, unmatched``)."""
    roles: dict[str, str] = {}
    for f in ffns.ffns:
        for role, name in f.names.items():  # a stacked tensor holds every expert of its layer
            roles[name] = f"{f.ref}: {role}" if f.index is None else f"layer {f.ref.layer} {f.ref.kind}s, stacked: {role}"
    unmatched = set(ffns.unmatched)
    out = []
    for name in ckpt:
        info = ckpt.info(name)
        role = roles.get(name) or ("FFN-like, unmatched" if name in unmatched else "outside")
        out.append({"name": name, "dtype": short_name(info.st_dtype), "shape": list(info.shape),
                    "bytes": info.nbytes, "role": role})
    return out


def format_tensors(rows: list[dict]) -> list[str]:
    """The tensor table as aligned text lines."""
    width = max((len(r["name"]) for r in rows), default=4)
    lines = [f"{'tensor':<{width}}  {'dtype':<8} {'shape':<20} {'bytes':>10}  role"]
    for r in rows:
        lines.append(f"{r['name']:<{width}}  {r['dtype']:<8} {str(r['shape']):<20} {r['bytes']:>10}  {r['role']}")
    return lines


def inspect_checkpoint(ckpt: Checkpoint, scheme: Scheme | None = None, layout: GateUpLayout | None = None,
                       tensors: bool = False) -> dict:
    """Describe a checkpoint and its FFNs.

    Returns:
        architecture, scheme, layers, routed/shared experts, d_model, d_ffn per kind, layout per kind,
        activation, dtypes, shards, total bytes, FFN tensor counts per kind, and the tensors outside
        any FFN (count and bytes); with ``tensors``, ``tensor_table`` lists every tensor and its role.

    Raises:
        SchemeError: no FFN found (see ``find_ffns``).
    """
    ffns: FFNSet = find_ffns(ckpt, scheme, layout)
    config = ckpt.config or {}
    kinds: dict[str, dict] = {}
    per_kind = defaultdict(list)
    heads = mtp.find_heads(ckpt, config)  # MTP heads: listed apart, their FFNs not counted as the main layers'
    in_heads = mtp.head_tensors(heads)
    main = [f for f in ffns.ffns if f.names["down"] not in in_heads]
    for f in main:
        per_kind[f.ref.kind].append(f)
    for kind, fs in per_kind.items():
        forms = Counter(f.form_name for f in fs)
        layouts = sorted({f.layout.describe() for f in fs if f.form.fused})
        names = {n for f in fs for n in f.names.values()}
        kinds[kind] = {
            "count": len(fs),
            "layers": len({f.ref.layer for f in fs}),
            "d_ffn": sorted({f.d_ffn for f in fs}),
            "forms": dict(forms),
            "layout": ("stacked experts, " if forms.get("stacked") or forms.get("stacked-separate") else "")
                      + ("separate" if not layouts else "fused (" + "; ".join(layouts) + ")"
                         + (" and separate" if forms.get("separate") else "")),
            "bias": any(f.has_bias for f in fs),
            "tensors": len(names),
        }
    experts = per_kind.get("expert", [])
    outside = [n for n in ckpt if n not in ffns.tensors and not is_companion(n, ffns.tensors)]
    return {
        "path": str(ckpt.path),
        "format": ckpt.label,
        "architecture": (config.get("architectures") or [config.get("model_type", "unknown")])[0],
        "model_type": config.get("model_type"),
        "scheme": ffns.scheme.name,
        "scheme_description": ffns.scheme.description,
        "layers": len({f.ref.layer for f in main}),
        "config_layers": config.get("num_hidden_layers"),
        "routed_experts": len({f.ref.expert for f in experts}),
        "shared_experts": 1 if "shared" in per_kind else 0,
        "d_model": sorted({f.d_model for f in ffns.ffns}),
        "ffn": kinds,
        "activation": ffns.activation.describe(),
        "gated_unit": ffns.activation.unit,
        "dtypes": dict(Counter(short_name(ckpt.info(n).st_dtype) for n in ckpt)),
        "quantized": quant.describe(ckpt),
        "config_dtype": config_dtype(ckpt.config),
        "shards": [str(f.name) for f in ckpt.files],
        "total_bytes": ckpt.total_bytes,
        "tensors": len(ckpt),
        "ffn_tensors": len(ffns.tensors),
        "outside_ffn": {"count": len(outside), "bytes": sum(ckpt.info(n).nbytes for n in outside)},
        "unmatched_ffn_like": list(ffns.unmatched),
        "mtp": [_head(ckpt, h, ffns) for h in heads],
        "mtp_count": mtp.check_count(heads, config, ckpt.metadata),  # config and tensors disagree (transformers'
        # save drops a head its config still declares): said, not a warning
        "warnings": [w] if (w := ffns.unmatched_warning()) else [],
        **({"tensor_table": tensor_table(ckpt, ffns)} if tensors else {}),
    }


def _head(ckpt: Checkpoint, head: mtp.Head, ffns: FFNSet) -> dict:
    """An MTP head as ``inspect`` lists it: its name, layout, blocks, FFNs per kind, own modules, tensors, bytes."""
    inside = set(head.tensors)
    kinds = Counter(f.ref.kind for f in ffns.ffns if f.names["down"] in inside)
    return {"name": head.name, "layout": head.layout.name, "blocks": list(head.blocks), "ffn": dict(kinds),
            "own": head.own(), "tensors": len(head.tensors), "bytes": sum(ckpt.info(n).nbytes for n in head.tensors)}


def format_summary(s: dict) -> list[str]:
    """Human-readable lines for an ``inspect_checkpoint`` result."""
    from .errors import counted
    from .sizes import human

    lines = [
        f"{s['path']}  ({s['format']}, {counted(len(s['shards']), 'shard')}, {human(s['total_bytes'])}, {counted(s['tensors'], 'tensor')})",
        f"  architecture  {s['architecture']}  (model_type {s['model_type']})",
        f"  scheme        {s['scheme']}: {s['scheme_description']}",
        f"  layers        {s['layers']}" + (f" (config: {s['config_layers']})" if s["config_layers"] not in (None, s["layers"]) else ""),
        f"  experts       {s['routed_experts']} routed, {s['shared_experts']} shared",
        f"  d_model       {', '.join(map(str, s['d_model']))}",
        f"  activation    {s['activation']}",
        f"  dtypes        {', '.join(f'{k} x{v}' for k, v in s['dtypes'].items())}"
        + (f"  (config: {s['config_dtype']})" if s["config_dtype"] else ""),
    ]
    for kind, k in s["ffn"].items():
        lines.append(f"  {kind:<13} {counted(k['count'], 'FFN')} in {counted(k['layers'], 'layer')}, d_ffn "
                     f"{', '.join(map(str, k['d_ffn']))}, {k['layout']}{', with biases' if k['bias'] else ''}, "
                     f"{counted(k['tensors'], 'tensor')}")
    for q in s.get("quantized") or []:
        how = q.get("how", "split, fuse and extract move it with its weight")
        lines.append(f"  quantized     {counted(q['weights'], 'weight')} {q['dtype']}, one _{q['scales']} per {q['block'][0]}x"
                     f"{q['block'][1]} block ({how})")
    for h in s.get("mtp") or []:
        ffn = ", ".join(f"{counted(n, kind + ' FFN')}" for kind, n in h["ffn"].items()) or "no FFN"
        lines.append(f"  mtp head      {h['name']} ({h['layout']}, not a main layer): {ffn}, "
                     f"{', '.join(h['own']) or 'no own modules'}; {counted(h['tensors'], 'tensor')}, {human(h['bytes'])}")
    if s.get("mtp_count"):
        lines.append(f"  mtp heads     {s['mtp_count']}")
    o = s["outside_ffn"]
    lines.append(f"  outside FFNs  {counted(o['count'], 'tensor')}, {human(o['bytes'])}")
    lines += [f"  warning       {w}" for w in s["warnings"]]
    return lines
