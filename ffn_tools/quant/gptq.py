"""GPTQ and AWQ int4 checkpoints: ``qweight``, ``qzeros``, ``scales`` (and GPTQ's ``g_idx``), read dequantized.

Both store a Linear's weight transposed, (in, out), as 4-bit codes in int32 words, by their published
packing code (AutoGPTQ ``QuantLinear.pack``, AutoAWQ ``WQLinear_GEMM.from_linear``):

    GPTQ  qweight (in / 8, out)     8 input rows per word, row j at bits 4 * (j % 8) (in order)
          qzeros  (groups, out / 8) 8 output columns per word, in order, each zero point stored minus 1
          scales  (groups, out)     g_idx (in,): each input row's group (desc_act: not in order)
          w[o, i] = scales[g, o] * (q[i, o] - (qzeros[g, o] + 1)),  g = g_idx[i]
    AWQ   qweight (in, out / 8)     8 output columns per word, column AWQ_ORDER[k] at bits 4 * k
          qzeros  (groups, out / 8) the same order; scales (groups, out); groups of consecutive input rows
          w[o, i] = scales[g, o] * (q[i, o] - qzeros[g, o]),  g = i // group_size

(AWQ's column order is mlx_lm's ``_unpack_awq_weights``' shifts inverted; the tests hold this reader
against ``mlx_lm.load`` of AWQ checkpoints.) The config is ``quantization_config`` with ``quant_method``
``gptq`` or ``awq`` (``bits``, ``group_size``; AWQ ``version`` must be ``gemm``). Values are computed in
float32 and rounded once to the scales' dtype (what an fp16 kernel returns up to its own rounding).
split and fuse move their parts along the output columns (``gptq_rows``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import CheckpointError
from .base import IntCodes, Module
from .codes import compare_codes, shape_differs
from . import gptq_rows
from .ctconfig import ArgsScheme, Args, describe_args

if TYPE_CHECKING:
    import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble k of a word holds column AWQ_ORDER[k]
METHODS = ("gptq", "awq")
PARTS = ("qweight", "qzeros", "scales", "g_idx")


def config(ckpt) -> dict | None:
    q = (ckpt.config or {}).get("quantization_config")
    return q if isinstance(q, dict) and q.get("quant_method") in METHODS else None


def modules(ckpt) -> dict[str, Module]:
    """``X.weight`` -> Module for each GPTQ/AWQ module; {} when there is none.

    Raises:
        CheckpointError: qweights without a GPTQ/AWQ config, or parts that do not fit it (all at once).
    """
    bases = sorted(n[: -len(".qweight")] for n in ckpt if n.endswith(".qweight"))
    if not bases:
        return {}
    q = config(ckpt)
    if q is None:
        raise CheckpointError(f"{ckpt.path}: {len(bases)} qweight tensors ({bases[0]}.qweight, ...) but config.json has "
                              "no quantization_config with quant_method gptq or awq: their packing is unknown")
    method, bits, gs = q["quant_method"], int(q.get("bits", 4)), int(q.get("group_size", 128))
    if bits != 4 or (method == "awq" and str(q.get("version", "gemm")).lower() != "gemm"):
        raise CheckpointError(f"{ckpt.path}: {method} {bits}-bit {q.get('version', '')}: this reader knows 4-bit "
                              "GPTQ and 4-bit AWQ GEMM")
    out, problems = {}, []
    for base in bases:
        parts = {p: f"{base}.{p}" for p in PARTS if f"{base}.{p}" in ckpt}
        missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
        if missing:
            problems.append(f"{base}: {', '.join(missing)} missing")
            continue
        qw, qz, sc = (ckpt.info(parts[p]).shape for p in ("qweight", "qzeros", "scales"))
        rows, cols = (qw[1], qw[0] * 8) if method == "gptq" else (qw[1] * 8, qw[0])  # (out, in)
        gs_here = gs if gs > 0 else cols
        want = {"qzeros": (-(-cols // gs_here), rows // 8), "scales": (-(-cols // gs_here), rows)}
        bad = [f"{parts[p]} {list(s)}, expected {list(want[p])}" for p, s in (("qzeros", qz), ("scales", sc))
               if tuple(s) != want[p]]
        if "g_idx" in parts and ckpt.info(parts["g_idx"]).shape != (cols,):
            bad.append(f"{parts['g_idx']} {list(ckpt.info(parts['g_idx']).shape)}, expected [{cols}]")
        if bad:
            problems.append(f"{base} ({method}, qweight {list(qw)}): " + "; ".join(bad))
            continue
        ordered = "g_idx" not in parts or bool((ckpt[parts["g_idx"]].long() ==
                                                 _sequential(cols, gs_here)).all())
        strategy = "group" if ordered else "g_idx"
        args = Args(method, 4, strategy, gs_here, bool(q.get("sym", not q.get("zero_point", True))), method)
        out[f"{base}.weight"] = Module(f"{base}.weight", GPTQ if method == "gptq" else AWQ, parts, (rows, cols),
                                       ckpt.info(parts["scales"]).st_dtype, args)
    if problems:
        raise CheckpointError(f"{ckpt.path}: {problems[0]}" + (f"; ... ({len(problems) - 1} more)" if len(problems) > 1 else ""))
    return out


def _sequential(cols: int, gs: int):
    import torch

    return torch.arange(cols) // gs


def _words(packed: "torch.Tensor", dim: int, order: tuple[int, ...] | None) -> "torch.Tensor":
    """4-bit codes of int32 words along ``dim`` (8 per word, nibble k = element ``order[k]``), as int64."""
    import torch

    words = packed.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(words >> (4 * k)) & 0xF for k in range(8)], dim=-1)  # (..., words, 8) by nibble
    if order is not None:
        inv = [order.index(j) for j in range(8)]  # element j sits in nibble inv[j]
        nib = nib[..., inv]
    nib = nib.reshape(*packed.shape[:-1], packed.shape[-1] * 8)  # along the last dim
    return nib if dim == packed.dim() - 1 else nib


def codes(m, parts: dict[str, "torch.Tensor"]) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """(codes (out, in), zero points (out, groups), group of each input column (in,)), unsigned, as int64."""
    awq = m.args.format == "awq"
    qw, qz = parts["qweight"], parts["qzeros"]
    if awq:
        q = _words(qw, 1, AWQ_ORDER).T  # (in, out) -> (out, in)
        z = _words(qz, 1, AWQ_ORDER).T
    else:
        q = _words(qw.T.contiguous(), 1, None)  # qweight (in/8, out): words run down the input rows
        z = _words(qz, 1, None).T + 1
    g = parts["g_idx"].long() if "g_idx" in parts else _sequential(m.shape[1], m.args.group_size)
    return q, z, g


def dequantize(m, parts: dict[str, "torch.Tensor"]) -> "torch.Tensor":
    """The (out, in) weight, ``scales * (q - z)`` per input column's group, in the scales' dtype."""
    import torch

    q, z, g = codes(m, parts)
    s = parts["scales"].T.to(torch.float32)  # (out, groups)
    w = (q - z[:, g]).to(torch.float32) * s[:, g]
    return w.to(parts["scales"].dtype)


def mlx_affine(m, parts: dict[str, "torch.Tensor"]) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """(MLX uint32 codes as int64 words (out, in / 8), float32 scales (out, groups), float32 biases -s * z) for
    groups in order."""
    import torch

    q, z, _ = codes(m, parts)
    rows, cols = m.shape
    words = (q.reshape(rows, cols // 8, 8) << (4 * torch.arange(8))).sum(-1)  # MLX: element k at bits 4k
    s = parts["scales"].T.contiguous().float()  # float32: exact, and MLX dequantizes in the scales' dtype
    return words, s, -(s * z.float())  # exact in float32: an 11-bit float16 scale times a 4-bit zero point


class Gptq(ArgsScheme):
    """GPTQ's (``awq``: AWQ GEMM's) 4-bit packing (see the module doc)."""

    def __init__(self, method: str):
        self.method = method
        self.name, self.label = method, method.upper()

    def find(self, ckpt) -> dict[str, Module]:
        return {n: m for n, m in modules(ckpt).items() if m.scheme is self}

    def packed_part(self, m: Module) -> str:
        return m.parts["qweight"]

    def decode(self, m: Module, parts):
        return dequantize(m, parts)

    def params(self, m: Module) -> dict:
        return {"bits": m.args.bits, "group_size": m.args.group_size or m.shape[1], "mode": self.method}

    def requantized(self, label, a, m, parts, src="A", q="B"):
        """Round-to-nearest as AutoGPTQ/AutoAWQ: ``clamp(round(w / s) + z, 0, 15)`` against the stored codes."""
        import torch

        if (wrong := shape_differs(label, m, a, src, q)) is not None:
            return wrong
        stored, z, gi = codes(m, parts)
        s = parts["scales"].T.to(torch.float32)
        mine = torch.clamp(torch.round(a.to(torch.float32) / s[:, gi]) + z[:, gi], 0, 15).to(torch.int16)
        return compare_codes(label, m, mine, stored.to(torch.int16), True, src, q)

    def int_codes(self, m: Module, parts) -> IntCodes | None:
        """The codes, zero points and scales of groups in order; None for act-order (g_idx) groups."""
        import torch

        if m.args.strategy == "g_idx":
            return None
        q, z, _ = codes(m, parts)
        return IntCodes(q.to(torch.int16), z.to(torch.int16), parts["scales"].T.contiguous(),
                        m.args.group_size or m.shape[1], 4)

    def describe(self, modules: list[Module]) -> list[dict]:
        how = "scales * (q - (qzeros + 1)) by g_idx" if self.method == "gptq" else "scales * (q - qzeros), GEMM packing order"
        return describe_args(modules, how)

    def check_target(self, ckpt, base: str, m: Module) -> None:
        """GPTQ/AWQ configs quantize every Linear: any output name is read as stored."""

    def split_entries(self, m, layout, new, ckpt):
        return gptq_rows.split_entries(m, layout, new, ckpt)

    def fuse_entries(self, g, u, layout, name, ckpt):
        return gptq_rows.fuse_entries(g, u, layout, name, ckpt)


GPTQ = Gptq("gptq")
AWQ = Gptq("awq")
