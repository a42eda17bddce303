"""Quantization as verify reads it: the config's block (MLX-style ``quantization`` or ``quantization_config``),
the bits of each FFN (per module in mixed recipes), and its one-line description."""

from __future__ import annotations

import json

from ..errors import CheckpointError
from ..ffn import FFN
from ..io.store import read_config
from ..plan import DEQUANTIZED
from ..registry import ROLES


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
        q = json.loads(ckpt.metadata.get(DEQUANTIZED, "null"))
    except ValueError:
        q = None
    return q if isinstance(q, dict) and isinstance(q.get("bits"), int) else None


QUANT_ROLES = ROLES  # the weights a form stores: gate, up, down, gate_up


def tensor_bits(ckpt, name: str, default: int | None) -> int | None:
    """The tolerance bits of one tensor: its scheme's row where its reader resolves quantization per tensor
    (``Checkpoint.quantized``; None: stored as it reads), else ``default`` (the config's bits: weights written
    dequantized from a quantized model, every tensor may carry its error)."""
    if not ckpt.resolves_quantization:
        return default
    q = ckpt.quantized(name)
    return q.scheme.row_bits(q.params) if q is not None else None


def ffn_bits(ckpt, ffn: FFN, default: int | None) -> int | None:
    """The quantization bits of one FFN: the coarsest among its gate/up/down modules, None when none is
    quantized (per module where the reader resolves them: a mixed recipe's own entries; else the config's
    global ``default`` for every FFN)."""
    if not ckpt.resolves_quantization:
        return default
    bits = [b for r in QUANT_ROLES if (n := ffn.names.get(r)) and (b := tensor_bits(ckpt, n, None)) is not None]
    return min(bits, default=None)


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
