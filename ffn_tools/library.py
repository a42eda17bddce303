"""The built-in naming families (``schemes/families.json``, read by ``families``) and the user's own schemes
(``--scheme-file``, ``--gate/--up/--down``): what detection matches a checkpoint's tensor names against."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .errors import SchemeError
from .families import Problems, load_library, read_json, read_scheme
from .layouts import CONCAT, GateUpLayout
from .registry import ROLES, Group, Scheme

# Where a layer lives in a checkpoint (plain and multimodal roots), the built-in groups as declared (a scheme
# file may name them), the families in table order, and every group of every family once: what detection
# matches a checkpoint against.
_LIBRARY_PREFIXES, GROUPS, SCHEMES = load_library()
LAYER_PREFIXES: tuple[str, ...] = tuple(p for p, _ in _LIBRARY_PREFIXES)
LIBRARY: tuple[Group, ...] = tuple(dict.fromkeys(g for s in SCHEMES.values() if not s.by_model_type_only
                                                 for g in s.groups))


def scheme_for_model_type(model_type: str | None) -> Scheme | None:
    """The family a config's ``model_type`` selects, if any."""
    for s in SCHEMES.values():
        if model_type in s.model_types:
            return s
    return None


def load_scheme_file(path: str | Path) -> Scheme:
    """Read a user's scheme (``--scheme-file``), in the form of the built-in ones (see the module docstring).

    Raises:
        SchemeError: the file is missing, not JSON, or does not describe a scheme (every problem, by key).
    """
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, dict):
        raise SchemeError(f"{path}: a scheme file holds a JSON object")
    problems = Problems(str(path))
    return problems.checked(read_scheme(data, "", problems, GROUPS, _LIBRARY_PREFIXES, path.stem, f"from {path}"))


def custom_scheme(gate: str | None = None, up: str | None = None, down: str | None = None,
                  gate_up: str | None = None, layout: GateUpLayout = CONCAT) -> Scheme:
    """A one-group scheme from ``--gate/--up/--down`` (or ``--gate-up``) templates: the short form.

    Raises:
        SchemeError: a template is missing or malformed.
    """
    if not down or not ((gate and up) or gate_up) or bool(gate) != bool(up):
        raise SchemeError("custom templates need --down and either both --gate and --up or --gate-up")
    problems = Problems(None)
    given = {r: t for r, t in zip(ROLES, (gate, up, down, gate_up)) if t}
    return problems.checked(read_scheme({**given, "layout": dataclasses.asdict(layout)}, "", problems, GROUPS,
                                    _LIBRARY_PREFIXES, "custom", "templates given on the command line"))
