"""The kernel backends ``verify`` runs B's FFNs on: those asked for; by default the float64 reference and the
kernels of B's runtime (``Client.kernels``) that run natively here; ``all``: every one available here."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import FFNToolsError


class BackendError(FFNToolsError):
    """A requested kernel backend is unknown or cannot run on this machine."""


ALL = "all"


def resolve_backends(names: Sequence[str] | None = None, runtime: Sequence[str] = (),
                     client: str = "B's client") -> tuple[dict, dict[str, str]]:
    """The kernel backends to run: ``names`` (``["all"]``: every one available here), or by default the reference
    and the backends of ``runtime`` (B's client's, ``client``) that run natively here. A backend is imported
    only when it is to run (JAX, MLX and Triton take seconds to import).

    Returns:
        (name -> module, reference first; name -> why it did not run, for each backend not run).

    Raises:
        BackendError: a name is unknown, or explicitly requested but unavailable (saying why).
    """
    from ffn_tools import kernels

    skipped: dict[str, str] = {}
    if not names:
        chosen = ["reference"]
        for n in kernels.BACKENDS[1:]:
            if n not in runtime:
                skipped[n] = f"not a kernel {client} runs (--backend {n} or --backend all runs it)"
            elif why := kernels.emulated(n):
                skipped[n] = f"{why} (--backend {n} runs it so)"
            elif not (mod := kernels.get_backend(n)).available():
                skipped[n] = mod.why_unavailable()
            else:
                chosen.append(n)
        return {n: kernels.get_backend(n) for n in chosen}, skipped
    if list(names) == [ALL]:
        names = None
    if names:
        unknown = [n for n in names if n not in kernels.BACKENDS]
        if unknown:
            raise BackendError(f"unknown backend {', '.join(map(repr, unknown))}; "
                               f"use one of {', '.join(kernels.BACKENDS)}, or {ALL}")
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
