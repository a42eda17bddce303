"""MLX's quantization modes as registered schemes (``ffn_tools.quant``): affine, mxfp4, nvfp4, mxfp8.

An MLX model stores a quantized module as ``X.weight`` (packed uint32) + ``X.scales`` (+ ``X.biases``: affine),
read back with ``mx.dequantize`` (the MLX view, ``view``); its codes are re-derived from the other side's weight
with ``mx.quantize`` (``requant``: MLX's quantization is deterministic). A module's parts are the tuple
(packed weight, scales, biases or None, parameters with ``group_size``, ``bits``, ``mode`` and ``dtype``).
"""

from __future__ import annotations

from ffn_tools import quant
from ffn_tools.io.dtypes import short_name
from ffn_tools.quant import IntCodes, Module, QuantScheme
from ffn_tools.tolerances import FP8_ROW_BITS

MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}  # (group size, bits)


class MlxQuant(QuantScheme):
    """One MLX quantization mode (see the module docstring)."""

    def __init__(self, mode: str):
        self.mode = mode
        self.name, self.label = f"mlx-{mode}", f"MLX {mode}"

    def decode(self, m: Module, parts):
        from .quant import dequantize

        w, s, b, q = parts
        return dequantize(w, s, b, q["group_size"], q["bits"], q["mode"], q["dtype"]).to_torch()

    def params(self, m: Module) -> dict:
        return dict(m.args)

    def row_bits(self, params: dict) -> int:
        """mxfp8 is E4M3 values, 3 mantissa bits: the error of FP8 checkpoints, not of 8-bit affine groups (a tiny
        model's FFNs measure cosine 0.9989, below the 8-bit row's 0.999): ``tolerances.FP8_ROW_BITS``."""
        return FP8_ROW_BITS if params.get("mode") == "mxfp8" else params["bits"]

    def requantized(self, label, a, m, parts, src="A", q="B"):
        from .requant import check_requantized

        return check_requantized(label, a, parts)

    def int_codes(self, m: Module, parts) -> IntCodes | None:
        """Affine 4- and 8-bit codes of one weight (2-D): ``scales * c + biases``, the codes unpacked from the
        uint32 words (element i at bit ``i * bits``, low bits first)."""
        import numpy as np
        import torch

        from .quant import from_mx

        w, s, b, q = parts
        if self.mode != "affine" or q["bits"] not in (4, 8) or len(w.shape) != 2 or b is None:
            return None
        by = np.array(w).view(np.uint8).reshape(w.shape[0], -1)  # little-endian words: bytes in element order
        codes = np.stack([by & 15, by >> 4], axis=-1).reshape(w.shape[0], -1) if q["bits"] == 4 else by
        return IntCodes(torch.from_numpy(codes.astype(np.int16)), None, from_mx(s).to_torch(), q["group_size"],
                        q["bits"], bias=from_mx(b).to_torch())

    def what(self, m: Module) -> str:
        return f"{m.args['bits']}-bit {m.args['mode']} group {m.args['group_size']} in {short_name(m.dtype)}"

    def requantized_note(self, m: Module, roles: list[str], src: str, q: str) -> str:
        return (f"re-quantized: {src}'s {', '.join(roles)} quantized with {q}'s parameters ({self.what(m)}) give "
                f"{q}'s stored bytes; the rest is bit-identical")

    def slice_parts(self, parts, index: int):
        w, s, b, q = parts
        return w[index], s[index], (b[index] if b is not None else None), q

    def recast_difference(self, role: str, a, b) -> str | None:
        from .requant import recast_difference

        return recast_difference(role, a, b)


SCHEMES = {mode: quant.register(MlxQuant(mode)) for mode in MODE_DEFAULTS}
