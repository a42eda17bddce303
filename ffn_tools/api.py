"""The library as the command line is: every command a function taking paths (or Hub ids, ``org/name[@rev]``)
and returning what its ``--json`` prints (``verify`` returns its report; ``.as_dict()`` is that JSON).

    import ffn_tools
    ffn_tools.inspect("./phi3")["ffn"]                 # what `ffn-tools inspect ./phi3 --json` prints
    ffn_tools.split_gateup("./phi3", "./phi3-split")
    ffn_tools.convert("./phi3", "mlx", "./phi3-mlx", quantize=4)
    assert ffn_tools.verify("./phi3", "./phi3-mlx").passed
"""

from __future__ import annotations

from pathlib import Path

from .hub import resolve


def inspect(path, *, scheme=None, layout=None, tensors: bool = False) -> dict:
    """``ffn-tools inspect PATH --json``: architecture, scheme, FFNs, sizes (and every tensor with ``tensors``)."""
    from converters import open_any

    from .summary import inspect_checkpoint

    with open_any(resolve(str(path))) as ckpt:
        return inspect_checkpoint(ckpt, scheme, layout, tensors=tensors)


def extract(path, out, *, layers: str | None = None, experts: str | None = None, scheme=None, layout=None,
            force: bool = False, max_shard_size: int | None = None) -> dict:
    """``ffn-tools extract PATH -o OUT --json``: the FFNs alone, canonical names; returns the manifest."""
    from converters import open_any

    from .extract import extract as run

    with open_any(resolve(str(path))) as ckpt:
        return run(ckpt, Path(out), layers=layers, experts=experts, scheme=scheme, layout=layout, force=force,
                   max_shard_size=max_shard_size)


def split_gateup(path, out=None, **options) -> dict:
    """``ffn-tools split-gateup PATH [-o OUT] --json`` (options as ``gateup.split_gateup``)."""
    from .gateup import split_gateup as run

    return run(resolve(str(path)), out, **options)


def fuse_gateup(path, out=None, **options) -> dict:
    """``ffn-tools fuse-gateup PATH [-o OUT] --json`` (options as ``gateup.fuse_gateup``)."""
    from .gateup import fuse_gateup as run

    return run(resolve(str(path)), out, **options)


def convert(path, to: str, out, **options) -> dict:
    """``ffn-tools convert PATH --to FORMAT -o OUT --json`` (options as ``converters.convert``)."""
    from converters import convert as run

    return run(resolve(str(path)), to, Path(out), **options)


def verify(a, b, **options):
    """``ffn-tools verify A B``: the report (``.passed``, ``.lines()``, ``.as_dict()`` = the --json)."""
    from .verification import verify as run

    return run(resolve(str(a)), resolve(str(b)), **options)
