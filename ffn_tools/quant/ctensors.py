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

The decoders are ``ctdecode``; the schemes here (``CT_INT``, ``CT_FLOAT8``; NVFP4 is ``nvfp4``'s, GPTQ and AWQ
``gptq``'s) register in ``ffn_tools.quant``, whose ``DecodedView`` is the checkpoint seen with those modules'
``X.weight`` dequantized and their parts gone: what verify, inspect and ``convert`` read. split and fuse move
the stored parts themselves (``ctrows``, ``gptq_rows``).
"""

from __future__ import annotations

from ..errors import CheckpointError
from . import ctdecode, nvfp4
from .base import IntCodes, Module, QuantScheme
from .codes import compare_codes, shape_differs
from . import ctrows
from .ctconfig import ArgsScheme, PARTS, Args, args_for, describe_args, quant_config, same_args
from .fp8 import dequantize as scaled
from ..tolerances import FP8_ROW_BITS


class CompressedInt(ArgsScheme):
    """compressed-tensors' ``pack-quantized`` int weights: ``(q - z) * s`` in the scale's dtype."""

    name, label = "compressed-tensors-int", "compressed-tensors"

    def find(self, ckpt) -> dict[str, Module]:
        return {n: m for n, m in packed(ckpt).items() if m.scheme is self}

    def packed_part(self, m: Module) -> str:
        return m.parts["weight_packed"]

    def decode(self, m: Module, parts):
        return ctdecode.dequantize(m, parts)

    def params(self, m: Module) -> dict:
        return {"bits": m.args.bits, "group_size": m.args.group_size or m.shape[1],
                "mode": f"compressed-tensors {'symmetric' if m.args.symmetric else 'asymmetric'}"}

    def requantized(self, label, a, m, parts, src="A", q="B"):
        if (wrong := shape_differs(label, m, a, src, q)) is not None:
            return wrong
        mine = ctdecode.quantize(m, a, parts)
        stored = ctdecode.unpack(parts["weight_packed"], m.args.bits, m.shape[1])
        return compare_codes(label, m, mine, stored, "weight_zero_point" in parts, src, q)

    def describe(self, modules: list[Module]) -> list[dict]:
        return describe_args(modules, "(q - z) * s in the scale's dtype")

    def int_codes(self, m: Module, parts) -> IntCodes | None:
        """``w = s * ((q + 2^(bits-1)) - (z + 2^(bits-1)))``: the unsigned code c = q + 2^(bits-1), as packed."""
        import torch

        rows, cols = m.shape
        scale = parts["weight_scale"]
        if scale.dim() != 2:  # per tensor: one scale for every group
            scale = scale.reshape(1, 1).expand(rows, 1)
        groups = scale.shape[1]
        half = 1 << (m.args.bits - 1)
        codes = ctdecode.unpack(parts["weight_packed"], m.args.bits, cols).to(torch.int16) + half
        z = (ctdecode.zero_points(m, parts["weight_zero_point"]).to(torch.int16) if "weight_zero_point" in parts
             else torch.zeros((rows, groups), dtype=torch.int16)) + half
        return IntCodes(codes, z.expand(rows, groups).contiguous(), scale.expand(rows, groups).contiguous(),
                        cols // groups, m.args.bits)

    def check_target(self, ckpt, base: str, m: Module) -> None:
        same_args(ckpt, base, m)

    def split_entries(self, m, layout, new, ckpt):
        return ctrows.split_entries(m, layout, new, ckpt)

    def fuse_entries(self, g, u, layout, name, ckpt):
        return ctrows.fuse_entries(g, u, layout, name, ckpt)


class CompressedFloat8(ArgsScheme):
    """compressed-tensors' ``float-quantized`` FP8 weights: the FP8 values times their scale, rounded to the scale's
    dtype (as compressed-tensors' ``x.to(scale.dtype) * scale`` rounds them); compared by the FP8 tolerance row."""

    name, label, moves_parts = "compressed-tensors-fp8", "compressed-tensors", False

    def find(self, ckpt) -> dict[str, Module]:
        return float8(ckpt)

    def decode(self, m: Module, parts):
        return scaled(parts["weight"], parts["weight_scale"]).to(parts["weight_scale"].dtype)

    def params(self, m: Module) -> dict:
        return {"bits": FP8_ROW_BITS, "group_size": m.args.group_size or m.shape[1], "mode": "fp8"}

    def describe(self, modules: list[Module]) -> list[dict]:
        return describe_args(modules, "fp8 times its scale, in the scale's dtype")


class CompressedNvfp4(nvfp4.Nvfp4):
    """compressed-tensors' ``nvfp4-pack-quantized`` (NVFP4's compressed-tensors convention: ``nvfp4``)."""

    def __init__(self) -> None:
        super().__init__(modelopt=False)

    def find(self, ckpt) -> dict[str, Module]:
        return {n: m for n, m in packed(ckpt).items() if m.scheme is self}


CT_INT = CompressedInt()
CT_NVFP4 = CompressedNvfp4()
CT_FLOAT8 = CompressedFloat8()


def packed(ckpt) -> dict[str, Module]:
    """``X.weight`` -> Module for every module of ``ckpt`` stored ``pack-quantized`` or ``nvfp4-pack-quantized``
    (``X.weight_packed``); {} when it has none.

    Raises:
        CheckpointError: all problems at once: parts without a config, a module the config ignores or
            does not name, shapes that do not fit its scheme, a zero point missing or extra.
    """
    bases = sorted(n[: -len(".weight_packed")] for n in ckpt if n.endswith(".weight_packed"))
    if not bases:
        return {}
    config = quant_config(ckpt)
    if config is None:
        raise CheckpointError(f"{ckpt.path}: {len(bases)} compressed-tensors packed weights ({bases[0]}.weight_packed, "
                              "...) but config.json has no quantization_config with quant_method "
                              "'compressed-tensors': their bits and groups are unknown")
    out, problems = {}, []
    for base in bases:
        try:
            args = args_for(config, base)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if args is None:
            problems.append(f"{base}: stored packed, but the quantization_config ignores it or names it in no group")
            continue
        parts = {p: f"{base}.{p}" for p in PARTS if f"{base}.{p}" in ckpt}
        shape: tuple[int, ...]
        if args.nvfp4:
            problem, shape = nvfp4.check(ckpt, base, parts, "weight_packed", "weight_global_scale")
            scheme: QuantScheme = CT_NVFP4
            dtype = "BF16"
        else:
            problem = _check(ckpt, base, args, parts)
            shape = tuple(int(v) for v in ckpt[parts["weight_shape"]].tolist()) if not problem else (0, 0)
            scheme, dtype = CT_INT, ckpt.info(parts["weight_scale"]).st_dtype
        if problem:
            problems.append(problem)
            continue
        out[f"{base}.weight"] = Module(f"{base}.weight", scheme, parts, (shape[0], shape[1]), dtype, args)
    if problems:
        raise CheckpointError(f"{ckpt.path}: compressed-tensors tensors that do not fit their config: "
                              + "; ".join(problems[:6]) + (f"; ... ({len(problems) - 6} more)" if len(problems) > 6 else ""))
    return out


def float8(ckpt) -> dict[str, Module]:
    """compressed-tensors ``float-quantized`` modules: FP8 ``X.weight`` beside ``X.weight_scale``, where the config
    says compressed-tensors (other FP8 checkpoints are ``fp8.FP8_BLOCKS``')."""
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
            args = args_for(config, base)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if args is None or not args.float8 or len(info.shape) != 2:
            problems.append(f"{base}: stored FP8 with a weight_scale, but the quantization_config reads it as "
                            f"{args.name if args else 'unquantized'}")
            continue
        out[name] = Module(name, CT_FLOAT8, {"weight": name, "weight_scale": name + "_scale"},
                           (info.shape[0], info.shape[1]), ckpt.info(name + "_scale").st_dtype, args)
    if problems:
        raise CheckpointError(f"{ckpt.path}: compressed-tensors FP8 tensors that do not fit their config: "
                              + "; ".join(problems[:6]))
    return out


def _check(ckpt, base: str, s: Args, parts: dict[str, str]) -> str | None:
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
