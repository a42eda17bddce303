"""A quantized checkpoint into GGUF from its stored codes: each weight in the GGUF type that holds its values bit
for bit, its codes and scales moved, never dequantized and quantized again unless asked.

A scheme whose weights are integer codes in groups of consecutive columns (``QuantScheme.int_codes``:
compressed-tensors' pack-quantized, GPTQ and AWQ in order, MLX affine) reads ``w = s * (c - z)`` (MLX:
``s * c + b``) per group. GGUF's blocks of 32 values read, in float32:

    Q8_0   d * q            d float16, q int8           q = c - z, where it lies in [-128, 127]
    Q4_0   d * (n - 8)      d float16, n 4-bit          n = c - z + 8, where it lies in [0, 15]
    Q4_1   d * n + m        d, m float16, n 4-bit       n = c, m = -s * z (MLX: b)

so a block holds its group's values exactly where its 32 columns lie in one group (groups of a multiple of 32),
``d = s`` (and ``m``) is a float16 number and the codes fit: its dequantization is then ``s * (c - z)`` with no
rounding at all (an 11-bit d times a code of at most 9 bits), the source's values before the source's own
rounding to its dtype. ``choose`` picks, per tensor, the first type every block of which holds its group exactly
(8-bit codes: Q8_0; 4-bit: Q4_0, then Q4_1, then Q8_0), and counts the blocks each would hold. NVFP4
(``QuantScheme.fp4_codes``) goes into GGUF's NVFP4 (``choose_fp4``): 64 values as four F8_E4M3 scales without
their sign bit and 32 bytes of E2M1 codes, the per-tensor float32 in a ``.scale`` tensor llama.cpp multiplies the
product by (ModelOpt's ``scale_2``; compressed-tensors' ``1 / global_scale`` only where that is exact). A GGUF
source's blocks (``QuantScheme.blocks``: any of its types, K-quants and i-quants too) go in as they are, byte for
byte, in their own type (``choose_blocks``).

A tensor some block of which no type holds (a scale that is not a float16 number, ``-s * z`` needing more than
float16's 11 bits, int8 with zero points, groups of 16, 2- or 3-bit codes, act-order groups, FP8, MXFP4) is
refused, named with the numbers; with ``requantize`` it is written as Q8_0 of its dequantized values (gguf-py's
quantizer, llama.cpp's own rounding) and said so. Nothing else changes: names, order, q/k rows permuted, experts
stacked (``native.route``) are the converter's. The GGUF records which tensors are codes kept (``KEPT``: verify
demands their values be the source's exactly) and which were quantized again (``REQUANTIZED``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ffn_tools.quant.base import KEPT_KEY

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ffn_tools.quant import Blocks, Fp4Codes, IntCodes, Module

BLOCK = 32
BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "NVFP4": 18}  # per 32 values (NVFP4's blocks: 36 bytes per 64)
KEPT = KEPT_KEY  # GGUF metadata: the tensors whose blocks are the source's codes (verify reads it)
REQUANTIZED = "ffn_tools.codes.requantized"  # ... and those dequantized and quantized again (Q8_0)
FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "NVFP4": "MOSTLY_NVFP4"}
NVFP4_BLOCK = 64
GGUF = "gguf"  # the name of GGUF's own scheme (``codes.GGUF_TYPES``), whose blocks a GGUF output copies


@dataclass
class Choice:
    """What a tensor's codes can be in GGUF: ``qtype`` (None: no type holds every block), blocks held exactly by
    the best candidate out of all, and why not where None."""

    qtype: str | None
    exact: int
    blocks: int
    why: str | None = None


def choose(c: "IntCodes") -> Choice:
    """The GGUF type that holds every block of ``c`` exactly (module doc), or why none does."""
    import torch

    rows, cols = c.codes.shape
    blocks = rows * (cols // BLOCK) if cols % BLOCK == 0 else 0
    if c.group_size % BLOCK or cols % BLOCK:
        return Choice(None, 0, blocks or -(-rows * cols // BLOCK),
                      f"groups of {c.group_size} columns: GGUF's blocks are 32 values of one scale")
    per = c.group_size // BLOCK
    s32 = c.scale.to(torch.float32)
    d_blocks = _half(s32).repeat_interleave(per, 1)  # (rows, blocks)
    candidates: dict[str, torch.Tensor] = {}
    if c.zero is None:  # scale * code + bias: Q4_1's d * n + m, nothing else
        if c.bits <= 4 and c.bias is not None:
            candidates["Q4_1"] = d_blocks & _half(c.bias.to(torch.float32)).repeat_interleave(per, 1)
    else:
        rel = c.codes.to(torch.int32) - c.zero.to(torch.int32).repeat_interleave(c.group_size, 1)
        lo = rel.reshape(rows, -1, BLOCK).amin(-1)
        hi = rel.reshape(rows, -1, BLOCK).amax(-1)
        if c.bits <= 4:
            candidates["Q4_0"] = d_blocks & (lo >= -8) & (hi <= 7)
            candidates["Q4_1"] = d_blocks & _half(-(s32 * c.zero.to(torch.float32))).repeat_interleave(per, 1)
        if c.bits <= 8:
            candidates["Q8_0"] = d_blocks & (lo >= -128) & (hi <= 127)
    if not candidates:
        return Choice(None, 0, blocks, f"{c.bits}-bit codes{' with biases' if c.zero is None else ''}: GGUF's "
                      "integer blocks hold 4-bit codes with an offset, 4- and 8-bit codes with a zero point")
    counts = {t: int(ok.sum()) for t, ok in candidates.items()}
    for t, n in counts.items():
        if n == blocks:
            return Choice(t, n, blocks)
    best = max(counts, key=lambda t: counts[t])
    scale_bad = int((~d_blocks).sum())
    why = (f"{scale_bad} blocks' scales are not float16 numbers (11 significant bits, exponents -24 to 15)" if scale_bad
           else f"codes or -scale*zero do not fit {best} in {blocks - counts[best]} blocks")
    return Choice(None, counts[best], blocks, f"{best} would hold {counts[best]} of {blocks} blocks exactly: {why}")


def choose_fp4(c: "Fp4Codes") -> Choice:
    """NVFP4 where every 64 values are a GGUF block (four scales) and its scales and multiplier carry over."""
    import torch

    rows, cols = c.nibbles.shape
    blocks = rows * -(-cols // NVFP4_BLOCK)
    if cols % NVFP4_BLOCK or c.group != 16:
        return Choice(None, 0, blocks, f"rows of {cols} values: GGUF's NVFP4 blocks are 64 (four scales of 16)")
    if c.multiplier is None:
        return Choice(None, 0, blocks, c.why)
    bad = ((c.scale_bits & 0x80) != 0) | ((c.scale_bits & 0x7F) == 0x7F)  # a sign GGUF's UE4M3 drops, or NaN
    n_bad = int(bad.reshape(rows, -1, 4).any(-1).sum())
    if n_bad:
        return Choice(None, blocks - n_bad, blocks, f"{n_bad} blocks have a negative or NaN scale, which GGUF's "
                      "unsigned E4M3 scales do not hold")
    return Choice("NVFP4", blocks, blocks) if torch.isfinite(torch.tensor(c.multiplier)) else \
        Choice(None, 0, blocks, f"its per-tensor scale is {c.multiplier}")


def choose_blocks(b: "Blocks") -> Choice:
    """A GGUF source's blocks: their own type, every block (copied byte for byte)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = GGML_QUANT_SIZES[GGMLQuantizationType[b.type]][1]
    n = b.rows.shape[0] * (b.rows.shape[1] // size)
    return Choice(b.type, n, n)


def encode_fp4(c: "Fp4Codes") -> "np.ndarray":
    """``c`` as GGUF NVFP4 blocks: per 64 values, the four scale bytes (sign bit cleared) then 32 bytes, 8 per
    sub-block of 16 (byte j: value j low, value j + 8 high); uint8 (rows, blocks * 36)."""
    import numpy as np

    rows, cols = c.nibbles.shape
    nb = cols // NVFP4_BLOCK
    n = c.nibbles.numpy().reshape(rows, nb, 4, 2, 8)
    qs = (n[..., 0, :] | (n[..., 1, :] << np.uint8(4))).reshape(rows, nb, 32)
    d = (c.scale_bits.numpy() & np.uint8(0x7F)).reshape(rows, nb, 4)
    return np.concatenate([d, qs], axis=-1).reshape(rows, -1)


def _half(x: "torch.Tensor") -> "torch.Tensor":
    """Where float32 ``x`` is a float16 number (finite)."""
    import torch

    return (x.to(torch.float16).to(torch.float32) == x) & torch.isfinite(x)


def encode(c: "IntCodes", qtype: str) -> "np.ndarray":
    """``c`` as ``qtype`` blocks (``choose`` said every block fits): uint8 (rows, blocks * BYTES)."""
    import numpy as np
    import torch

    rows, cols = c.codes.shape
    nb, per = cols // BLOCK, c.group_size // BLOCK
    d = c.scale.to(torch.float32).repeat_interleave(per, 1).to(torch.float16).numpy().view(np.uint8)  # (rows, nb*2)
    d = d.reshape(rows, nb, 2)
    codes = c.codes.to(torch.int32)
    zero = c.zero.to(torch.int32).repeat_interleave(c.group_size, 1) if c.zero is not None else 0
    if qtype == "Q8_0":
        q = (codes - zero).to(torch.int8).numpy().view(np.uint8).reshape(rows, nb, BLOCK)
        return np.concatenate([d, q], axis=-1).reshape(rows, -1)
    nibbles = ((codes - zero + 8) if qtype == "Q4_0" else codes).to(torch.uint8).numpy()
    n = nibbles.reshape(rows, nb, 2, BLOCK // 2)
    qs = n[:, :, 0] | (n[:, :, 1] << np.uint8(4))  # byte j: value j low, value j + 16 high
    if qtype == "Q4_0":
        return np.concatenate([d, qs], axis=-1).reshape(rows, -1)
    if c.zero is not None:
        offset = -(c.scale.to(torch.float32) * c.zero.to(torch.float32))
    else:
        assert c.bias is not None  # IntCodes: a zero point or a bias
        offset = c.bias.to(torch.float32)
    m = offset.repeat_interleave(per, 1).to(torch.float16).numpy().view(np.uint8).reshape(rows, nb, 2)
    return np.concatenate([d, m, qs], axis=-1).reshape(rows, -1)


def requantize(w: "torch.Tensor") -> "np.ndarray":
    """``w`` (rows, cols), dequantized, quantized again as Q8_0 by gguf-py (llama.cpp's rounding)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    x = np.ascontiguousarray(w.to(torch.float32).numpy())
    return quants.quantize(x, GGMLQuantizationType.Q8_0).reshape(w.shape[0], -1)


@dataclass
class Tensor:
    """One GGUF tensor made of quantized source weights, and what happens to it."""

    name: str
    sources: list[str]
    modules: list["Module"]
    op: str
    heads: int | None
    action: str  # "kept", "requantized" or "refused"
    qtype: str | None
    exact: int
    blocks: int
    why: str | None = None
    report: dict = field(default_factory=dict)
    multipliers: list[float] = field(default_factory=list)  # NVFP4: each source's per-tensor scale (.scale)
    input_scales: list[float] = field(default_factory=list)  # ... and W4A4's activation scale (.input_scale)


def quantized(ckpt) -> tuple[object, dict[str, "Module"]]:
    """``ckpt`` seen with every quantized weight decoded (FP8 blocks too: no GGUF type holds them), and its quantized
    weights: decoded name -> module (the registry's schemes, and the formats' own that their views resolve: MLX's);
    {} where it has none."""
    from ffn_tools import quant

    view = quant.decoded(ckpt, every=True)
    return view, {n: m for n in view if (m := view.quantized(n)) is not None}


def choices(view, modules: dict[str, "Module"]) -> dict[str, dict]:
    """Each quantized weight's ``Choice`` (as JSON: ``qtype``, ``exact``, ``blocks``, ``why``, and NVFP4's
    ``multiplier``), from its codes, read once: what the writer refuses on before the converter starts, and hands
    to it."""
    import dataclasses

    out = {}
    for h, m in modules.items():
        parts = view.quantized_parts(h)
        if m.scheme.name == GGUF and parts is None:  # DeepSeek's kv_b_proj, read joined from attn_k_b and attn_v_b
            n = -(-m.shape[0] * m.shape[1] // int(m.args["group_size"]))
            out[h] = {**dataclasses.asdict(Choice(None, 0, n, "read joined from two GGUF tensors, which the converter "
                      "makes again from its values: no one tensor's blocks to copy")), "multiplier": None,
                      "input_scale": None}
            continue
        b = m.scheme.blocks(m, parts) if m.scheme.name == GGUF else None
        codes = m.scheme.int_codes(m, parts) if b is None else None
        fp4 = m.scheme.fp4_codes(m, parts) if b is None and codes is None else None
        c = (choose_blocks(b) if b is not None else choose(codes) if codes is not None else
             choose_fp4(fp4) if fp4 is not None else
             Choice(None, 0, -(-m.shape[0] * m.shape[1] // BLOCK), "no GGUF type holds its values exactly (they are "
                    "not integer codes of a scale per group of 32, NVFP4 or GGUF blocks)"))
        mult = b.multiplier if b is not None else fp4.multiplier if fp4 is not None else None
        act = b.input_scale if b is not None else fp4.input_scale if fp4 is not None else None
        out[h] = {**dataclasses.asdict(c), "multiplier": mult, "input_scale": act}
    return out


def plan(modules: dict[str, "Module"], chosen: dict[str, dict], routes: dict[str, tuple],
         requantize_rest: bool) -> list[Tensor]:
    """What becomes of each GGUF tensor made of ``modules`` (decoded name -> module; ``chosen``: their
    ``choices``); ``routes``: GGUF name -> ``native.route``'s (names, op, heads). A module no route reaches is
    refused (or, requantizing, left as the converter writes it, dequantized, and the report says so)."""
    out: list[Tensor] = []
    reached: set[str] = set()
    for name, (hf, op, heads) in routes.items():
        mods = [modules.get(h) for h in hf]
        if not any(mods):
            continue
        reached.update(h for h in hf if h in modules)
        found = [m for m in mods if m is not None]
        why = None
        if len(found) != len(mods):
            why = "it stacks quantized and unquantized weights"
        elif op not in ("copy", "rotary", "stack"):
            why = f"llama.cpp's converter changes its values ({op})"
        choice = Choice(None, 0, 0, why)
        multipliers = [chosen[h]["multiplier"] for h in hf if h in chosen]
        if why is None:
            each = [Choice(chosen[h]["qtype"], chosen[h]["exact"], chosen[h]["blocks"], chosen[h]["why"]) for h in hf]
            blocks, exact = sum(ch.blocks for ch in each), sum(ch.exact for ch in each)
            types = {ch.qtype for ch in each}
            if len(types) == 1 and None not in types:
                choice = Choice(types.pop(), exact, blocks)
            else:
                bad = next((ch for ch in each if ch.qtype is None), None)
                choice = Choice(None, exact, blocks, bad.why if bad else
                                f"its experts' codes fit different types ({', '.join(sorted(map(str, types)))})")
        action = "kept" if choice.qtype else ("requantized" if requantize_rest and why is None else "refused")
        out.append(Tensor(name, hf, found, op, heads, action, choice.qtype if action == "kept" else
                          ("Q8_0" if action == "requantized" else None), choice.exact, choice.blocks, choice.why))
        if choice.qtype == "NVFP4":
            out[-1].multipliers = [float(x) for x in multipliers if x is not None]
            acts = [chosen[h].get("input_scale") for h in hf if h in chosen]
            out[-1].input_scales = [float(x) for x in acts if x is not None]
    for h, m in modules.items():
        if h not in reached:
            out.append(Tensor(h, [h], [m], "", None, "dequantized" if requantize_rest else "refused", None, 0, 0,
                              "llama.cpp's converter rearranges it (no recipe maps it to one GGUF tensor)"))
    for t in out:
        t.report = {"tensor": t.name, "source": t.sources[0] + (f" (+{len(t.sources) - 1})" if len(t.sources) > 1
                    else ""), "scheme": t.modules[0].scheme.what(t.modules[0]), "action": t.action,
                    "type": t.qtype, "blocks_exact": t.exact, "blocks": t.blocks, **({"why": t.why} if t.why else {})}
    return out


def tensor_bytes(ckpt, t: Tensor) -> "np.ndarray":
    """Tensor ``t``'s bytes as the converter lays it out (q/k rows permuted, experts stacked), in ``t.qtype``:
    uint8 (rows, row bytes), or (experts, rows, row bytes)."""
    import numpy as np

    from .native import rotary_rows

    rows_of = []
    for h, m in zip(t.sources, t.modules):
        if t.action == "kept":  # plan() kept it: its codes fit t.qtype, every block
            parts = ckpt.quantized_parts(h)
            b = m.scheme.blocks(m, parts) if m.scheme.name == GGUF else None
            fp4 = m.scheme.fp4_codes(m, parts) if b is None and t.qtype == "NVFP4" else None
            codes = m.scheme.int_codes(m, parts) if b is None and fp4 is None else None
            if b is not None and b.type == t.qtype:
                rows = b.rows.numpy()
            elif fp4 is not None:
                rows = encode_fp4(fp4)
            elif codes is not None:
                rows = encode(codes, t.qtype or "")
            else:
                raise ValueError(f"{h}: planned as {t.qtype} codes, but its scheme gives none")
        else:
            rows = requantize(ckpt[h])
        if t.op == "rotary" and t.heads:
            rows = rotary_rows(rows, rows.shape[0] // t.heads)
        rows_of.append(np.ascontiguousarray(rows))
    return np.stack(rows_of) if t.op == "stack" else rows_of[0]


def apply(ckpt, writer, tensors: list[Tensor]) -> None:
    """Replace each kept or requantized tensor's entry in the converter's ``writer`` by its blocks, read when
    written (a lazy tensor of gguf-py's), and record the lists in the metadata."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LazyNumpyTensor

    infos = writer.tensors[0]
    for t in tensors:
        if t.action not in ("kept", "requantized"):
            continue
        ti = infos[t.name]
        qtype = t.qtype or "Q8_0"
        block, size = GGML_QUANT_SIZES[getattr(GGMLQuantizationType, qtype)]
        nbytes = math.prod(int(d) for d in ti.shape) // block * size
        byte_shape = (*[int(d) for d in ti.shape[:-1]], int(ti.shape[-1]) // block * size)
        meta = LazyNumpyTensor.meta_with_dtype_and_shape(np.uint8, byte_shape)
        ti.dtype, ti.nbytes = getattr(GGMLQuantizationType, qtype), nbytes
        ti.tensor = LazyNumpyTensor(meta=meta, args=(t,), func=lambda x: tensor_bytes(ckpt, x))
        for suffix, values in ((".scale", t.multipliers), (".input_scale", t.input_scales)):
            if values and not trivial(values, t.op == "stack"):  # NVFP4's per-tensor scale (llama.cpp multiplies
                # the product by it) and W4A4's activation scale, as the converter names and writes them
                writer.add_tensor(t.name.removesuffix(".weight") + suffix, np.array(values, dtype=np.float32))
    kept = [t.name for t in tensors if t.action == "kept"]
    again = [t.name for t in tensors if t.action == "requantized"]
    if kept:
        writer.add_array(KEPT, kept)
    if again:
        writer.add_array(REQUANTIZED, again)


def trivial(values: list[float], stacked: bool) -> bool:
    """Per-tensor scales llama.cpp's converter leaves unwritten: a weight's one scale within 1e-6 of 1
    (``_scale_is_trivial``), a stack's all close to 1 (``_write_scales_tensor``: numpy's allclose, atol 1e-6)."""
    import numpy as np

    if stacked:
        return bool(np.allclose(values, 1.0, atol=1e-6))
    return len(values) == 1 and abs(values[0] - 1.0) < 1e-6


def file_type(tensors: list[Tensor]) -> str | None:
    """The ``general.file_type`` name (``LlamaFileType``) of the type most kept tensors are, None where none is."""
    from gguf import LlamaFileType

    types = [t.qtype for t in tensors if t.action == "kept" and t.qtype]
    if not types:
        return None
    most = max(set(types), key=types.count)  # a K-quant's file types are its mixes: the _M one
    return FILE_TYPES.get(most) or next((f"MOSTLY_{most}{x}" for x in ("", "_M")
                                         if f"MOSTLY_{most}{x}" in LlamaFileType.__members__), None)
