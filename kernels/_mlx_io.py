"""Exact torch <-> mlx conversion, shared by kernels.mlx and kernels.metal.

bfloat16 travels as its raw 16 bits (numpy has no bfloat16), so no value is ever rounded on the way.
"""

from __future__ import annotations

import numpy as np
import torch


def to_mlx(t: torch.Tensor):
    """A torch tensor (any device) as an mlx array with identical values and dtype."""
    import mlx.core as mx

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def to_torch(a, device: torch.device | str = "cpu") -> torch.Tensor:
    """An mlx array as a torch tensor on `device` with identical values and dtype."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.int16))).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.array(a)).to(device)


def mlx_dtype(dtype: torch.dtype):
    import mlx.core as mx

    return {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}[dtype]
