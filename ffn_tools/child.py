"""The environment of the Python children ffn-tools starts (llama.cpp's converter and runner): this interpreter's
``sys.path``, less a source checkout's root, and ``PYTHONSAFEPATH`` so that ``python -m`` does not put the working
directory first. A checkout's top-level ``kernels/`` and ``converters/`` (installed as ``ffn_tools.kernels`` and
``ffn_tools.converters``) would otherwise shadow packages of those names: Hugging Face's ``kernels``, which
transformers imports when it builds a model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent  # the repository root of an editable install (else site-packages)


def _shadows(entry: str) -> bool:
    path = Path(entry or os.getcwd()).resolve()
    return path == CHECKOUT and (path / "kernels").is_dir()


def python_env(first: tuple[str, ...] = ()) -> dict[str, str]:
    """``os.environ`` for a Python child: ``PYTHONPATH`` = ``first`` then this process's path without the
    checkout's root, ``PYTHONSAFEPATH=1``."""
    paths = [*first, *(p for p in sys.path if not _shadows(p))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONSAFEPATH": "1"}


def clean_path() -> None:
    """This process's ``sys.path`` without the checkout's root: for a process ffn-tools did not start itself (a Ray
    worker, which puts the driver's working directory on its path)."""
    sys.path[:] = [p for p in sys.path if not _shadows(p)]
