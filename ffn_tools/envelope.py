"""The keys every command's JSON starts with: ``command``, ``input`` (a list for verify and merge), ``output`` (None
when nothing is written), ``summary`` (the one line the text output ends with) and ``warnings``; the command's own
fields follow (``ffn_tools.api``)."""

from __future__ import annotations

ENVELOPE = ("command", "input", "output", "summary", "warnings")


def envelope(command: str, inputs, output, summary: str, result: dict) -> dict:
    """``result`` with the keys every command's JSON starts with (see the module docstring)."""
    head = {"command": command, "input": inputs, "output": None if output is None else str(output),
            "summary": summary, "warnings": list(result.get("warnings") or [])}
    return {**head, **{k: v for k, v in result.items() if k not in ENVELOPE}}
