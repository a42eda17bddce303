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
                skipped[n] = why_unavailable(mod)
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
                raise BackendError(f"backend {n!r} is not available here: {why_unavailable(mod)}")
    else:
        chosen = []
        for n in kernels.BACKENDS:
            mod = kernels.get_backend(n)
            if mod.available():
                chosen.append(n)
            else:
                skipped[n] = why_unavailable(mod)
    chosen.sort(key=lambda n: n != "reference")
    return {n: kernels.get_backend(n) for n in chosen}, skipped


def why_unavailable(mod) -> str:
    """A backend module's reason it cannot run, with the pip command that installs its extra from where ffn-tools
    came from (``errors.pip_install``) where its framework is what is missing (kernels/ imports nothing of ours)."""
    why = mod.why_unavailable()
    if mod.EXTRA and " is not installed (" in why:
        from ..errors import pip_install

        why += f": {pip_install(mod.EXTRA)}"
    return why
