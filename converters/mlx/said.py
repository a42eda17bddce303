"""What an MLX export says it did, one line each, from its decisions: the config keys it added or renamed, what
mlx_lm's sanitize drops, stacks and computes, what it quantized and left, the cast."""

from __future__ import annotations

import re

from ffn_tools.errors import counted
from ffn_tools.io.dtypes import short_name

from .matching import HEAD
from .models import TIE_KEY, Target


def collapse(names) -> str:
    """'model.layers.*.mlp.down_proj.weight (x2)' for model.layers.0/1.mlp.down_proj.weight."""
    counts: dict[str, int] = {}
    for n in names:
        p = re.sub(r"\.\d+(?=\.|$)", ".*", n)
        counts[p] = counts.get(p, 0) + 1
    return ", ".join(p + (f" (x{c})" if c > 1 else "") for p, c in counts.items())


def config_changes(tg: Target) -> list[str]:
    """config.json: the model type mlx_lm loads it as, the keys added for mlx_lm's ModelArgs."""
    config, out = tg.config, []
    if tg.renamed:
        out.append(f"config.json: model_type {config['model_type']} (was {tg.renamed}): mlx_lm has no {tg.renamed} "
                   f"model and loads this one as {config['model_type']}; reading back restores it")
    v5 = [k for k in tg.added if k != TIE_KEY]
    if v5:
        out.append(f"config.json: added {', '.join(v5)} from transformers v5 keys (mlx_lm's {tg.module} ModelArgs "
                   "reads the old names); reading the MLX model back drops them again")
    if TIE_KEY in tg.added:
        out.append(f"config.json: added {TIE_KEY} {str(config[TIE_KEY]).lower()} (the source has no such key; "
                   f"transformers ties the head exactly when the checkpoint has no {HEAD}, and mlx_lm's default would "
                   "differ); reading the MLX model back drops it again")
    return out


def output_changes(outputs, unused: list[str]) -> list[str]:
    """The input tensors mlx_lm's sanitize drops, the experts it stacks, the tensors it computes."""
    out = []
    computed = [o.name for o in outputs if o.computed]
    unused = [n for n in unused if n not in set(computed)]  # recomputed under their own name: listed below
    if unused:
        out.append(f"dropped by mlx_lm's sanitize: {collapse(unused)}" if not computed else
                   f"not carried over by name: {collapse(unused)} (mlx_lm's sanitize drops them or computes the tensors "
                   "below from them)")
    stacked = [o for o in outputs if len(o.sources) > 1]
    if stacked:
        out.append(f"stacked {sum(len(o.sources) for o in stacked)} expert tensors into {len(stacked)} tensors (E, out, "
                   "in), as mlx_lm's sanitize does")
    if computed:
        out.append(f"computed by mlx_lm's sanitize (evaluated from the input): {collapse(computed)}")
    return out


def quant_changes(entries, quant, d, block) -> list[str]:
    """What -q quantized (bits, group, mode, recipe), the modules' own parameters, what it left unquantized."""
    if not (quant and d):
        return []
    n = sum(e.name.endswith(".scales") for e in entries)
    out = [f"quantized {counted(n, 'weight')} with mx.quantize: {quant.bits} bits, group size {quant.group_size} "
           f"({quant.mode}{', recipe ' + quant.recipe if quant.recipe else ''}); config.json gets the quantization "
           "block"]
    for module, params in block.items():
        if isinstance(params, dict) and module not in ("group_size", "bits", "mode") and not quant.recipe:
            out.append(f"{module}: {params}, the model's quant_predicate (as mlx_lm.convert)")
    for why in dict.fromkeys(d.skipped.values()):
        out.append(f"left unquantized, as mlx_lm.convert does ({why}): "
                   f"{collapse(m + '.weight' for m, w in d.skipped.items() if w == why)}")
    return out


def cast_changes(dtype, target_st) -> list[str]:
    """--dtype's cast."""
    if dtype is None:
        return []
    return [f"floating tensors cast to {short_name(target_st)} with MLX's astype, as mlx_lm.convert --dtype"]
