"""The kernel backends ``verify`` runs B's FFNs on: those asked for, or every one available here."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import FFNToolsError


class BackendError(FFNToolsError):
    """A requested kernel backend is unknown or cannot run on this machine."""


def resolve_backends(names: Sequence[str] | None = None) -> tuple[dict, dict[str, str]]:
    """The kernel backends to run: ``names``, or every one available here.

    Returns:
        (name -> module, reference first; name -> why it was skipped, for the unavailable defaults).

    Raises:
        BackendError: a name is unknown, or explicitly requested but unavailable (saying why).
    """
    from ffn_tools import kernels

    skipped: dict[str, str] = {}
    if names:
        unknown = [n for n in names if n not in kernels.BACKENDS]
        if unknown:
            raise BackendError(f"unknown backend {', '.join(map(repr, unknown))}; "
                               f"use one of {', '.join(kernels.BACKENDS)}")
        chosen = list(dict.fromkeys(names))
        for n in chosen:
            mod = kernels.get_backend(n)
            if not mod.available():
                raise BackendError(f"backend {n!r} is not available here: {mod.why_unavailable()}")
    else:
        chosen = []
        for n in kernels.BACKENDS:
            mod = kernels.get_backend(n)
            if mod.available():
                chosen.append(n)
            else:
                skipped[n] = mod.why_unavailable()
    chosen.sort(key=lambda n: n != "reference")
    return {n: kernels.get_backend(n) for n in chosen}, skipped
