"""Quantization schemes, one registry: each scheme one ``QuantScheme`` object (``base``), found, decoded, moved
and checked through that one interface.

    fp8         FP8_BLOCKS       a weight beside X.weight_scale_inv / X.weight_scale (DeepSeek, Qwen3-FP8)
    mxfp4       MXFP4            GPT-OSS's X_blocks + X_scales
    nvfp4       MODELOPT_NVFP4   ModelOpt's NVFP4 (compressed-tensors' convention: ctensors.CT_NVFP4)
    ctensors    CT_INT, CT_NVFP4, CT_FLOAT8   compressed-tensors' pack-quantized, nvfp4, float-quantized
    gptq        GPTQ, AWQ        their 4-bit packings

Formats with a quantization of their own (MLX's modes, GGUF's types) register their schemes here when their
package is imported (``register``); their checkpoint views decode them and say so through the same interface
(``Checkpoint.quantized``). ``decoded(ckpt)`` is the one place a stored checkpoint becomes its decoded view.
"""

from __future__ import annotations

from .base import DIFFERS, IDENTICAL, WITHIN, Blocks, Fp4Codes, IntCodes, Module, QuantScheme
from .ctensors import CT_FLOAT8, CT_INT, CT_NVFP4
from .fp8 import FP8_BLOCKS
from .gptq import AWQ, GPTQ
from .mxfp4 import MXFP4
from .nvfp4 import MODELOPT_NVFP4
from .view import DecodedView

__all__ = ["SCHEMES", "register", "find", "decoded", "kept", "describe", "QuantScheme", "Module", "IntCodes", "Fp4Codes", "Blocks", "DecodedView", "IDENTICAL",
           "WITHIN", "DIFFERS"]

# In the order they claim stored tensors: compressed-tensors' FP8 modules before FP8 blocks (both are a weight
# beside a ``weight_scale``; a compressed-tensors config says which).
SCHEMES: list[QuantScheme] = [MXFP4, CT_INT, CT_NVFP4, MODELOPT_NVFP4, CT_FLOAT8, GPTQ, AWQ, FP8_BLOCKS]


def register(scheme: QuantScheme) -> QuantScheme:
    """Add a format's own scheme to the registry (once); returns it."""
    if all(s.name != scheme.name for s in SCHEMES):
        SCHEMES.append(scheme)
    return scheme


def find(ckpt, every: bool = False, only=None) -> dict[str, Module]:
    """Decoded name -> Module for every weight ``ckpt`` stores quantized under a scheme read decoded by every
    command (``every``: under any scheme, FP8 blocks included, as verify reads them; ``only``: under the
    schemes of these names).

    Raises:
        CheckpointError: a scheme's tensors are there but do not fit it.
    """
    found: dict[str, Module] = {}
    claimed: set[str] = set()
    for scheme in SCHEMES:
        if not (every or scheme.decoded_on_read) or (only is not None and scheme.name not in only):
            continue
        for name, m in scheme.find(ckpt).items():
            if name in found or claimed.intersection(m.parts.values()):
                continue
            found[name] = m
            claimed.update(m.parts.values())
    return found


def decoded(ckpt, every: bool = False, only=None):
    """``ckpt`` seen with its quantized weights decoded (``find``, with ``every`` and ``only``), or ``ckpt``
    itself where it has none; a view already decoded is decoded again from what it reads."""
    raw = ckpt.raw if isinstance(ckpt, DecodedView) else ckpt
    found = find(raw, every, only)
    if isinstance(ckpt, DecodedView) and found.keys() == ckpt.modules.keys():
        return ckpt
    return DecodedView(raw, found) if found else raw


def kept(ckpt) -> list[dict]:
    """What ``ckpt`` holds quantized and reads as stored (FP8 blocks: a weight and its scale), described as
    ``inspect`` lists it; [] when nothing."""
    return [d for s in SCHEMES if not s.decoded_on_read and (ms := list(s.find(ckpt).values())) for d in s.describe(ms)]


def describe(ckpt) -> list[dict]:
    """``inspect``'s quantization lines: what ``ckpt`` keeps stored quantized (``kept``), then what it reads
    decoded (``Checkpoint.decoded``)."""
    return kept(ckpt) + ckpt.decoded()
