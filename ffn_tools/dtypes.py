"""Dtype names: safetensors' strings, torch dtypes, and the names users type."""

from __future__ import annotations

import torch

from .errors import FFNToolsError

# safetensors dtype string -> torch dtype. Bytes per element come from torch.
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}

# Names accepted on the command line and in config.json ("torch_dtype" / "dtype").
USER_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}
# The choices offered by --dtype options.
DTYPE_CHOICES = ("float32", "float16", "bfloat16")


def itemsize(st_dtype: str) -> int:
    """Bytes per element of a safetensors dtype string."""
    return torch_dtype(st_dtype).itemsize


def torch_dtype(st_dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string.

    Raises:
        FFNToolsError: the string is not a dtype safetensors defines.
    """
    try:
        return ST_TO_TORCH[st_dtype]
    except KeyError:
        raise FFNToolsError(f"unsupported tensor dtype {st_dtype!r}; known: {', '.join(ST_TO_TORCH)}") from None


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype."""
    try:
        return TORCH_TO_ST[dtype]
    except KeyError:
        raise FFNToolsError(f"dtype {dtype} cannot be stored in safetensors") from None


def parse_user_dtype(name: str) -> torch.dtype:
    """Turn 'bfloat16', 'bf16', 'torch.float16', ... into a torch dtype.

    Raises:
        FFNToolsError: the name is not a floating dtype ffn-tools writes.
    """
    key = name.lower().removeprefix("torch.")
    if key not in USER_DTYPES:
        raise FFNToolsError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_CHOICES)}")
    return USER_DTYPES[key]


def short_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the name printed in reports."""
    return str(dtype).removeprefix("torch.")
