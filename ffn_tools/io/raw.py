"""``RawTensor``: a tensor's bytes with its safetensors dtype and shape, without torch.

What ``Checkpoint.read_raw`` returns and ``executor.execute`` writes: readers and exports that never need torch
(MLX, byte copies) pass tensors as these (importing torch costs over a second).
"""

from __future__ import annotations

from collections.abc import Sequence

from .dtypes import nbytes


class RawTensor(bytearray):
    """A tensor's bytes (C order, little-endian) with its safetensors dtype and shape."""

    def __init__(self, dtype: str, shape: Sequence[int], data: bytes | bytearray | None = None):
        self.dtype, self.shape = dtype, tuple(shape)
        super().__init__(nbytes(dtype, self.shape) if data is None else data)

    def __reduce_ex__(self, protocol):  # to come back from a worker process (bytearray defines its own)
        return RawTensor, (self.dtype, self.shape, bytes(self))

    @classmethod
    def of(cls, t) -> "RawTensor":
        """A torch tensor's bytes (bf16 included: bytes, never values)."""
        from .dtypes import as_st

        return cls(as_st(t.dtype), tuple(t.shape), _bytes(t))

    def to_torch(self):
        """The same bytes as a torch tensor (imports torch)."""
        import torch

        from .dtypes import torch_dtype

        if not len(self):
            return torch.empty(self.shape, dtype=torch_dtype(self.dtype))
        return torch.frombuffer(self, dtype=torch_dtype(self.dtype)).reshape(self.shape)


def _bytes(t) -> bytes:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
