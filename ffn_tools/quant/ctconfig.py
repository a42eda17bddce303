"""compressed-tensors' ``quantization_config`` as this package reads it: which modules are quantized and how.

The config's ``config_groups`` each hold a scheme with ``targets`` (a module name, ``re:`` a regex matched from
the start, or a class name such as ``Linear``) and ``weights`` arguments; ``ignore`` names modules left alone.
``Args`` is one module's arguments (the shape of compressed-tensors' ``QuantizationArgs``, which GPTQ's and
AWQ's configs say too); ``args_for`` finds them for a module. Nothing here reads a tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import CheckpointError, LayoutError
from .base import Module, QuantScheme

METHOD = "compressed-tensors"
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_global_scale",
         "input_global_scale")  # X.<part>
MODELOPT_PARTS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
PER_TENSOR = ("weight_global_scale", "weight_scale_2", "input_global_scale", "input_scale")  # one number each
PACKED = "pack-quantized"
FLOAT8 = "float-quantized"  # FP8 weights with their scales, dequantized by ``fp8.dequantize``
NVFP4_CT = "nvfp4-pack-quantized"  # compressed-tensors' NVFP4 (``nvfp4``)
NVFP4_MODELOPT = "modelopt NVFP4"  # NVIDIA ModelOpt's NVFP4 (``nvfp4``)
NVFP4_GROUP = 16
FORMATS = (PACKED, NVFP4_CT, FLOAT8)
GPTQ_METHODS = ("gptq", "awq")


@dataclass(frozen=True)
class Args:
    """How one module's weight is quantized: the config group's ``weights`` arguments and the format
    (compressed-tensors' ``QuantizationArgs``; GPTQ's and AWQ's configs say the same things)."""

    format: str
    bits: int
    strategy: str  # "group", "channel" or "tensor"
    group_size: int | None
    symmetric: bool
    group: str  # the config group's name

    @property
    def nvfp4(self) -> bool:
        return self.format in (NVFP4_CT, NVFP4_MODELOPT)

    @property
    def float8(self) -> bool:
        return self.format == FLOAT8

    @property
    def name(self) -> str:
        """``int4 group 32 asymmetric`` ..., as inspect and reports name it."""
        if self.nvfp4:
            scale = "weight_scale_2" if self.format == NVFP4_MODELOPT else "weight_global_scale"
            return f"nvfp4 group 16 with a {scale} ({self.format})"
        if self.format in GPTQ_METHODS:
            order = " desc_act (g_idx out of order)" if self.strategy == "g_idx" else ""
            return f"{self.format} int4 group {self.group_size}{order} {'symmetric' if self.symmetric else 'with zero points'}"
        if self.float8:
            return f"fp8 {f'group {self.group_size}' if self.strategy == 'group' else 'per ' + self.strategy} ({self.format})"
        how = f"group {self.group_size}" if self.strategy == "group" else f"per {self.strategy}"
        return f"int{self.bits} {how} {'symmetric' if self.symmetric else 'asymmetric'} ({self.format})"

    @property
    def packs_zero_points(self) -> bool:
        """Zero points stored packed down the rows (compressed-tensors' ``PACK_ZP_STRATS``)."""
        return not self.symmetric and self.strategy in ("group", "channel")

    @property
    def rows_per_word(self) -> int:
        """Rows one int32 of packed zero points holds (they straddle words unless bits divide 32)."""
        return 32 // self.bits


def quant_config(ckpt) -> dict | None:
    """The compressed-tensors ``quantization_config`` of ``ckpt``'s config.json, or None."""
    q = (ckpt.config or {}).get("quantization_config")
    return q if isinstance(q, dict) and q.get("quant_method") == METHOD else None


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' ``match_name`` (``re:`` regex from the start, else the exact name) or a class name:
    the modules it packs are Linear (``COMPRESSIBLE_MODULE_TYPES``), so ``Linear`` names every one."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == "Linear"


def args_for(config: dict, base: str) -> Args | None:
    """The scheme of module ``base`` under ``config`` (None: ignored, or in no group).

    Raises:
        CheckpointError: its group's arguments are not ones this reader knows.
    """
    if any(_matches(base, t) for t in config.get("ignore") or []):
        return None
    for gname, group in (config.get("config_groups") or {}).items():
        if not any(_matches(base, t) for t in group.get("targets") or []):
            continue
        w = group.get("weights") or {}
        fmt = group.get("format") or config.get("format")
        if fmt == NVFP4_CT and w.get("type") == "float" and w.get("num_bits") == 4 \
                and w.get("strategy") == "tensor_group" and w.get("group_size") == NVFP4_GROUP:
            return Args(fmt, 4, "tensor_group", NVFP4_GROUP, True, gname)
        if fmt == FLOAT8 and w.get("type") == "float" and w.get("num_bits") == 8 and w.get("symmetric", True):
            return Args(fmt, 8, w.get("strategy") or "tensor", w.get("group_size"), True, gname)
        if w.get("type", "int") != "int" or fmt != PACKED:
            raise CheckpointError(f"{base}: compressed-tensors group {gname!r} is {fmt} {w.get('type')} "
                                  f"{w.get('num_bits')}-bit; this reader knows {', '.join(FORMATS)} int weights")
        strategy = w.get("strategy") or "tensor"
        if strategy not in ("group", "channel", "tensor") or w.get("actorder") == "group":
            raise CheckpointError(f"{base}: compressed-tensors group {gname!r}: strategy {strategy!r}"
                                  f"{' with actorder group (g_idx)' if w.get('actorder') == 'group' else ''} is not "
                                  "read here (group, channel and tensor are)")
        return Args(fmt, int(w.get("num_bits", 8)), strategy, w.get("group_size") if strategy == "group" else None,
                      bool(w.get("symmetric", True)), gname)
    return None


def same_args(ckpt, base: str, m: Module) -> None:
    """Module ``base`` must resolve, under ``ckpt``'s compressed-tensors config, to ``m``'s arguments.

    Raises:
        LayoutError: it resolves to others, or to none.
    """
    s = args_for(quant_config(ckpt) or {}, base)
    if s is None or (s.bits, s.strategy, s.group_size, s.symmetric) != \
            (m.args.bits, m.args.strategy, m.args.group_size, m.args.symmetric):
        raise LayoutError(f"{base}: the output module's parts would be stored {m.args.name}, but the "
                          f"quantization_config carried over reads it as {s.name if s else 'unquantized'} (its "
                          "targets and ignore name modules); add a target for it first")


def describe_args(modules: list[Module], how: str) -> list[dict]:
    """``inspect``'s lines for modules described by compressed-tensors-shaped ``Args``: one per arguments."""
    first: dict[Args, Module] = {}
    counts: dict[Args, int] = {}
    for m in modules:
        first.setdefault(m.args, m)
        counts[m.args] = counts.get(m.args, 0) + 1
    out = []
    for s, n in sorted(counts.items(), key=lambda kv: kv[0].name):
        m = first[s]
        rows = m.shape[0] if s.strategy == "tensor" else 1
        out.append({"dtype": s.name, "scales": "weight_scale", "block": [rows, s.group_size or m.shape[1]],
                    "weights": n, "scheme": s.name, "group": s.group,
                    "how": f"read dequantized as {s.format} defines it: {how}"})
    return out


class ArgsScheme(QuantScheme):
    """A scheme whose modules carry ``Args`` (compressed-tensors', NVFP4's, GPTQ's and AWQ's): named by them."""

    def what(self, m: Module) -> str:
        return m.args.name
