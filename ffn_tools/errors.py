"""Exceptions ffn-tools raises for user-facing problems.

Every message says what went wrong, where (file or tensor), and how to fix it. The CLI turns these into a
one-line error with no traceback; anything else escaping is a bug.
"""


def listing(items, limit: int = 8) -> str:
    """``a, b, c, ... (N more)``: the first ``limit`` names of a list in a message."""
    items = list(items)
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


class FFNToolsError(Exception):
    """Base class: a problem with the user's input or request, not a bug."""


class CheckpointError(FFNToolsError):
    """A checkpoint cannot be opened or read (missing, truncated, corrupted, unsafe)."""


class SchemeError(FFNToolsError):
    """The FFN tensors cannot be found: unknown architecture, ambiguous or non-matching templates."""


class LayoutError(FFNToolsError):
    """A gate/up layout does not fit a tensor (odd rows, TP degree not dividing, mixed layouts)."""


class OutputError(FFNToolsError):
    """The output cannot be written: its parent is a file or read-only, another process writes it, the disk
    is full."""


class OutputExistsError(FFNToolsError):
    """The output path exists and --force was not given, or it is the input path."""


class NothingToDoError(FFNToolsError):
    """The request would produce no change (for example nothing to split)."""
