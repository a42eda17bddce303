"""compressed-tensors int weights exported as MLX affine quantization, codes kept (no re-quantization).

compressed-tensors stores a code ``c = q + 2^(bits-1)`` (q signed) densely packed along the row, element i at
bit ``i * bits``, and reads ``w = (q - z) * s``. MLX affine packs its unsigned codes the same way into uint32
(for 2, 4 and 8 bits, which divide a word: element i at bit ``i * bits``, low bits first) and reads
``w = s * c + b``. So with the same group size the packed words are MLX's codes as they are (int32 bytes read
as uint32), the scales are ``s`` and the biases ``b = -s * (z + 2^(bits-1))``, both written in float32: MLX
dequantizes in the scales' dtype, and in float32 ``s * c + b`` is ``s * (q - z)`` exactly (a bfloat16 or float16
scale times a code of at most 8 bits needs at most 19 of float32's 24 bits), where bfloat16 scales would add two
roundings the source does not have (``s * c``, then the sum; measured on a tiny int8 Llama: MLX's logits moved 2x
as far from the unquantized twin's as compressed-tensors' own). mlx_lm then computes those layers in float32.
The tests hold ``mlx_lm.load``'s weights, rounded to the source's dtype, to compressed-tensors' decompression bit
for bit. GPTQ and AWQ (float16 scales) the same.

MLX affine takes groups of 32, 64 and 128: per-channel and per-tensor schemes, other group sizes and 3, 5,
6, 7 bits (packed across words) cannot keep their codes; the export then writes those weights dequantized
and says so (``-q`` quantizes them with mx.quantize instead, as asked).

A GGUF's Q8_0, Q4_0 and Q4_1 blocks are integer codes in groups of 32 with float16 scales (``IntCodes``, from GGUF's
scheme: Q8_0 ``d * q`` as ``q + 128`` with zero point 128, Q4_0 ``n`` with 8, Q4_1 ``n`` with bias ``m``): MLX
affine 8- and 4-bit group 32, scales ``d`` and biases ``-128 d``, ``-8 d`` (exact in float32) or ``m``, in
float32, so that MLX's ``d * c + b`` is gguf-py's dequantization exactly (``s * c`` exact, then at most the one
rounding gguf-py makes too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ffn_tools.io.raw import RawTensor
from ffn_tools.io.store import Checkpoint
from ffn_tools.ops import Op
from ffn_tools.plan import Entry
from ffn_tools.quant import Module
from ffn_tools.quant.ctdecode import zero_points

from . import from_fp8

MLX_GROUPS = (32, 64, 128)
MLX_BITS = (2, 4, 8)
# The schemes whose modules an MLX export keeps as codes where it can, and says why where it cannot (the others,
# MXFP4 and the formats' own, are mlx_lm's to keep or the input's to dequantize).
SCHEMES = ("compressed-tensors-int", "compressed-tensors-fp8", "nvfp4-compressed-tensors", "nvfp4-modelopt", "gptq", "awq")
GGUF, GGUF_INT = "gguf", ("Q8_0", "Q4_0", "Q4_1")  # GGUF's scheme, and its types whose blocks are integer codes


def modules(ckpt: Checkpoint) -> dict[str, Module]:
    """``X.weight`` -> its module, for the weights ``ckpt`` reads decoded under one of ``SCHEMES``."""
    return {n: q for n in ckpt if (q := ckpt.quantized(n)) is not None and (q.scheme.name in SCHEMES or (
        q.scheme.name == GGUF and q.args["mode"] in GGUF_INT) or from_fp8.holds(q, ckpt.quantized_parts(n)))}


def _gguf(m: Module) -> bool:
    return m.scheme.name == GGUF


def _fp8(m: Module) -> bool:
    return m.scheme.name == from_fp8.FP8


def _group_bits(m: Module) -> tuple[int, int]:
    """(group size, bits) of ``m``'s codes as MLX keeps them."""
    return (32, m.args["bits"]) if _gguf(m) else (32, 8) if _fp8(m) else (m.args.group_size, m.args.bits)


def _mode(m: Module) -> str:
    return "mxfp8" if _fp8(m) else "affine"


def _name(m: Module) -> str:
    return m.scheme.what(m) if _gguf(m) or _fp8(m) else m.args.name


def why_not(m: Module) -> str | None:
    """Why module ``m``'s codes cannot be kept in MLX affine, or None."""
    if _gguf(m) or _fp8(m):  # Q8_0, Q4_0, Q4_1; FP8 of power-of-two scales (``modules`` chose them)
        return None
    s = m.args
    if s.nvfp4:
        return (f"{s.name}: MLX's nvfp4 QuantizedLinear has no per-tensor scale to hold it, and folding it into "
                "the F8_E4M3 group scales would round them")
    if s.format in ("gptq", "awq"):
        return (f"{s.name}: its groups are not runs of consecutive columns, as MLX's are" if s.strategy == "g_idx"
                else None if s.group_size in MLX_GROUPS else f"{s.name}: MLX affine groups are 32, 64, 128 columns")
    if s.float8:
        return f"{s.name}: MLX's mxfp8 takes power-of-two scales per 32 values, not these"
    if s.strategy != "group" or s.group_size not in MLX_GROUPS:
        return f"{s.name}: MLX affine groups are {', '.join(map(str, MLX_GROUPS))} columns"
    if s.bits not in MLX_BITS:
        return f"{s.name}: {s.bits}-bit codes packed across words are not MLX's {s.bits}-bit packing"
    return None


def kept(found: dict[str, Module], outputs, view: list[Entry]) -> tuple[dict[str, Module], dict[str, str]]:
    """Output module path -> the compressed-tensors module whose codes it keeps (its weight an unchanged copy
    of the module's), and ``X.weight`` -> why not for the modules that are written dequantized."""
    by_name = {e.name: e for e in view}
    out, refused = {}, {}
    for o in outputs:
        if not o.name.endswith(".weight") or len(o.sources) != 1:
            continue
        e = by_name.get(o.sources[0])
        m = found.get(e.inputs[0]) if e is not None and len(e.inputs) == 1 else None
        if m is None:
            continue
        same = tuple(o.shape) == m.shape and e is not None and (e.pieces is not None or ((_gguf(m) or _fp8(m)) and not e.ops))
        why = why_not(m) or (None if same else f"{m.weight} is rearranged on its way to {o.name}")
        if why:
            refused[m.weight] = why
        else:
            out[o.name[: -len(".weight")]] = m
    return out, refused


def block(modules: dict[str, Module]) -> dict | None:
    """mlx_lm's ``quantization`` block: the most common parameters, other modules' own."""
    if not modules:
        return None
    params = [(*_group_bits(m), _mode(m)) for m in modules.values()]
    g, b, mode = max(set(params), key=params.count)
    out: dict = {"group_size": g, "bits": b, "mode": mode}
    for path, m in modules.items():
        if (*_group_bits(m), _mode(m)) != (g, b, mode):
            out[path] = {"group_size": _group_bits(m)[0], "bits": _group_bits(m)[1], "mode": _mode(m)}
    return out


@dataclass(frozen=True)
class KeptCodes(Op):
    """Part ``part`` (0 the packed words as uint32, 1 the scales, 2 the biases, both float32) of ``module``'s
    stored codes as MLX affine (see the module doc). A source op: it reads ``ckpt``'s stored parts itself (the view
    the plan reads hides them), so its entry has no inputs."""

    ckpt: Any = field(compare=False)
    module: Module = field(compare=False)
    part: int = 0

    def apply(self, ts: list) -> list:
        m = self.module
        if _gguf(m):
            return [self._gguf()]
        if _fp8(m):
            return [from_fp8.part(m, self.ckpt.quantized_parts(m.weight), self.part)]
        raw = self.ckpt.stored
        if m.args.format in ("gptq", "awq"):
            return [self._gptq()]
        if self.part == 0:
            packed = m.parts["weight_packed"]
            return [RawTensor("U32", raw.info(packed).shape, raw.read_raw(packed))]
        s = raw[m.parts["weight_scale"]].float()  # exact: a float16 or bfloat16 widens without rounding
        if self.part == 1:
            return [s]
        import torch

        z = zero_points(m, raw[m.parts["weight_zero_point"]]) if "weight_zero_point" in m.parts else torch.zeros_like(s)
        return [-(s * (z.float() + (1 << (m.args.bits - 1))))]  # exact in float32 (module doc)

    def _gptq(self):
        """GPTQ/AWQ codes laid out again as MLX's (the same codes, one row of words per output row)."""
        import torch

        from ffn_tools.quant import gptq

        m = self.module
        t = gptq.mlx_affine(m, self.ckpt.quantized_parts(m.weight))[self.part]
        if self.part == 0:  # int64 words below 2^32 -> their uint32 bytes
            rows, cols = m.shape
            return RawTensor("U32", (rows, cols // 8), t.to(torch.int64).numpy().astype("<u4").tobytes())
        return t

    def _gguf(self):
        """A GGUF's Q8_0/Q4_0/Q4_1 codes as MLX affine (the module doc): packed words, scales, biases."""
        import numpy as np
        import torch

        m = self.module
        c = m.scheme.int_codes(m, self.ckpt.quantized_parts(m.weight))
        if self.part == 1:
            return c.scale.float()
        if self.part == 2:
            return c.bias.float() if c.zero is None else -(c.scale.float() * c.zero.float())
        rows, cols = m.shape
        per = 32 // c.bits  # codes per word, element i at bit i * bits
        shifts = torch.arange(per, dtype=torch.int64) * c.bits
        words = (c.codes.to(torch.int64).reshape(rows, cols // per, per) << shifts).sum(-1)
        return RawTensor("U32", (rows, cols // per), words.numpy().astype("<u4").tobytes())

    def describe(self) -> str:
        return f"{('packed words', 'scales', 'biases')[self.part]} of {_name(self.module)} codes kept as MLX affine"


def entries(ckpt: Checkpoint, path: str, m: Module) -> list[Entry]:
    """``path``'s weight (the packed words as uint32), scales and biases, from ``m``'s stored parts."""
    how = f"{_name(m)} codes kept as MLX affine"
    if _fp8(m):
        return from_fp8.entries(path, m, lambda i: KeptCodes(ckpt, m, i))
    if _gguf(m):
        rows, cols = m.shape
        bits = m.args["bits"]
        return [Entry(f"{path}.weight", "U32", (rows, cols * bits // 32), (), (KeptCodes(ckpt, m, 0),),
                      text=f"{m.weight}'s {m.args['mode']} codes packed as uint32 ({how})"),
                Entry(f"{path}.scales", "F32", (rows, cols // 32), (), (KeptCodes(ckpt, m, 1),), reads=0,
                      text=f"its blocks' float16 scales in float32 ({how})"),
                Entry(f"{path}.biases", "F32", (rows, cols // 32), (), (KeptCodes(ckpt, m, 2),), reads=0,
                      text=f"-scale * zero point (Q4_1: its offsets) in float32 ({how})")]
    if m.args.format in ("gptq", "awq"):
        rows, cols = m.shape
        groups = cols // (m.args.group_size or cols)
        return [Entry(f"{path}.weight", "U32", (rows, cols // 8), (), (KeptCodes(ckpt, m, 0),),
                      text=f"{m.packed} re-laid out ({how})"),
                Entry(f"{path}.scales", "F32", (rows, groups), (), (KeptCodes(ckpt, m, 1),), reads=0,
                      text=f"{m.parts['scales']} transposed, in float32 ({how})"),
                Entry(f"{path}.biases", "F32", (rows, groups), (), (KeptCodes(ckpt, m, 2),), reads=0,
                      text=f"-scales * zero points in float32 ({how})")]
    raw = ckpt.stored
    packed, scale = m.parts["weight_packed"], m.parts["weight_scale"]
    pinfo, sinfo = raw.info(packed), raw.info(scale)
    return [Entry(f"{path}.weight", "U32", pinfo.shape, (), (KeptCodes(ckpt, m, 0),), reads=pinfo.nbytes,
                  text=f"{packed} as uint32 ({how})"),
            Entry(f"{path}.scales", "F32", sinfo.shape, (), (KeptCodes(ckpt, m, 1),), reads=0,
                  text=f"{scale} in float32 ({how})"),
            Entry(f"{path}.biases", "F32", sinfo.shape, (), (KeptCodes(ckpt, m, 2),), reads=0,
                  text=f"-{scale} * (zero point + {1 << (m.args.bits - 1)}) in float32 ({how})")]


def changes(modules: dict[str, Module], refused: dict[str, str]) -> list[str]:
    """What the summary says: codes kept, and the weights written dequantized with why (grouped)."""
    out = []
    if fp8 := [m for m in modules.values() if _fp8(m)]:
        out.append(f"kept the codes of {len(fp8)} FP8 weights ({', '.join(sorted({_name(m) for m in fp8}))}) as MLX "
                   "mxfp8, not dequantized: their E4M3 bytes as uint32 words and their power-of-two scales as E8M0 "
                   "exponents per 32 values, MLX's values the source's exactly")
        modules = {p: m for p, m in modules.items() if not _fp8(m)}
    if modules:
        schemes = sorted({_name(m) for m in modules.values()})
        out.append(f"kept the codes of {len(modules)} quantized weights ({', '.join(schemes)}) as MLX affine "
                   "quantization, not re-quantized: packed words as uint32, scales and biases -s * (z + 2^(bits-1)) "
                   "(a GGUF's -128 d, -8 d or Q4_1 offsets) in float32, so that MLX's dequantization is the source's values with no rounding of its own (mlx_lm "
                   "computes those layers in float32); config.json gets the quantization block")
    whys: dict[str, list[str]] = {}
    for name, why in refused.items():
        whys.setdefault(why, []).append(name)
    for why, names in whys.items():
        out.append(f"dequantized {len(names)} quantized weights ({why}; -q quantizes them with "
                   f"mx.quantize instead): {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}")
    return out


def replace(ckpt: Checkpoint, planned: list[Entry], modules: dict[str, Module]) -> list[Entry]:
    """``planned`` with each kept module's dequantized weight entry replaced by its three MLX parts."""
    out = []
    for e in planned:
        path = e.name[: -len(".weight")] if e.name.endswith(".weight") else None
        out += entries(ckpt, path, modules[path]) if path in modules else [e]
    return out
