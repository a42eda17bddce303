"""One module per checkpoint format, each with the same surface.

Every format module (``pytorch``, ``mlx``, ``flax``, ``gguf``; ``native``, Meta's and Mistral's own layouts, read only)
defines:

    FORMAT: str                        the --to / detected name
    OPTIONS: frozenset[str]            format-specific keyword options ``export`` accepts
    can_read(path) -> bool             whether ``path`` looks like this format (cheap: names and headers)
    open(path) -> Checkpoint           a lazy read-only view with Hugging Face PyTorch names, (out, in)
                                       weights and per-expert tensors, so the FFN registry finds its FFNs;
                                       the formats of ``ABSENT_SHARDS`` also take ``absent_shards=True``
                                       (an index naming shards not on disk: ``Checkpoint.absent``)
    export(ckpt, out, *, dtype=None, force=False, max_shard_size=None, **options) -> dict
                                       write ``ckpt`` (any format's view) in this format; returns a summary

So converting is ``get(to).export(open_any(path), out, ...)``, and adding a format is adding a file.
Modules are imported lazily: a torch-only install never imports mlx or jax.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ffn_tools.errors import FFNToolsError

FORMATS = ("torch", "mlx", "flax", "gguf")
_MODULES = {"torch": "ffn_tools.converters.pytorch", "mlx": "ffn_tools.converters.mlx", "flax": "ffn_tools.converters.flax",
            "native": "ffn_tools.converters.native", "gguf": "ffn_tools.converters.gguf"}
# Options whose command-line flags are not simply --the-name.
_FLAGS = {"scheme": "--scheme/--scheme-file/--gate/--up/--down", "layout": "--layout/--order/--tp"}
# Order in which formats are tried when reading: the specific ones before plain PyTorch.
_READ_ORDER = ("gguf", "native", "mlx", "flax", "torch")
# Formats whose sharded index may name shards that are not on disk (``open(path, absent_shards=True)``):
# safetensors indexes, which ``verify --layers`` reads part of.
ABSENT_SHARDS = ("torch", "mlx")

__all__ = ["FORMATS", "get", "detect_format", "open_any", "convert"]


def get(fmt: str):
    """The module of a format.

    Raises:
        FFNToolsError: unknown format, or its framework is not installed.
    """
    if fmt not in _MODULES:
        raise FFNToolsError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    try:
        return importlib.import_module(_MODULES[fmt])
    except ImportError as e:
        raise FFNToolsError(f"format {fmt!r} needs a package that is not installed ({e}); "
                            f"install with: pip install 'ffn-tools[{fmt}]'") from None


def detect_format(path: str | Path) -> str:
    """The format of a checkpoint path ("torch" when no other format claims it)."""
    path = Path(path)
    for fmt in _READ_ORDER[:-1]:
        try:
            mod = get(fmt)
        except FFNToolsError:
            continue
        if mod.can_read(path):
            return fmt
    return "torch"


def open_any(path: str | Path, fmt: str | None = None, absent_shards: bool = False):
    """Open a checkpoint of any supported format as a Hugging Face PyTorch-named view.

    ``absent_shards``: a sharded index may name shards that are not on disk (``Checkpoint.absent`` lists
    them), in the formats of ``ABSENT_SHARDS``; the others refuse a missing shard as always.

    Raises:
        CheckpointError: the path cannot be read.
    """
    fmt = fmt or detect_format(path)
    if absent_shards and fmt in ABSENT_SHARDS:
        return get(fmt).open(Path(path), absent_shards=True)
    return get(fmt).open(Path(path))


def convert(path: str | Path, to: str, out: str | Path, *, dtype: str | None = None, force: bool = False,
            max_shard_size: int | None = None, **options) -> dict:
    """Convert the checkpoint at ``path`` to format ``to`` in ``out``.

    Options not meaningful for the target (e.g. ``quantize`` for flax) are refused, not ignored.

    Returns:
        The target module's export summary.

    Raises:
        FFNToolsError: unknown format or option, unreadable input, existing output, ...
    """
    mod = get(to)
    given = {k: v for k, v in options.items() if v is not None}
    wrong = sorted(set(given) - set(mod.OPTIONS))
    if wrong:
        flags = ", ".join(_FLAGS.get(w, "--" + w.replace("_", "-")) for w in wrong)
        raise FFNToolsError(f"{flags} does not apply to --to {to}")
    with open_any(path) as ckpt:
        return mod.export(ckpt, Path(out), dtype=dtype, force=force, max_shard_size=max_shard_size, **given)
