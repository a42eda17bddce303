"""compressed-tensors checkpoints (llm-compressor's output): ``pack-quantized`` int weights read dequantized.

A module ``X`` quantized by compressed-tensors' ``pack-quantized`` format stores, instead of ``X.weight``:

    X.weight_packed      int32 (rows, ceil(cols * bits / 32))   codes + 2^(bits-1), densely packed along a row:
                                                                 code i at bit i * bits of the row (across words)
    X.weight_scale       (rows, groups) in the model's dtype     groups = cols / group_size (1: per channel;
                                                                 shape (1,): per tensor)
    X.weight_zero_point  int32 (ceil(rows * bits / 32), groups)  asymmetric group/channel only: zero points
                                                                 packed the same way, but down the rows
    X.weight_shape       int64 (2,)                              the weight's (rows, cols)

and it reads back as ``w = (q - z) * s`` computed in the scale's dtype (compressed-tensors'
``PackedQuantizationCompressor.decompress`` and ``forward._dequantize``; this module replays that definition,
and the tests hold it against compressed-tensors' own decompression bit for bit). Which modules are quantized
and how is the config's ``quantization_config``: ``config_groups`` (each a scheme with ``targets``: a module
name, ``re:`` a regex matched from the start, or a class name such as ``Linear``) and ``ignore``. The tensors
say the rest; where they and the config disagree the checkpoint is refused, naming the module.

The decoders are ``ctdecode``; ``ctview.CompressedView`` is the checkpoint seen with those modules' ``X.weight``
dequantized and their parts gone: what verify, inspect and ``convert`` read. split and fuse move the stored
parts themselves (``ctrows``, ``gptq_rows``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from .errors import CheckpointError
from . import gptq, nvfp4

METHOD = "compressed-tensors"
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_global_scale",
         "input_global_scale")  # X.<part>
MODELOPT_PARTS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
PER_TENSOR = ("weight_global_scale", "weight_scale_2", "input_global_scale", "input_scale")  # one number each
PACKED = "pack-quantized"
FLOAT8 = "float-quantized"  # FP8 weights with their scales, dequantized by ``scales.dequantize``
FORMATS = (PACKED, nvfp4.CT_FORMAT, FLOAT8)


@dataclass(frozen=True)
class Scheme:
    """How one module's weight is quantized: the config group's ``weights`` arguments and the format."""

    format: str
    bits: int
    strategy: str  # "group", "channel" or "tensor"
    group_size: int | None
    symmetric: bool
    group: str  # the config group's name

    @property
    def nvfp4(self) -> bool:
        return self.format in (nvfp4.CT_FORMAT, nvfp4.MODELOPT)

    @property
    def float8(self) -> bool:
        return self.format == FLOAT8

    @property
    def name(self) -> str:
        """``int4 group 32 asymmetric`` ..., as inspect and reports name it."""
        if self.nvfp4:
            scale = "weight_scale_2" if self.format == nvfp4.MODELOPT else "weight_global_scale"
            return f"nvfp4 group 16 with a {scale} ({self.format})"
        if self.format in gptq.METHODS:
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


@dataclass(frozen=True)
class Module:
    """One quantized weight: its name as read (``X.weight``), scheme, and stored part names by suffix."""

    weight: str
    scheme: Scheme
    parts: dict[str, str]
    shape: tuple[int, int]

    @property
    def base(self) -> str:
        return self.weight[: -len(".weight")]

    @property
    def packed(self) -> str:
        """The stored part holding the codes (ModelOpt keeps them under ``X.weight``)."""
        return self.parts.get("weight_packed") or self.parts.get("qweight") or self.parts["weight"]

    @property
    def per_tensor(self) -> str | None:
        """The suffix of the weight's one per-tensor number (NVFP4), else None."""
        return ("weight_scale_2" if self.scheme.format == nvfp4.MODELOPT else "weight_global_scale") \
            if self.scheme.nvfp4 else None


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


def scheme_for(config: dict, base: str) -> Scheme | None:
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
        if fmt == nvfp4.CT_FORMAT and w.get("type") == "float" and w.get("num_bits") == 4 \
                and w.get("strategy") == "tensor_group" and w.get("group_size") == nvfp4.GROUP:
            return Scheme(fmt, 4, "tensor_group", nvfp4.GROUP, True, gname)
        if fmt == FLOAT8 and w.get("type") == "float" and w.get("num_bits") == 8 and w.get("symmetric", True):
            return Scheme(fmt, 8, w.get("strategy") or "tensor", w.get("group_size"), True, gname)
        if w.get("type", "int") != "int" or fmt != PACKED:
            raise CheckpointError(f"{base}: compressed-tensors group {gname!r} is {fmt} {w.get('type')} "
                                  f"{w.get('num_bits')}-bit; this reader knows {', '.join(FORMATS)} int weights")
        strategy = w.get("strategy") or "tensor"
        if strategy not in ("group", "channel", "tensor") or w.get("actorder") == "group":
            raise CheckpointError(f"{base}: compressed-tensors group {gname!r}: strategy {strategy!r}"
                                  f"{' with actorder group (g_idx)' if w.get('actorder') == 'group' else ''} is not "
                                  "read here (group, channel and tensor are)")
        return Scheme(fmt, int(w.get("num_bits", 8)), strategy, w.get("group_size") if strategy == "group" else None,
                      bool(w.get("symmetric", True)), gname)
    return None


def modules(ckpt) -> dict[str, Module]:
    """``X.weight`` -> Module for every module of ``ckpt`` stored ``pack-quantized``; {} when it is no
    compressed-tensors checkpoint.

    Raises:
        CheckpointError: all problems at once: parts without a config, a module the config ignores or
            does not name, shapes that do not fit its scheme, a zero point missing or extra.
    """
    bases = sorted(n[: -len(".weight_packed")] for n in ckpt if n.endswith(".weight_packed"))
    if not bases:
        return _modelopt(ckpt) or _float8(ckpt) or gptq.modules(ckpt)
    config = quant_config(ckpt)
    if config is None:
        raise CheckpointError(f"{ckpt.path}: {len(bases)} compressed-tensors packed weights ({bases[0]}.weight_packed, "
                              "...) but config.json has no quantization_config with quant_method "
                              "'compressed-tensors': their bits and groups are unknown")
    out, problems = {}, []
    for base in bases:
        try:
            scheme = scheme_for(config, base)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if scheme is None:
            problems.append(f"{base}: stored packed, but the quantization_config ignores it or names it in no group")
            continue
        parts = {p: f"{base}.{p}" for p in PARTS if f"{base}.{p}" in ckpt}
        shape: tuple[int, ...]
        if scheme.nvfp4:
            problem, shape = nvfp4.check(ckpt, base, parts, "weight_packed", "weight_global_scale")
        else:
            problem = _check(ckpt, base, scheme, parts)
            shape = tuple(int(v) for v in ckpt[parts["weight_shape"]].tolist()) if not problem else (0, 0)
        if problem:
            problems.append(problem)
            continue
        out[f"{base}.weight"] = Module(f"{base}.weight", scheme, parts, (shape[0], shape[1]))
    if problems:
        raise CheckpointError(f"{ckpt.path}: compressed-tensors tensors that do not fit their config: "
                              + "; ".join(problems[:6]) + (f"; ... ({len(problems) - 6} more)" if len(problems) > 6 else ""))
    return out


def _modelopt(ckpt) -> dict[str, Module]:
    """ModelOpt NVFP4 modules (``nvfp4``), all problems at once."""
    bases = nvfp4.modelopt_bases(ckpt)
    if not bases:
        return {}
    settings = nvfp4.modelopt_config(ckpt)
    if settings is None or settings.get("quant_algo") != "NVFP4":
        raise CheckpointError(f"{ckpt.path}: {len(bases)} uint8 weights with weight_scale_2 ({bases[0]}.weight, ...), "
                              "ModelOpt NVFP4's layout, but no ModelOpt quantization_config or hf_quant_config.json "
                              f"says NVFP4 (it says {settings.get('quant_algo') if settings else 'nothing'})")
    scheme = Scheme(nvfp4.MODELOPT, 4, "tensor_group", nvfp4.GROUP, True, "NVFP4")
    out, problems = {}, []
    for base in bases:
        parts = {p: f"{base}.{p}" for p in MODELOPT_PARTS if f"{base}.{p}" in ckpt}
        problem, shape = nvfp4.check(ckpt, base, parts, "weight", "weight_scale_2")
        if problem is None and nvfp4.excluded(settings, base):
            problem = f"{base}: stored NVFP4, but exclude_modules names it"
        if problem:
            problems.append(problem)
        else:
            out[f"{base}.weight"] = Module(f"{base}.weight", scheme, parts, shape)
    if problems:
        raise CheckpointError(f"{ckpt.path}: ModelOpt NVFP4 tensors that do not fit: " + "; ".join(problems[:6]))
    return out


def _float8(ckpt) -> dict[str, Module]:
    """compressed-tensors ``float-quantized`` modules: FP8 ``X.weight`` beside ``X.weight_scale``, where the config
    says compressed-tensors (other FP8 checkpoints are ``scales.Dequantized``'s)."""
    config = quant_config(ckpt)
    if config is None:
        return {}
    out, problems = {}, []
    for name in ckpt:
        info = ckpt.info(name)
        if not (name.endswith(".weight") and info.st_dtype in ("F8_E4M3", "F8_E5M2") and name + "_scale" in ckpt):
            continue
        base = name[: -len(".weight")]
        try:
            scheme = scheme_for(config, base)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if scheme is None or not scheme.float8 or len(info.shape) != 2:
            problems.append(f"{base}: stored FP8 with a weight_scale, but the quantization_config reads it as "
                            f"{scheme.name if scheme else 'unquantized'}")
            continue
        out[name] = Module(name, scheme, {"weight": name, "weight_scale": name + "_scale"},
                           (info.shape[0], info.shape[1]))
    if problems:
        raise CheckpointError(f"{ckpt.path}: compressed-tensors FP8 tensors that do not fit their config: "
                              + "; ".join(problems[:6]))
    return out


def _check(ckpt, base: str, s: Scheme, parts: dict[str, str]) -> str | None:
    """Why ``base``'s parts do not fit scheme ``s``, or None."""
    for p in ("weight_scale", "weight_shape"):
        if p not in parts:
            return f"{base}.{p} is missing"
    if not s.symmetric and not s.packs_zero_points:
        return f"{base}: {s.name}: per-tensor zero points are not read here (symmetric per-tensor scales are)"
    if s.packs_zero_points != ("weight_zero_point" in parts):
        return (f"{base}: the config says {s.name}, which stores zero points, but {base}.weight_zero_point is missing"
                if s.packs_zero_points else f"{base}: the config says {s.name}, but a weight_zero_point is stored")
    if ckpt.info(parts["weight_shape"]).shape != (2,):
        return f"{base}.weight_shape: {list(ckpt.info(parts['weight_shape']).shape)}, expected [2] (rows, cols)"
    rows, cols = (int(v) for v in ckpt[parts["weight_shape"]].tolist())
    want: dict[str, tuple[int, ...]] = {"weight_packed": (rows, -(-cols * s.bits // 32))}
    groups = cols // s.group_size if s.strategy == "group" and s.group_size else 1
    if s.strategy == "group" and (not s.group_size or cols % s.group_size):
        return f"{base}: {cols} columns do not fall into groups of {s.group_size}"
    want["weight_scale"] = (1,) if s.strategy == "tensor" else (rows, groups)
    if s.packs_zero_points:
        want["weight_zero_point"] = (-(-rows * s.bits // 32), groups)
    for p, shape in want.items():
        got = ckpt.info(parts[p]).shape
        if got != shape:
            return f"{parts[p]}: shape {list(got)}, expected {list(shape)} for {s.name} of ({rows}, {cols})"
    if ckpt.info(parts["weight_packed"]).st_dtype != "I32":
        return f"{parts['weight_packed']}: {ckpt.info(parts['weight_packed']).st_dtype}, expected I32"
    return None
