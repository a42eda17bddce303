"""The command being run, as it can be run again elsewhere: by ``--dry-run``'s sample child (``estimate``) and by
``--ray``'s tasks (``cluster``).

The command line, as the CLI parsed it (``cli.Group`` keeps it in ``ARGV``), runs again exactly; a library call runs
again where its options are plain data (JSON round-trips them), as the same ``api`` function. The functions that run
them again are the CLI's and the API's own, handed in (this module imports neither: they import it).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from contextvars import ContextVar

# the command line being run, as the CLI parsed it, its global options first; and the CLI's function running a
# command line again (``cli.run_again``: given by the CLI, which this module does not import)
ARGV: ContextVar[list[str] | None] = ContextVar("ffn_tools_argv", default=None)
RUNNER: ContextVar[Callable[[dict], None] | None] = ContextVar("ffn_tools_runner", default=None)
LOCAL = ("--dry-run", "--json", "--no-estimate", "--estimate", "--resume")  # flags of this run only, never rerun
NOT_RERUN = ("dry_run", "estimate", "resume", "ray", "upload_repo")  # the same, as the library's keywords


def argv() -> list[str] | None:
    """This command line without the flags of this run only, and without ``--ray [ADDRESS]`` (None: a library call)."""
    given = ARGV.get()
    if given is None:
        return None
    out, skip = [], False
    for a in given:
        if skip:
            skip = False
            if not a.startswith("-"):
                continue  # --ray's address
        if a in LOCAL:
            continue
        if a == "--ray":
            skip = True
            continue
        if a.startswith("--ray="):
            continue
        out.append(a)
    return out


def plain(options: dict) -> dict | None:
    """A library call's options to run again (None: one is not plain data)."""
    kept = {k: v for k, v in options.items() if k not in NOT_RERUN}
    try:
        return kept if json.loads(json.dumps(kept)) == kept else None
    except (TypeError, ValueError):
        return None


def replay(function: str, options: dict, library=None) -> dict | None:
    """What runs this command again, or None where it cannot be (a library call with an option that is not plain
    data): ``{"argv", "runner", "cwd"}`` (the CLI's runner, ``RUNNER``) for a command line, else ``{"function",
    "options", "runner", "cwd"}`` (``library``: the ``api``'s); ``cwd``: where relative paths are.
    ``call["runner"](call)`` runs it in a process (a Ray task's); ``command(call)`` is it as a child process's command
    line."""
    if (args := argv()) is not None:
        return {"argv": args, "runner": RUNNER.get(), "cwd": os.getcwd()}
    if (kept := plain(options)) is None:
        return None
    return {"function": function, "options": kept, "runner": library, "cwd": os.getcwd()}


def command(call: dict) -> list[str]:
    """``replay``'s call as a child process's command line."""
    if "argv" in call:
        return [sys.executable, "-m", "ffn_tools", *call["argv"]]
    code = f"import json, sys; import ffn_tools.api as a; a.{call['function']}(**json.loads(sys.argv[1]))"
    return [sys.executable, "-c", code, json.dumps(call["options"])]
