"""Tiny GPTQ and AWQ checkpoints, packed by the formats' published packing code from a real transformers model.

Each Linear (not lm_head) is quantized round-to-nearest with zero points per group of input columns, then
packed as AutoGPTQ's ``QuantLinear.pack`` and AutoAWQ's ``WQLinear_GEMM.from_linear`` loop over words (written
out here as those loops are, word by word: a second, independent implementation from the reader's).
``build`` returns the directories and, per module, the dequantized weight computed from the codes before
packing, the reference the reader must reproduce.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ct_models

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << 4i


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int):
    """RTN 4-bit with zero points per group: codes (out, in), scales and zeros (out, groups)."""
    w = w.float()
    scales, zeros = torch.empty(w.shape[0], groups), torch.empty(w.shape[0], groups)
    for k in range(groups):
        cols = w[:, g_idx == k]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-8)
        scales[:, k], zeros[:, k] = s, torch.round(-lo / s)
    s16 = scales.to(torch.float16).float()  # the stored scales' values quantize, as the formats store fp16
    q = torch.clamp(torch.round(w / s16[:, g_idx]) + zeros[:, g_idx], 0, 15).to(torch.int64)
    return q, s16.to(torch.float16), zeros.to(torch.int64)


def _pack_rows(intweight: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ: 8 consecutive rows of intweight (in, out) per word, row j at bits 4 * (j - i)."""
    qweight = torch.zeros(intweight.shape[0] // 8, intweight.shape[1], dtype=torch.int64)
    i, row = 0, 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    return qweight


def _pack_cols(intweight: torch.Tensor, order) -> torch.Tensor:
    """8 columns per word: AutoGPTQ's qzeros (in order) and AutoAWQ's qweight/qzeros (``order``)."""
    out = torch.zeros(intweight.shape[0], intweight.shape[1] // 8, dtype=torch.int64)
    for col in range(out.shape[1]):
        for i in range(8):
            out[:, col] |= intweight[:, col * 8 + order[i]] << (4 * i)
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t >= 1 << 31, t - (1 << 32), t).to(torch.int32)


def build(method: str, path: Path, arch: str = "llama", group_size: int = 32, desc_act: bool = False,
          **config) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(twin, quantized, {"X.weight": reference dequantized (out, in) float32})."""
    from safetensors.torch import save_file

    model = ct_models._model(arch, torch.float16, **config)
    twin, out = path / "twin", path / method
    model.save_pretrained(twin)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    expected = {}
    gen = torch.Generator().manual_seed(0)
    for name in [k for k in sd if k.endswith("_proj.weight")]:
        w = sd.pop(name)
        base, cols = name[: -len(".weight")], w.shape[1]
        groups = cols // group_size
        if desc_act:  # GPTQ's act-order: columns quantized in a permuted order, g_idx says each one's group
            perm = torch.randperm(cols, generator=gen)
            g_idx = torch.empty(cols, dtype=torch.int64)
            g_idx[perm] = torch.arange(cols) // group_size
        else:
            g_idx = torch.arange(cols) // group_size
        q, s, z = _quantize(w, g_idx, groups)
        expected[name] = ((q - z[:, g_idx]).float() * s.float()[:, g_idx])
        if method == "gptq":
            sd[base + ".qweight"] = _int32(_pack_rows(q.T.contiguous()))
            sd[base + ".qzeros"] = _int32(_pack_cols((z - 1).T.contiguous() & 0xF, list(range(8))))
            sd[base + ".g_idx"] = g_idx.to(torch.int32)
        else:
            sd[base + ".qweight"] = _int32(_pack_cols(q.T.contiguous(), AWQ_ORDER_MAP))
            sd[base + ".qzeros"] = _int32(_pack_cols(z.T.contiguous(), AWQ_ORDER_MAP))
        sd[base + ".scales"] = s.T.contiguous()
    out.mkdir(parents=True)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((twin / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
                                   "sym": False} if method == "gptq" else
                                  {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                   "version": "gemm"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text((twin / "generation_config.json").read_text())
    return twin, out, expected
