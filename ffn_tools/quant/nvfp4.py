"""NVFP4 weights as compressed-tensors and NVIDIA ModelOpt store them: one layout, two global-scale conventions.

Both store 4-bit E2M1 values two to a byte, low nibble first (``X.weight_packed`` in compressed-tensors'
``nvfp4-pack-quantized``, ``X.weight`` in ModelOpt; uint8 (rows, cols / 2)), one F8_E4M3 scale per 16 values
of a row (``X.weight_scale`` (rows, cols / 16)) and one float32 per tensor. They differ in that number:

    compressed-tensors  X.weight_global_scale  w = e2m1 * (scale / global_scale)   (forward._dequantize)
    ModelOpt            X.weight_scale_2       w = e2m1 * scale * scale_2

compressed-tensors' own ModelOpt converter (``entrypoints/convert/converters/modelopt_nvfp4.py``) maps one to
the other as ``weight_global_scale = 1 / weight_scale_2`` with the packed bytes and scales unchanged: the
inversion that makes a checkpoint load and run wrong when one convention is read as the other.
compressed-tensors computes in float32 and rounds the result to bfloat16 (``NVFP4PackedCompressor.decompress``);
ModelOpt's definition is read the same way, in float32, rounded to bfloat16.

A fused gate_up may carry one global scale per half (ModelOpt: ``weight_scale_2`` of two float32 values, the first
for the first half of the rows, gate, the second for up; ``per_row``): each half is read with its own.

ModelOpt's modules are those with a uint8 ``X.weight`` beside ``X.weight_scale`` and ``X.weight_scale_2``,
its config ``quantization_config`` (``quant_method: modelopt``) in config.json or ``hf_quant_config.json``
(``quantization: {quant_algo: NVFP4, group_size, exclude_modules}``), as mlx_lm reads it.
"""

from __future__ import annotations

import fnmatch
import json
from typing import TYPE_CHECKING

from ..errors import CheckpointError, LayoutError
from .base import E2M1, Fp4Codes, Module
from .codes import compare_codes, shape_differs
from . import ctrows
from .ctconfig import ArgsScheme, MODELOPT_PARTS, NVFP4_CT, NVFP4_GROUP, NVFP4_MODELOPT, Args, describe_args, same_args

if TYPE_CHECKING:
    import torch

GROUP = NVFP4_GROUP
CT_FORMAT = NVFP4_CT
MODELOPT = NVFP4_MODELOPT


def unpack(packed: "torch.Tensor") -> "torch.Tensor":
    """uint8 (rows, cols / 2) -> float32 E2M1 values (rows, cols), low nibble first."""
    import torch

    lut = torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float32)
    b = packed.to(torch.uint8)
    return torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1).reshape(*b.shape[:-1], -1)


def per_row(per_tensor: "torch.Tensor", rows: int) -> "torch.Tensor":
    """The global scale for ``rows`` rows: one number for all, as stored (its shape decides torch's promotion of a
    bfloat16 scale divided by it: compressed-tensors' own arithmetic), or (two numbers: a fused gate_up's, one per
    half) a float32 column, the first for the first ``rows / 2`` rows and the second for the rest."""
    import torch

    if per_tensor.numel() == 2:
        return per_tensor.to(torch.float32).reshape(-1).repeat_interleave(rows // 2)[:, None]
    return per_tensor


def dequantize(values: "torch.Tensor", scale: "torch.Tensor", per_tensor: "torch.Tensor", modelopt: bool) -> "torch.Tensor":
    """``values`` (rows, cols) times the group scales and the per-tensor number (``per_row``: one per half of a
    fused gate_up where there are two), bfloat16 (see the module doc)."""
    import torch

    rows, cols = values.shape
    s = scale.to(torch.bfloat16)  # compressed-tensors' _decompress_scale: to the unpacked dtype first
    g = per_row(per_tensor, rows)
    s = s.float() * g.float() if modelopt else s / g  # bf16 / f32: float32
    x = values.to(torch.bfloat16).float().reshape(rows, -1, GROUP) * s.reshape(rows, -1, 1)
    return x.reshape(rows, cols).to(torch.bfloat16)


def steps(packed: "torch.Tensor") -> "torch.Tensor":
    """Each stored value's signed place on the E2M1 grid (-7..7: 0, 0.5, 1, ... 6 are 0..7), int16."""
    import torch

    b = packed.to(torch.uint8)
    nib = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:-1], -1).to(torch.int16)
    return torch.where(nib >= 8, -(nib - 8), nib)


def quantize(weight: "torch.Tensor", scale: "torch.Tensor", per_tensor: "torch.Tensor", modelopt: bool) -> "torch.Tensor":
    """``weight`` quantized with the stored scales, as ``steps`` gives them: compressed-tensors' ``_quantize``
    (``x / (scale / global_scale)`` in float32, clamped to +-6) and ``cast_to_fp4``'s thresholds (ties to even
    on the grid); ModelOpt's scale is ``scale * scale_2``."""
    import torch

    rows, cols = weight.shape
    s = scale.to(torch.bfloat16).float()
    g = per_row(per_tensor, rows)
    s = s * g.float() if modelopt else s / g
    x = torch.clamp(weight.float().reshape(rows, -1, GROUP) / s.reshape(rows, -1, 1), -6.0, 6.0).reshape(rows, cols)
    a = x.abs()
    place = torch.zeros_like(a, dtype=torch.int16)  # compressed-tensors' cast_to_fp4, bucket by bucket
    for lo, hi, k, closed in ((0.25, 0.75, 1, False), (0.75, 1.25, 2, True), (1.25, 1.75, 3, False),
                              (1.75, 2.5, 4, True), (2.5, 3.5, 5, False), (3.5, 5.0, 6, True)):
        inside = ((a >= lo) & (a <= hi)) if closed else ((a > lo) & (a < hi))
        place = torch.where(inside, torch.tensor(k, dtype=torch.int16), place)
    place = torch.where(a > 5.0, torch.tensor(7, dtype=torch.int16), place)
    return torch.where(x < 0, -place, place)


def input_scale(parts, modelopt: bool) -> float | None:
    """A W4A4 weight's activation scale in ModelOpt's convention (``input_scale``; compressed-tensors'
    ``input_global_scale`` is its reciprocal, taken in float32 as llama.cpp's converter takes it), or None (W4A16)."""
    import torch

    if modelopt:
        x = parts.get("input_scale")
        return None if x is None else float(x.to(torch.float32).reshape(-1)[0])
    x = parts.get("input_global_scale")
    return None if x is None else float(1.0 / x.to(torch.float32).reshape(-1)[0])


def modelopt_config(ckpt) -> dict | None:
    """ModelOpt's quantization settings (flat), from config.json or hf_quant_config.json; None: not ModelOpt."""
    q = (ckpt.config or {}).get("quantization_config")
    if not (isinstance(q, dict) and q.get("quant_method") == "modelopt"):
        f = ckpt.root / "hf_quant_config.json"
        try:
            q = json.loads(f.read_text()) if f.is_file() else None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{f}: unreadable ({e})") from None
    if not isinstance(q, dict):
        return None
    settings = q.get("quantization", q)
    return settings if isinstance(settings, dict) and "quant_algo" in settings else None


def modelopt_bases(ckpt) -> list[str]:
    """Modules stored as ModelOpt NVFP4: a uint8 ``X.weight`` beside ``X.weight_scale`` and ``X.weight_scale_2``."""
    return sorted(n[: -len(".weight_scale_2")] for n in ckpt if n.endswith(".weight_scale_2")
                  and n[: -len("_scale_2")] in ckpt and ckpt.info(n[: -len("_scale_2")]).st_dtype == "U8")


def excluded(settings: dict, base: str) -> bool:
    """Whether ModelOpt's ``exclude_modules`` (names or shell patterns) names module ``base``."""
    return any(fnmatch.fnmatchcase(base, p) for p in settings.get("exclude_modules") or [])


def check(ckpt, base: str, parts: dict[str, str], packed: str, per_tensor: str,
          halves: bool = False) -> tuple[str | None, tuple[int, int]]:
    """(why the NVFP4 parts of ``base`` do not fit, or None; the weight's (rows, cols)); ``halves``: two global
    scales, one per half of the rows, fit too (a fused gate_up's)."""
    p, s = ckpt.info(parts[packed]), ckpt.info(parts["weight_scale"]) if "weight_scale" in parts else None
    if s is None:
        return f"{base}.weight_scale is missing", (0, 0)
    if per_tensor not in parts:
        return f"{base}.{per_tensor} is missing", (0, 0)
    rows, cols = p.shape[0], p.shape[-1] * 2
    if p.st_dtype != "U8" or len(p.shape) != 2:
        return f"{parts[packed]}: {p.st_dtype} {list(p.shape)}, expected uint8 (rows, cols / 2)", (rows, cols)
    if s.shape != (rows, cols // GROUP) or s.st_dtype != "F8_E4M3" or cols % GROUP:
        return (f"{parts['weight_scale']}: {s.st_dtype} {list(s.shape)}, expected F8_E4M3 {[rows, cols // GROUP]} "
                f"(one per {GROUP} values)"), (rows, cols)
    g = ckpt.info(parts[per_tensor])
    two = halves and tuple(g.shape) == (2,) and rows % 2 == 0
    if g.st_dtype != "F32" or (max(g.shape or (1,)) != 1 and not two) or len(g.shape) > 1:
        return (f"{parts[per_tensor]}: {g.st_dtype} {list(g.shape)}, expected one float32"
                + (" (or two, one per half of an even number of rows: a fused gate_up's)" if halves else "")), (rows, cols)
    return None, (rows, cols)


class Nvfp4(ArgsScheme):
    """NVFP4 in one of its two conventions (``modelopt``: ``X.weight`` and ``weight_scale_2``; else compressed-
    tensors' ``weight_packed`` and ``weight_global_scale``, found by ``ctensors``' packed modules)."""

    def __init__(self, modelopt: bool):
        self.modelopt = modelopt
        self.name = "nvfp4-modelopt" if modelopt else "nvfp4-compressed-tensors"
        self.label = "ModelOpt NVFP4" if modelopt else "compressed-tensors"
        self.packed_name, self.scale_name = ("weight", "weight_scale_2") if modelopt else \
            ("weight_packed", "weight_global_scale")

    def find(self, ckpt) -> dict[str, Module]:
        """ModelOpt's modules (compressed-tensors' are ``ctensors.CT_NVFP4``'s), all problems at once."""
        bases = modelopt_bases(ckpt)
        if not bases:
            return {}
        settings = modelopt_config(ckpt)
        if settings is None or settings.get("quant_algo") != "NVFP4":
            raise CheckpointError(f"{ckpt.path}: {len(bases)} uint8 weights with weight_scale_2 ({bases[0]}.weight, ...), "
                                  "ModelOpt NVFP4's layout, but no ModelOpt quantization_config or hf_quant_config.json "
                                  f"says NVFP4 (it says {settings.get('quant_algo') if settings else 'nothing'})")
        args = Args(MODELOPT, 4, "tensor_group", GROUP, True, "NVFP4")
        out, problems = {}, []
        for base in bases:
            parts = {p: f"{base}.{p}" for p in MODELOPT_PARTS if f"{base}.{p}" in ckpt}
            problem, shape = check(ckpt, base, parts, "weight", "weight_scale_2", halves=True)
            if problem is None and excluded(settings, base):
                problem = f"{base}: stored NVFP4, but exclude_modules names it"
            if problem:
                problems.append(problem)
            else:
                out[f"{base}.weight"] = Module(f"{base}.weight", self, parts, shape, "BF16", args)
        if problems:
            raise CheckpointError(f"{ckpt.path}: ModelOpt NVFP4 tensors that do not fit: " + "; ".join(problems[:6]))
        return out

    def packed_part(self, m: Module) -> str:
        return m.parts[self.packed_name]

    def decode(self, m: Module, parts):
        return dequantize(unpack(parts[self.packed_name]), parts["weight_scale"], parts[self.scale_name], self.modelopt)

    def params(self, m: Module) -> dict:
        return {"bits": 4, "group_size": GROUP, "mode": m.args.format}

    def fp4_codes(self, m: Module, parts) -> Fp4Codes | None:
        """The codes as stored, the scales' bits, and the multiplier: ModelOpt's ``scale_2``; compressed-tensors'
        ``1 / global_scale`` only where that is exact in float32 (a power of two), its definition being a division."""
        import torch

        b = parts[self.packed_name].to(torch.uint8)
        nibbles = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(b.shape[0], -1)
        bits = parts["weight_scale"].contiguous().view(torch.uint8)
        act = input_scale(parts, self.modelopt)
        if parts[self.scale_name].numel() == 2:
            return Fp4Codes(nibbles, bits, None, GROUP, "one global scale per half of its rows (a fused gate_up's): "
                            "llama.cpp's NVFP4 has one per tensor", act)
        g = parts[self.scale_name].to(torch.float32).reshape(-1)[0]
        if self.modelopt:
            return Fp4Codes(nibbles, bits, float(g), GROUP, input_scale=act)
        inv = torch.tensor(1.0, dtype=torch.float64) / g.double()
        if torch.isfinite(inv) and float(inv.float()) == float(inv) and float(inv.float()) * float(g) == 1.0:
            return Fp4Codes(nibbles, bits, float(inv), GROUP, input_scale=act)
        return Fp4Codes(nibbles, bits, None, GROUP,
                        f"its global scale {float(g):.9g} divides: its reciprocal is not a float32 number, and llama.cpp "
                        "multiplies by a per-tensor scale (llama.cpp's own converter rounds that reciprocal, silently; "
                        "ModelOpt's scale_2 convention converts exactly)", act)

    def requantized(self, label, a, m, parts, src="A", q="B"):
        if (wrong := shape_differs(label, m, a, src, q)) is not None:
            return wrong
        mine = quantize(a, parts["weight_scale"], parts[self.scale_name], self.modelopt)
        return compare_codes(label, m, mine, steps(parts[self.packed_name]), False, src, q)

    def describe(self, modules: list[Module]) -> list[dict]:
        how = "e2m1 * scale * scale_2, to bfloat16" if self.modelopt else "e2m1 * scale / global scale, to bfloat16"
        return describe_args(modules, how)

    def check_target(self, ckpt, base: str, m: Module) -> None:
        """The output module ``base`` of a split or fuse must be one the carried config stores as ``m`` is.

        Raises:
            LayoutError: it would not be.
        """
        if self.modelopt:
            if excluded(modelopt_config(ckpt) or {}, base):
                raise LayoutError(f"{base}: the output module would be stored NVFP4, but ModelOpt's exclude_modules "
                                  "names it; edit exclude_modules first")
            return
        same_args(ckpt, base, m)

    def split_entries(self, m, layout, new, ckpt):
        return ctrows.split_entries(m, layout, new, ckpt)

    def fuse_entries(self, g, u, layout, name, ckpt):
        return ctrows.fuse_entries(g, u, layout, name, ckpt)


MODELOPT_NVFP4 = Nvfp4(modelopt=True)
