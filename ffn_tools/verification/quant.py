"""Quantization as verify reads it: the config's block (MLX-style ``quantization`` or ``quantization_config``),
the bits of each FFN (per module in mixed recipes), and its one-line description."""

from __future__ import annotations

import json

from ..errors import CheckpointError
from ..ffn import FFN
from ..io.store import read_config
from ..registry import ROLES
from ..tolerances import FP8_ROW_BITS


def quantization(ckpt) -> dict | None:
    """The MLX-style ``quantization`` (or ``quantization_config``) block of the config.json on disk: global
    ``bits``/``group_size`` and, from mixed recipes, per-module entries (parameters, or ``false``).

    Read from the file, not ``ckpt.config``: readers that dequantize drop the block from the view.
    """
    try:
        config = read_config(ckpt.root) or {}
    except CheckpointError:
        config = {}
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if isinstance(q, dict) and (isinstance(q.get("bits"), int)
                                    or any(isinstance(v, dict) and isinstance(v.get("bits"), int) for v in q.values())):
            return q
    try:  # weights written dequantized from a quantized model (convert --to torch of a 4-bit MLX model)
        q = json.loads(ckpt.metadata.get(DEQUANTIZED_KEY, "null"))
    except ValueError:
        q = None
    return q if isinstance(q, dict) and isinstance(q.get("bits"), int) else None


QUANT_ROLES = ROLES  # the weights a form stores: gate, up, down, gate_up
DEQUANTIZED_KEY = "ffn_tools_dequantized_from"  # = converters.pytorch.DEQUANTIZED (not imported: core)


def ffn_bits(ckpt, ffn: FFN, default: int | None) -> int | None:
    """The quantization bits of one FFN: the coarsest among its gate/up/down modules, None when none is
    quantized.

    Per module where the reader resolved them (the MLX view's ``quant_params``: a module's own entry in the
    block, else the block's defaults; unquantized modules, ``false`` in a mixed recipe, have none); else the
    config's global ``default`` for every FFN.
    """
    if not ckpt.resolves_quantization:
        return default
    bits = [row_bits(p) for r in QUANT_ROLES if (n := ffn.names.get(r)) and (p := ckpt.quant_params(n))]
    return min(bits, default=None)


def row_bits(params: dict) -> int:
    """The bits whose tolerance row a quantized tensor gets: its own, but ``tolerances.FP8_ROW_BITS`` for
    MLX's mxfp8 (E4M3 values, 3 mantissa bits: the error of FP8 checkpoints, not of 8-bit affine groups; a
    tiny model's FFNs measure cosine 0.9989, below the 8-bit row's 0.999)."""
    return FP8_ROW_BITS if params.get("mode") == "mxfp8" else params["bits"]


def describe_quantization(q: dict) -> str:
    """``4-bit group 64``, plus what per-module entries (mixed recipes, overrides) say, counted."""
    text = (f"{q['bits']}-bit group {q.get('group_size')}" if isinstance(q.get("bits"), int) else "per module")
    text += f" {q['mode']}" if q.get("mode", "affine") != "affine" else ""
    counts: dict[str, int] = {}
    for v in q.values():
        if v is False or isinstance(v, dict):
            what = "unquantized" if v is False else f"at {v.get('bits', q.get('bits'))}-bit"
            counts[what] = counts.get(what, 0) + 1
    if counts:
        text += " (per-module entries: " + ", ".join(f"{n} {w}" for w, n in sorted(counts.items())) + ")"
    return text
