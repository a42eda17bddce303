"""A' for ``--generate`` and ``--locate``: B's form re-derived from A, the change that is not a defect, which both
hold B's distance from A against (``floor_side``), and where it is written (``floor_path``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..clients import Client
from ..errors import FFNToolsError
from .options import Models

log = logging.getLogger("ffn_tools.verification.generate")


def floor_side(models: Models, recipe: dict | None, a_dtype: str | None, tmp: Path,
               allow_config: Sequence[str] = ()) -> tuple[Path, Client, str | None, str] | str:
    """A' (see the module docstring): (its path, the client that runs it, the dtype to compute in, how it was
    made in words), or why there is none. ``recipe``: B's form as ``convert`` options (``Format.recipe``);
    ``a_dtype``: A's weights' dtype; ``allow_config``: the settings verify accepts differing, which the floor's
    conversion (``models.convert``, the registry's) accepts too."""
    a, (ca, cb), clients = Path(models.paths[0]), models.ckpts, models.clients
    fa, fb = ca.format, cb.format
    if recipe is None:
        return f"B's form ({cb.described}) cannot be re-derived from A here"
    plain = fa is fb and set(recipe) <= {"dtype"}
    if plain and recipe.get("dtype") in (None, a_dtype):
        return a, clients[0], None, f"A run again by {clients[0].name} (its run-to-run noise)"
    if plain:
        return a, clients[0], recipe["dtype"], f"A computed in B's dtype {recipe['dtype']} by {clients[0].name}"
    if models.convert is None:
        return f"B's form ({cb.described}) cannot be re-derived from A here (no converter was given)"
    out = floor_path(tmp, Path(cb.path))
    words = ", ".join(f"{k} {v}" for k, v in recipe.items() if v is not None and v is not True)
    log.info("re-deriving B's form from A for the noise floor (%s: %s)", fb.name, words)
    try:
        models.convert(str(a), fb.name, out, allow_config=allow_config, **recipe)
    except FFNToolsError as e:
        return f"B's form ({fb.name}, {words}) could not be re-derived from A: {e}"
    return out, clients[1], None, f"A converted to B's form ({fb.name}, {words}) by ffn-tools, run by {clients[1].name}"


def floor_path(tmp: Path, b: Path) -> Path:
    """Where A' is written: laid out as B is, a file named with B's suffix where B is one file (a format whose
    checkpoint is one file is read by its name), else a directory. (A B that its client runs as a whole model and
    is one file is such a format's: a directory's clients refuse a file, ``Client.ready_for_logits``.)"""
    return tmp / ("floor" + b.suffix if b.is_file() else "floor")
