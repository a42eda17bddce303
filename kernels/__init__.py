"""Fused gated-FFN kernels, one module per backend, the same surface each.

Every backend module (`kernels.reference`, `.triton`, `.metal`, `.mlx`, `.jax`) provides

    available() -> bool, why_unavailable() -> str, EXTRA (the ffn-tools extra installing its framework, or None)
    silu_mul(gate, up, *, activation="silu", single_rounding=False, out=None)
    silu_mul_fused(gate_up, *, order="gate-up", interleaved=False, activation="silu", single_rounding=False, out=None)
    ffn(x, gate_w, up_w, down_w, biases=None, *, activation="silu", single_rounding=False)

where `activation` is one of ACTIVATIONS or a `GLU` (the function with its clamp limit, silu slope alpha
and up offset, e.g. GPT-OSS's), taking and returning torch tensors (the output dtype is the input dtype, except the float64 reference).
Importing this package imports no heavy framework; `get_backend` imports one backend module on demand.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ffn_tools.kernels._surface import ACTIVATIONS, DTYPES, GLU, ORDERS

BACKENDS = ("reference", "triton", "metal", "mlx", "jax")
"""Backend module names, the float64 ground truth first."""

__all__ = ["ACTIVATIONS", "BACKENDS", "DTYPES", "GLU", "ORDERS", "available_backends", "emulated", "get_backend"]


def get_backend(name: str) -> ModuleType:
    """Import and return the backend module `kernels.<name>`.

    Raises:
        ValueError: `name` is not one of BACKENDS.
    """
    if name not in BACKENDS:
        raise ValueError(f"Unknown kernel backend {name!r}; known backends: {', '.join(BACKENDS)}.")
    return importlib.import_module(f"ffn_tools.kernels.{name}")


def available_backends() -> list[str]:
    """Names of the backends that can run here, in BACKENDS order."""
    return [name for name in BACKENDS if get_backend(name).available()]


def emulated(name: str) -> str | None:
    """Why backend ``name`` would run here only through an emulator, or None; decided without importing it:
    Triton without a CUDA device runs through its interpreter on the CPU."""
    if name == "triton":
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device here: Triton would run through its interpreter on the CPU"
    return None
