"""ffn-tools: split, fuse, convert and verify the SwiGLU feed-forward weights of LLM checkpoints.

The library behind the ``ffn-tools`` command; each command is one of these functions, taking paths or Hub ids
and returning what its ``--json`` prints (``api``). Importing it does not import torch (byte-moving commands
never need it) nor any other heavy framework.
"""

from .detect import FFNSet, find_ffns
from .errors import (CheckpointError, FFNToolsError, LayoutError, NothingToDoError, OutputExistsError,
                     SchemeError)
from .api import convert, extract, fuse_gateup, inspect, merge, split_gateup, verify
from .ffn import FFN, FFNRef, canonical_weights
from .layouts import GateUpLayout, fuse, split
from .library import SCHEMES, custom_scheme, load_scheme_file
from .registry import Scheme
from .io.readers import open_checkpoint
from .io.store import Checkpoint, TensorInfo
from .summary import inspect_checkpoint

__all__ = [
    "FFNSet", "find_ffns",
    "CheckpointError", "FFNToolsError", "LayoutError", "NothingToDoError", "OutputExistsError", "SchemeError",
    "inspect", "extract", "convert", "FFN", "FFNRef", "canonical_weights", "fuse_gateup", "split_gateup",
    "GateUpLayout", "fuse", "split", "SCHEMES", "Scheme", "custom_scheme", "load_scheme_file",
    "Checkpoint", "TensorInfo", "open_checkpoint", "inspect_checkpoint", "verify", "merge",
]

