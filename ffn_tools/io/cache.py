"""This user's cache of ffn-tools: ``$FFN_TOOLS_CACHE``, else ``$XDG_CACHE_HOME/ffn-tools``, else
``~/.cache/ffn-tools``. llama.cpp's converter fetched for ``--to gguf`` lies there (``converters.gguf.source``), and
the ledgers of verify's FFN steps (``verification.ledger``)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FFN_TOOLS_CACHE"


def cache_dir() -> Path:
    """This user's cache of ffn-tools: ``$FFN_TOOLS_CACHE``, ``$XDG_CACHE_HOME/ffn-tools``, ``~/.cache/ffn-tools``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ffn-tools"
