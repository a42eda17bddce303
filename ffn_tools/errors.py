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


def pip_install(extra: str, dist=None) -> str:
    """The pip command that installs ffn-tools' ``extra`` from where this ffn-tools came from, for a message that
    says how to fix a missing package: its source checkout (``pip install -e '/src/ffn-tools[mlx]'``, as
    README's install from a clone), the URL it was installed from, or the index it came from (the only case that
    names ``ffn-tools[mlx]`` on an index, so a package another registered under that name is never suggested);
    where none of those is there any more, the extra's own requirements (``pip install 'mlx>=0.32' ...``).

    Args:
        extra: an extra of ffn-tools' pyproject.toml ("mlx", "gguf").
        dist: the installed distribution (an ``importlib.metadata.Distribution``; default: ffn-tools').
    """
    import importlib.metadata
    import json
    import shlex
    from pathlib import Path
    from urllib.parse import unquote, urlparse
    from urllib.request import url2pathname

    if dist is None:  # the one pip installed (a checkout's build leaves an ffn_tools.egg-info, without its origin)
        found = sorted(importlib.metadata.distributions(name="ffn-tools"),
                       key=lambda d: d.read_text("direct_url.json") is None)
        if not found:  # run from a checkout that was never installed
            root = Path(__file__).resolve().parents[1]
            return f"pip install -e {shlex.quote(f'{root}[{extra}]')}"
        dist = found[0]
    try:
        origin = json.loads(dist.read_text("direct_url.json") or "null")  # PEP 610: how pip installed it
    except ValueError:
        origin = None
    name = dist.metadata["Name"]
    if not isinstance(origin, dict) or not isinstance(origin.get("url"), str):
        return f"pip install {shlex.quote(f'{name}[{extra}]')}"  # from an index: the name is this package there
    url, vcs, where = origin["url"], origin.get("vcs_info"), origin.get("dir_info")
    if isinstance(vcs, dict):  # pip install git+https://...: the same repository and commit
        source = f"{vcs.get('vcs', 'git')}+{url}" + (f"@{vcs['commit_id']}" if vcs.get("commit_id") else "")
        return f"pip install {shlex.quote(f'{name}[{extra}] @ {source}')}"
    local = Path(url2pathname(unquote(urlparse(url).path))) if url.startswith("file:") else None
    if local is None:  # an archive's URL
        return f"pip install {shlex.quote(f'{name}[{extra}] @ {url}')}"
    if local.is_dir():  # a clone, as README installs it
        editable = "-e " if isinstance(where, dict) and where.get("editable") else ""
        return f"pip install {editable}{shlex.quote(f'{local}[{extra}]')}"
    if local.is_file():  # a wheel or sdist on disk
        return f"pip install {shlex.quote(f'{name}[{extra}] @ {url}')}"
    marker = f'extra == "{extra}"'  # the checkout or archive is gone: what the extra installs, by name
    needs = [r.split(";")[0].replace(" ", "") for r in dist.requires or [] if marker in r.replace("'", '"')]
    if not needs:  # no such extra recorded: say which, never an empty command
        return f"pip install ffn-tools' {extra!r} extra from its source (it was installed from {local}, gone now)"
    return "pip install " + " ".join(shlex.quote(r) for r in needs)


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
