"""Dtype names: safetensors' strings, torch dtypes, and the names users type.

The tables here are plain Python so that byte-moving commands (split, fuse, copy) never import torch:
importing torch costs over a second, more than copying a gigabyte. torch dtypes are looked up lazily.
"""

from __future__ import annotations

from ..errors import FFNToolsError

# safetensors dtype string -> (bytes per element, torch attribute name = the name printed in reports)
ST_DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I64": (8, "int64"),
    "I32": (4, "int32"),
    "I16": (2, "int16"),
    "I8": (1, "int8"),
    "U8": (1, "uint8"),
    "U16": (2, "uint16"),
    "U32": (4, "uint32"),
    "U64": (8, "uint64"),
    "BOOL": (1, "bool"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
}
_BY_NAME = {name: st for st, (_, name) in ST_DTYPES.items()}
FLOAT_ST = frozenset(st for st, (_, name) in ST_DTYPES.items() if name.startswith(("float", "bfloat")))

# Names accepted on the command line and in config.json ("torch_dtype" / "dtype").
USER_DTYPES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64",
}
# The choices offered by --dtype options.
DTYPE_CHOICES = ("float32", "float16", "bfloat16")


def _check(st: str) -> str:
    if st not in ST_DTYPES:
        raise FFNToolsError(f"unsupported tensor dtype {st!r}; known: {', '.join(ST_DTYPES)}")
    return st


def as_st(dtype) -> str:
    """The safetensors dtype string of a torch dtype, or of a safetensors string (checked)."""
    if isinstance(dtype, str):
        return _check(dtype)
    name = str(dtype).removeprefix("torch.")
    if name not in _BY_NAME:
        raise FFNToolsError(f"dtype {dtype} cannot be stored in safetensors")
    return _BY_NAME[name]



def st_of_name(name: object) -> str:
    """The safetensors dtype string of a torch dtype's name ("bfloat16" -> "BF16"), without importing torch.

    Raises:
        FFNToolsError: a dtype safetensors cannot hold.
    """
    key = str(name).removeprefix("torch.")
    if key not in _BY_NAME:
        raise FFNToolsError(f"dtype {name} cannot be stored in safetensors")
    return _BY_NAME[key]


def itemsize(dtype) -> int:
    """Bytes per element of a safetensors dtype string or torch dtype."""
    return ST_DTYPES[as_st(dtype)][0]


def nbytes(dtype, shape) -> int:
    """Bytes of a tensor of ``dtype`` (torch or safetensors) and ``shape``."""
    n = itemsize(dtype)
    for d in shape:
        n *= d
    return n


def short_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 or 'BF16': the name printed in reports."""
    return ST_DTYPES[as_st(dtype)][1]


def torch_dtype(dtype):
    """The torch dtype of a safetensors dtype string (imports torch)."""
    import torch

    return getattr(torch, short_name(dtype))


def parse_user_dtype(name: str):
    """Turn 'bfloat16', 'bf16', 'torch.float16', ... into a torch dtype.

    Raises:
        FFNToolsError: the name is not a floating dtype ffn-tools writes.
    """
    key = name.lower().removeprefix("torch.")
    if key not in USER_DTYPES:
        raise FFNToolsError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_CHOICES)}")
    return torch_dtype(_BY_NAME[USER_DTYPES[key]])
