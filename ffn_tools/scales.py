"""Quantization scales that travel with a weight: FP8 checkpoints.

DeepSeek-V3, Qwen3-FP8 and Llama-4 FP8 store a projection ``X.weight`` as ``F8_E4M3`` beside
``X.weight_scale_inv``, one float per block of rows and columns (128 x 128 there), by which the 8-bit values
are multiplied; compressed-tensors checkpoints store ``X.weight_scale`` per row (a block of one row and all
columns). A scale has as many rows as the weight has row blocks, so splitting a fused ``gate_up`` or fusing
gate and up moves the scale's rows with the weight's when every gate/up run of the layout starts and ends on
a block boundary (``fits``); otherwise the command refuses, since no exact split exists.
"""

from __future__ import annotations

from .errors import LayoutError
from .io.store import Checkpoint, TensorInfo
from .layouts import GateUpLayout
from .tolerances import FP8_ROW_BITS

SUFFIXES = ("_scale_inv", "_scale")  # after the weight's name: X.weight_scale_inv, X.weight_scale
FP8 = ("F8_E4M3", "F8_E5M2")


def companions(ckpt, weight: str) -> dict[str, str]:
    """suffix -> name of each scale ``ckpt`` holds for tensor ``weight``."""
    return {s: weight + s for s in SUFFIXES if weight + s in ckpt}


def is_companion(name: str, tensors) -> bool:
    """Whether ``name`` is the scale of one of ``tensors``."""
    return any(name.endswith(s) and name[: -len(s)] in tensors for s in SUFFIXES)


def rows(shape: tuple[int, ...], stacked: bool) -> int:
    """The row count of a weight or scale (dim 1 of experts stacked on dim 0)."""
    return shape[1] if stacked else shape[0]


def fits(layout: GateUpLayout, weight_rows: int, scale_rows: int) -> bool:
    """Whether the layout's gate/up runs over ``weight_rows`` fused rows fall on the scale's row blocks."""
    if scale_rows <= 0 or weight_rows % scale_rows:
        return False
    block = weight_rows // scale_rows
    try:
        w, s = layout.segments(weight_rows), layout.segments(scale_rows)
    except LayoutError:
        return False
    return len(w) == len(s) and all(a[0] == b[0] and a[1] == b[1] * block and a[3] == b[3] * block
                                    for a, b in zip(w, s))


def check(ckpt, weight: str, scale: str, layout: GateUpLayout, stacked: bool, fused_rows: int | None = None,
          transposed: bool = False) -> None:
    """Refuse a fused weight's scale that cannot be split (or scales that cannot be fused) exactly.

    Args:
        fused_rows: the fused row count when fusing (the weight is one half), else the weight's own.

    Raises:
        LayoutError: naming both tensors and why.
    """
    w, s = ckpt.info(weight).shape, ckpt.info(scale).shape
    if transposed:
        raise LayoutError(f"{scale}: scales of weights stored (in, out) are not supported; split or fuse the "
                          "dequantized checkpoint")
    wr = fused_rows if fused_rows is not None else rows(w, stacked)
    sr = rows(s, stacked) * (2 if fused_rows is not None else 1)
    if not fits(layout, wr, sr):
        raise LayoutError(f"{scale} {list(s)}: its row blocks do not fall on the {layout.describe()} gate/up "
                          f"boundaries of {weight} {list(w)} ({wr} rows over {sr} scale rows), so no exact split "
                          "of the scale exists")


def dequantize(weight, scale):
    """``weight`` (any float dtype, FP8 included) times its block scale, in float64."""
    import torch

    w = weight.to(torch.float64)
    s = scale.to(torch.float64)
    if s.dim() == 1:
        s = s[:, None]
    rb = -(-w.shape[-2] // s.shape[-2])
    cb = -(-w.shape[-1] // s.shape[-1])
    full = s.repeat_interleave(rb, dim=-2).repeat_interleave(cb, dim=-1)
    return w * full[..., : w.shape[-2], : w.shape[-1]]


def describe(ckpt) -> list[dict]:
    """The scaled (quantized) weights of ``ckpt``, grouped: weight dtype, scale suffix, block (rows x columns
    each scale covers), how many weights."""
    groups: dict[tuple, int] = {}
    for name in ckpt:
        for suffix in SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in ckpt:
                w, s = ckpt.info(name[: -len(suffix)]), ckpt.info(name)
                ws, ss = w.shape[-2:], (s.shape[-2:] if len(s.shape) >= 2 else (s.shape[-1], 1))
                block = tuple(-(-a // b) for a, b in zip(ws, ss)) if len(ws) == 2 else (1, 1)
                key = (w.st_dtype, suffix.lstrip("_"), block)
                groups[key] = groups.get(key, 0) + 1
    return [{"dtype": d, "scales": sfx, "block": list(b), "weights": n} for (d, sfx, b), n in sorted(groups.items())]


class Dequantized(Checkpoint):
    """A checkpoint seen with its scaled weights dequantized (float32) and their scales gone: what verify
    compares, on either side, against a float or differently stored twin. ``quant_params`` gives each
    dequantized weight ``tolerances.FP8_ROW_BITS`` bits (the tolerance row FP8's 3 mantissa bits need) and the
    block's column count as its group."""

    resolves_quantization = True

    def __init__(self, ckpt):
        self.raw, self.scale_of = ckpt, {}
        self.format = ckpt.format
        infos = {}
        for name in ckpt:
            if is_companion(name, ckpt):
                continue
            info = ckpt.info(name)
            found = companions(ckpt, name)
            if found:
                self.scale_of[name] = next(iter(found.values()))
                info = TensorInfo(name, "F32", info.shape, info.file, None)
            infos[name] = info
        super().__init__(ckpt.path, ckpt.root, ckpt.files, infos, ckpt.metadata, ckpt.config)

    def _read(self, info):
        import torch

        if info.name not in self.scale_of:
            return self.raw[info.name]
        return dequantize(self.raw[info.name], self.raw[self.scale_of[info.name]]).to(torch.float32)

    def quant_params(self, name: str) -> dict | None:
        sc = self.scale_of.get(name)
        if sc is None:
            return None
        cols = self.raw.info(name).shape[-1]
        scols = (self.raw.info(sc).shape[-1:] or (1,))[0]
        return {"bits": FP8_ROW_BITS, "group_size": -(-cols // scols), "mode": "fp8"}

    @property
    def stored(self):
        """The FP8 checkpoint as stored, scale tensors included (what a client loads)."""
        return self.raw.stored

    def close(self) -> None:
        self.raw.close()
