"""ffn-tools: split, fuse, convert and verify the SwiGLU feed-forward weights of LLM checkpoints.

The library behind the ``ffn-tools`` command; each command is one of these functions, taking paths or Hub ids
and returning what its ``--json`` prints (``api``). Importing it does not import torch (byte-moving commands
never need it) nor any other heavy framework.
"""

import importlib
from typing import TYPE_CHECKING

# each public name and the module it comes from: imported when first asked for (PEP 562), so that a process that
# needs one corner of ffn-tools (a GGUF worker, a llama.cpp child, ``--help``) does not import every command's
# modules first (0.33 s of each child's start)
_FROM = {
    "FFNSet": "detect", "find_ffns": "detect",
    "CheckpointError": "errors", "FFNToolsError": "errors", "LayoutError": "errors", "NothingToDoError": "errors",
    "OutputExistsError": "errors", "SchemeError": "errors",
    "convert": "api", "extract": "api", "fuse_gateup": "api", "inspect": "api", "merge": "api",
    "split_gateup": "api", "verify": "api",
    "FFN": "ffn", "FFNRef": "ffn", "canonical_weights": "ffn",
    "GateUpLayout": "layouts", "fuse": "layouts", "split": "layouts",
    "SCHEMES": "library", "custom_scheme": "library", "load_scheme_file": "library",
    "Scheme": "registry", "open_checkpoint": "io.readers", "Checkpoint": "io.store", "TensorInfo": "io.store",
    "inspect_checkpoint": "summary",
}

if TYPE_CHECKING:
    from .api import convert, extract, fuse_gateup, inspect, merge, split_gateup, verify
    from .detect import FFNSet, find_ffns
    from .errors import (CheckpointError, FFNToolsError, LayoutError, NothingToDoError, OutputExistsError,
                         SchemeError)
    from .ffn import FFN, FFNRef, canonical_weights
    from .io.readers import open_checkpoint
    from .io.store import Checkpoint, TensorInfo
    from .layouts import GateUpLayout, fuse, split
    from .library import SCHEMES, custom_scheme, load_scheme_file
    from .registry import Scheme
    from .summary import inspect_checkpoint


def __getattr__(name: str):
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'ffn_tools' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_FROM])


__all__ = [
    "FFNSet", "find_ffns",
    "CheckpointError", "FFNToolsError", "LayoutError", "NothingToDoError", "OutputExistsError", "SchemeError",
    "inspect", "extract", "convert", "FFN", "FFNRef", "canonical_weights", "fuse_gateup", "split_gateup",
    "GateUpLayout", "fuse", "split", "SCHEMES", "Scheme", "custom_scheme", "load_scheme_file",
    "Checkpoint", "TensorInfo", "open_checkpoint", "inspect_checkpoint", "verify", "merge",
]

