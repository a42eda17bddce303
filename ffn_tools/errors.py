"""Exceptions ffn-tools raises for user-facing problems.

Every message says what went wrong, where (file or tensor), and how to fix it. The CLI turns these into a
one-line error with no traceback; anything else escaping is a bug.
"""


def listing(items, limit: int = 8) -> str:
    """``a, b, c, ... (N more)``: the first ``limit`` names of a list in a message."""
    items = list(items)
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def counted(n: int, noun: str) -> str:
    """``1 FFN``, ``2 FFNs``, ``0 layers``: a count and its noun, plural unless it is one."""
    return f"{n} {noun}{'s' * (n != 1)}"


class FFNToolsError(Exception):
    """Base class: a problem with the user's input or request, not a bug.

    A message that names what the caller passed names it as the library's keyword (``out=``, ``force=True``);
    ``flags`` maps each such keyword to the command-line flag that gives it (``-o``, ``--force``), and the CLI
    shows the flags (``for_cli``): each layer speaks its caller's language.
    """

    def __init__(self, message: str = "", flags: dict[str, str] | None = None):
        super().__init__(message)
        self.flags = dict(flags or {})

    def for_cli(self) -> str:
        """The message with the keywords it names as the command line's flags."""
        message = str(self)
        for keyword, flag in (getattr(self, "flags", None) or {}).items():  # a subclass may skip __init__
            message = message.replace(keyword, flag)
        return message


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
