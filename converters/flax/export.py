"""Flax export as a plan: one ``Entry`` per tree leaf, run by ``plan.execute`` with ``MsgpackWriter``.

Reads as one straight line: ``build_plan`` (names and shapes checked, config decided) -> ``execute`` ->
the summary, its ``changes`` lines rendered from the plan (``changes``). Entries are named by tree path
(``model/layers/0/mlp/gate_proj/kernel``), so ``--dry-run`` lists what the tree will hold. A leaf that is its
input's bytes unchanged (norms, embeddings, biases, stacked expert tensors in the hf layout) is a byte copy
(``pieces``): the executor hands the writer input ranges, moved with ``copy_file_range``. A kernel is W.T, a
pure move; a cast is torch's ``.to``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ffn_tools.detect import find_ffns
from ffn_tools.errors import FFNToolsError, counted
from ffn_tools.extraction import role_ops  # one FFN's role as ``extract`` reads it
from ffn_tools.ffn import FFN
from ffn_tools.io.dtypes import FLOAT_ST, as_st, short_name
from ffn_tools.io.store import Checkpoint
from ffn_tools.ops import Cast, Copy, Take, Transpose
from ffn_tools.plan import Entry, Plan, dequantized_line, unquantized_config

from . import tree
from .config import ADDED_KEYS, added, restore_source_config, v4_config
from .writer import MsgpackWriter, tree_name

if TYPE_CHECKING:
    import torch

LAYOUTS = ("hf", "linen")
LINEN_NAMING = "params/layers_{L}[_experts_{E}|_shared_expert]/{gate,up,down}/{kernel,bias}"


def _out_dtype(st: str, dtype: torch.dtype | None) -> str:
    """The dtype a tensor stored as ``st`` is written in (floating ones cast to ``dtype``)."""
    return as_st(dtype) if dtype is not None and st in FLOAT_ST else st


def hf_entry(ckpt: Checkpoint, name: str, dtype: torch.dtype | None) -> tuple[Entry, tuple[str, ...]]:
    """Tensor ``name`` as a leaf of the hf tree (cast to ``dtype``): its entry, named by tree path, and that path
    (the Orbax export's hf layout writes the same tree)."""
    info = ckpt.info(name)
    path, transpose = tree.hf_path(name, len(info.shape))
    out = _out_dtype(info.st_dtype, dtype)
    cast = out != info.st_dtype
    shape = info.shape[::-1] if transpose else info.shape  # kernel = W.T: (out, in) -> (in, out)
    sources = ((info.st_dtype, tuple(info.shape)),)
    if not cast and not transpose:
        return Entry(tree_name(path), out, shape, (name,), (Copy(),), sources=sources, text=f"copy of {name}"), path
    ops = ((Cast(out, info.st_dtype),) if cast else ()) + ((Transpose(),) if transpose else ())  # a 2-D W: W.T
    how = [f"cast {short_name(info.st_dtype)} -> {short_name(out)}"] if cast else []
    how += ["transposed (kernel = W.T)"] if transpose else []
    return Entry(tree_name(path), out, shape, (name,), ops, sources=sources, text=f"{name}, {', '.join(how)}"), path


def _linen_entries(ckpt: Checkpoint, f: FFN, dtype: torch.dtype | None):
    prefix = tree.linen_subtree(f.ref.layer, f.ref.kind, f.ref.expert)
    out_st = _out_dtype(ckpt.info(f.names["down"]).st_dtype, dtype)
    inputs = tuple(dict.fromkeys(f.names.values()))
    h, i = f.d_model, f.d_ffn
    has = {r: f"{r}_bias" in f.names or (r != "down" and "gate_up_bias" in f.names) for r in tree.ROLES}
    for role in tree.ROLES:
        kernel = (i, h) if role == "down" else (h, i)  # (in, out)
        for leaf, shape in [("kernel", kernel)] + ([("bias", (kernel[1],))] if has[role] else []):
            key = role if leaf == "kernel" else f"{role}_bias"
            path = (*prefix, role, leaf)
            src = f.names.get(key) or f.names["gate_up_bias" if leaf == "bias" else "gate_up"]
            if leaf == "bias" and key in f.names and f.index is None and ckpt.info(src).st_dtype == out_st:
                sources = tuple((ckpt.info(n).st_dtype, tuple(ckpt.info(n).shape)) for n in inputs)
                yield Entry(tree_name(path), out_st, shape, inputs, (Take((inputs.index(src),)),), sources=sources,
                            text=f"{key} of {f.ref}: copy of {src}"), path
                continue
            info = ckpt.info(src)
            made = (*role_ops(f, key, src), Cast(out_st, info.st_dtype),
                    *((Transpose(),) if leaf == "kernel" else ()))  # kernel = W.T (in, out)
            how = "transposed (kernel = W.T)" if leaf == "kernel" else "as it is"
            yield Entry(tree_name(path), out_st, shape, (src,), made, sources=((info.st_dtype, tuple(info.shape)),),
                        text=f"{key} of {f.ref} ({src}), {how}"), path


def linen(ckpt: Checkpoint, dtype: torch.dtype | None, scheme, layout) -> tuple[list, list, dict]:
    """The linen layout's entries (named by tree path), their tree paths and its config.json (the FFNs' manifest):
    the Orbax export's nnx layout writes the same FFN trees as NNX states."""
    ffns = find_ffns(ckpt, scheme, layout)
    mixed = []
    for f in ffns.ffns:
        kinds = {n: ckpt.info(n).st_dtype for n in f.names.values()}
        if len(set(kinds.values())) > 1 and dtype is None:
            mixed.append(f"{f.ref}: " + ", ".join(f"{n} {short_name(d)}" for n, d in sorted(kinds.items())))
    if mixed:
        raise FFNToolsError(f"{ckpt.path}: the linen layout writes each FFN in one dtype but "
                            f"{'; '.join(mixed)}; pass --dtype to choose one")
    pairs = [pair for f in ffns.ffns for pair in _linen_entries(ckpt, f, dtype)]
    entries, paths = [e for e, _ in pairs], [p for _, p in pairs]
    chosen = ffns.ffns
    manifest = {
        "flax_layout": "linen", "source": str(ckpt.path), "scheme": ffns.scheme.name,
        "naming": f"{LINEN_NAMING}, kernels (in, out)",
        "activation": ffns.activation.config_name, "gated_unit": ffns.activation.unit,
        "dtype": "/".join(sorted({short_name(e.dtype) for e in entries})), "d_model": chosen[0].d_model,
        "d_ffn": sorted({f.d_ffn for f in chosen}), "layers": sorted({f.ref.layer for f in chosen}),
        "experts": sorted({f.ref.expert for f in chosen if f.ref.kind == "expert"}),
        "shared_expert": any(f.ref.kind == "shared" for f in chosen), "ffns": len(chosen), "tensors": len(entries),
    }
    config: dict[str, Any] = {"ffn_tools_manifest": manifest}
    if not ffns.activation.assumed:
        config["hidden_act"] = ffns.activation.config_name
    return entries, paths, config


def build_plan(ckpt: Checkpoint, flax_layout: str, dtype: torch.dtype | None, scheme=None, layout=None,
               with_config: bool = True) -> tuple[Plan, MsgpackWriter]:
    """The plan of a Flax export and the writer that lays it out (see ``converters.flax.export``).

    Args:
        with_config: the output is a directory, which gets config.json (a lone .msgpack file gets none).

    Raises:
        FFNToolsError: unknown layout, a name the layout cannot hold or that would be both an array and a
            subtree, mixed FFN dtypes (linen, without ``dtype``), no FFN found (linen).
    """
    if flax_layout not in LAYOUTS:
        raise FFNToolsError(f"unknown Flax layout {flax_layout!r}; use one of {', '.join(LAYOUTS)}")
    facts: dict[str, object] = {"layout": flax_layout}
    config: dict | None
    if flax_layout == "hf":
        pairs = [hf_entry(ckpt, n, dtype) for n in ckpt]
        entries, paths = [e for e, _ in pairs], [p for _, p in pairs]
        config = v4_config(unquantized_config(ckpt.config, dtype)[0])
    else:
        entries, paths, linen_config = linen(ckpt, dtype, scheme, layout)
        facts["ffns"] = linen_config["ffn_tools_manifest"]["ffns"]
        config = linen_config
    writer = MsgpackWriter(paths)  # checked before anything is written
    plan = Plan(ckpt, entries, config if with_config else None, summary=facts)
    plan.changes = changes(plan)
    return plan, writer


def _show(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _config_lines(source: dict | None, config: dict | None) -> list[str]:
    """What the plan's config.json changes from the source's, transformers-4 keys last."""
    if config is None:
        return []
    source, base = source or {}, restore_source_config(config)
    lines = [f"config.json: {k} removed" for k in source if k not in base]
    lines += [f"config.json: {k} set to {_show(v)}" for k, v in base.items() if k not in source or source[k] != v]
    v4 = added(config)
    if v4:
        lines.append(f"config.json: {', '.join(f'{k} {_show(config[k])}' for k in v4)} added, as transformers 4's "
                     f"Flax models read them (recorded in {ADDED_KEYS}; reading the export back removes them)")
    return lines


def changes(plan: Plan) -> list[str]:
    """The summary's ``changes`` lines, rendered from the plan: layout, config.json, casts."""
    ckpt = plan.source
    if plan.summary["layout"] == "hf":
        lines = ["layout hf: 2-D weights stored as kernel = W.T (in, out), embeddings as embedding"]
        lines += _config_lines(ckpt.config, plan.config)  # none for a lone .msgpack file
    else:
        lines = [f"layout linen: {counted(plan.summary['ffns'], 'FFN')} as "
                 f"{LINEN_NAMING.rsplit('/', 1)[0]}; other tensors not written"]
    cast = {e.st_dtype for e in plan.entries if any(ckpt.info(n).st_dtype != e.st_dtype for n in e.inputs)}
    if cast:
        lines.append(f"floating tensors cast to {'/'.join(sorted(short_name(d) for d in cast))}")
    return lines + dequantized_line(plan, "Flax")
