"""Checkpoint formats: one package each, each one ``ffn_tools.formats.Format`` object, registered here.

    pytorch   Hugging Face safetensors and weights-only pickles     runtimes: transformers
    mlx       the model directories mlx_lm reads and writes         runtimes: mlx_lm
    flax      flax.serialization msgpack trees (hf, linen layouts)  runtimes: transformers, running its weights (no
                                                                    Flax runtime here: transformers 5 has none)
    gguf      llama.cpp's files                                     runtimes: llama.cpp
    dcp       torch.distributed.checkpoint dirs (torchtitan, FSDP) runtimes: transformers, running its weights
                                                                    (torch.distributed.checkpoint loads it)
    orbax     orbax.checkpoint dirs (Flax/JAX, MaxText)             runtimes: transformers, running its weights
                                                                    (orbax.checkpoint loads it)
    native    Meta's and Mistral's own layouts (read only)          runtimes: none here (``Format.unloaded``)

``FORMATS`` is the one table: name -> the module that defines its ``FORMAT`` (relative to this package, or
absolute), imported on first use (a torch-only install never imports mlx or jax). Converting is
``get(to).export(open_any(path), out, ...)``. Adding a format is adding a package and a line here: its
``FORMAT`` declares whether it writes and its options (``formats.Option``), from which the command line draws
``convert --to``'s choices and the format's flags, and the runtimes that load it (``Format.runtimes``, the default
first, each built by its ``load_runtime``; ``clients.runtime(fmt, name)`` picks one); nothing else names it.

``ADAPTERS`` is the same table for LoRA adapters (``ffn_tools.adapters.formats.AdapterFormat``, each module defining
``ADAPTER``), which ``ffn_tools.adapters`` reaches only through it:

    peft   adapter_config.json + adapter_model.safetensors, as PEFT saves a LoRA   pytorch/peft.py
    mlx    adapter_config.json + adapters.safetensors, as mlx_lm.lora saves one    mlx/lora.py
    gguf   a GGUF of general.type "adapter", as llama.cpp's convert_lora_to_gguf  gguf/lora.py
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

from typing import TYPE_CHECKING

from ffn_tools.errors import CheckpointError, FFNToolsError
from ffn_tools.formats import Format, Option, missing_package
from ffn_tools.io import nogc
from ffn_tools.io.run import NO_RUN, Run
from ffn_tools.io.store import Checkpoint

if TYPE_CHECKING:
    from ffn_tools.checks.semantics import Difference

# What only converting and reading need (MTP heads, the runtimes' semantics, the readers) is imported where it is
# used: a format's child processes (the GGUF tensor writer's, its quantizer's) import this package first.

FORMATS = {"torch": ".pytorch", "mlx": ".mlx", "flax": ".flax", "gguf": ".gguf", "dcp": ".dcp", "orbax": ".orbax",
           "native": ".native"}
ADAPTERS = {"peft": ".pytorch.peft", "mlx": ".mlx.lora", "gguf": ".gguf.lora"}  # in detection order
ADAPTER_ALIASES = {"torch": "peft"}  # convert's --to names that write another adapter format's (a torch adapter: PEFT's)
# convert's own options a format may take (``Format.takes``) whose flags are not simply --the-name.
FLAGS = {"scheme": "--scheme/--scheme-file/--gate/--up/--down", "layout": "--layout/--order/--tp"}

__all__ = ["FORMATS", "ADAPTERS", "ADAPTER_ALIASES", "get", "writable", "options", "detect_format", "open_any", "open_sides", "convert", "client_differences"]


def get(fmt: str) -> Format:
    """The format named ``fmt``.

    Raises:
        FFNToolsError: unknown format, or its framework is not installed.
    """
    if fmt not in FORMATS:
        raise FFNToolsError(f"unknown format {fmt!r}; use one of {', '.join(writable())}")
    try:
        module = importlib.import_module(FORMATS[fmt], __name__)
    except ImportError as e:
        hint = missing_package(e)  # which extra installs the package: the one table, ``formats.EXTRAS``
        raise FFNToolsError(f"format {fmt!r} needs a package that is not installed ({e})"
                            + (f"; {hint}" if hint else "")) from None
    return module.FORMAT


def writable() -> tuple[str, ...]:
    """The formats ``convert`` writes (``--to``'s choices), in the registry's order: each whose ``FORMAT.writes``,
    and any whose package does not import here (``get`` then says what to install, rather than ``--to`` not
    knowing the name)."""
    out = []
    for name in FORMATS:
        try:
            if not get(name).writes:
                continue
        except FFNToolsError:
            pass
        out.append(name)
    return tuple(out)


def options(command: str = "convert") -> list[Option]:
    """Every option the writable formats declare for ``command`` (``Format.options``), once each, in the registry's
    order: what the command line draws its flags from. Two formats may declare one option (the same keyword) only
    alike.

    Raises:
        FFNToolsError: two formats declare one keyword or one flag otherwise.
    """
    seen: dict[str, Option] = {}
    flags: dict[str, str] = {}
    for name in writable():
        try:
            declared = get(name).options
        except FFNToolsError:
            continue
        for o in declared:
            if command not in o.commands:
                continue
            if o.name in seen and seen[o.name] != o:
                raise FFNToolsError(f"format {name!r} declares option {o.name!r} otherwise than another format")
            for f in o.cli_flags:
                if flags.setdefault(f, o.name) != o.name:
                    raise FFNToolsError(f"format {name!r} declares {f} for {o.name!r}, another format's flag")
            seen.setdefault(o.name, o)
    return list(seen.values())


def _available() -> list[Format]:
    """The formats whose packages import here, in detection order."""
    out = []
    for name in FORMATS:
        try:
            out.append(get(name))
        except FFNToolsError:
            continue
    return sorted(out, key=lambda f: f.detect_order)


def detect_format(path: str | Path) -> str:
    """The format of a checkpoint path ("torch" when no other format claims it)."""
    path = Path(path)
    return next((f.name for f in _available() if f.can_read(path)), "torch")


def open_any(path: str | Path, fmt: str | None = None, absent_shards: bool = False,
             like: Checkpoint | None = None) -> Checkpoint:
    """Open a checkpoint of any supported format as a Hugging Face PyTorch-named view.

    ``absent_shards``: a sharded index may name shards that are not on disk (``Checkpoint.absent`` lists them),
    in the formats that read such indexes (``Format.partial_shards``); the others refuse a missing shard.
    ``like``: the checkpoint this one will be compared with (``Format.read``).

    Raises:
        CheckpointError: the path cannot be read.
    """
    return get(fmt or detect_format(path)).open(Path(path), absent_shards=absent_shards, like=like)


def open_sides(path, side: str, absent_shards: bool = False,
               like: Checkpoint | None = None) -> tuple[Checkpoint | None, str | None]:
    """(checkpoint, None), or (None, problem) where the weight files are there but their content cannot be read
    as their format (a failed conversion: say an MLX config whose group size does not fit its scales): verify
    reports that as a difference, not a usage error.

    Raises:
        FFNToolsError: there is no checkpoint at ``path`` at all.
    """
    try:
        return open_any(path, absent_shards=absent_shards, like=like), None
    except CheckpointError as e:
        try:
            from ffn_tools.io.readers import open_checkpoint

            open_checkpoint(path, absent_shards).close()  # plain weight files are there: what they hold is wrong
        except FFNToolsError:
            raise e from None
        return None, f"{side} cannot be read: {e}"


def convert(path: str | Path, to: str, out: str | Path, *, dtype: str | None = None, force: bool = False,
            max_shard_size: int | None = None, allow_config: Sequence[str] = (), unbounded: bool = False,
            run: Run = NO_RUN, **options) -> dict:
    """Convert the checkpoint at ``path`` to format ``to`` in ``out``.

    Options not meaningful for the target (e.g. ``quantize`` for flax) are refused, not ignored. Where the
    output's client would run the same weights as another function than the input's client does (a setting it
    reads otherwise: ``client_differences``), the conversion is refused, naming the setting and both
    behaviours, unless ``allow_config`` names it: then it is written and the summary's warnings say so. A
    difference that shows only past a sequence length (a sliding window one client applies and the other not) is
    written, the summary's warnings and ``bounded`` saying the length up to which the two agree, unless
    ``unbounded`` asks for the same function at every length: then it is refused as any other.

    Returns:
        The target format's export summary.

    Raises:
        FFNToolsError: unknown format or option, unreadable input, existing output, a setting the output's
            client runs otherwise, ...
    """
    from ffn_tools import mtp
    from ffn_tools.io.digests import ahead

    target = get(to)
    given = {k: v for k, v in options.items() if v is not None}
    _check_options(to, target, given)
    prehash = not given.get("dry_run")  # the receipt's sources, hashed from now (a dry run's sample hashes its share)
    # a dry run priced by its estimate (``run.estimate``) starts as the run does (MLX's early workers): its sample
    # then streams as the run would
    starting = {**given, "dry_run": False} if run.estimate is not None else given
    with open_any(path) as ckpt, target.preparing(ckpt, **starting), ahead(ckpt.files if prehash else []):
        # the export's slow start and the sources' hashing run beside these checks
        with nogc.paused():  # transformers' import and config classes: a quarter of their time was the collector's
            differ = client_differences(ckpt, target)
        allowed = [d for d in differ if d.key in allow_config]
        bounded = [d for d in differ if d not in allowed and d.tokens is not None and not unbounded]
        refused = [d for d in differ if d not in allowed and d not in bounded]
        if refused:
            keys = " ".join(f"--allow-config {d.key}" for d in refused)
            bound = min((d.tokens for d in refused if d.tokens is not None), default=None)
            also = f" (without --unbounded: the two agree on sequences of up to {bound} tokens)" if bound else ""
            raise FFNToolsError(f"{path}: its {to} output would compute another function than the input: "
                                f"{'; '.join(d.line for d in refused)}; {keys} writes it anyway{also}")
        heads = mtp.find_heads(ckpt, ckpt.config)
        try:
            summary = target.export(ckpt, Path(out), dtype=dtype, force=force, max_shard_size=max_shard_size,
                                    run=run, **given)
        except FFNToolsError as e:  # a refusal naming a head's tensors names the head
            raise mtp.named_in(e, heads, to)
        if heads and not given.get("dry_run"):  # said, never dropped silently
            summary = mtp.said_of_output(heads, to, summary, lambda: _reopened(Path(out), to))
    said = [*(f"{d.line} (--allow-config {d.key})" for d in allowed),
            *(f"{d.line} (--unbounded refuses it)" for d in bounded)]
    if bounded:
        summary = {**summary, "bounded": [{"key": d.key, "tokens": d.tokens, "line": d.line} for d in bounded]}
    return {**summary, "warnings": [*summary.get("warnings", []), *said]} if said else summary


def _reopened(out: Path, to: str) -> tuple[frozenset[str], dict[str, str]] | None:
    """A conversion's output opened again as its format: its tensor names and metadata (``mtp.said_of_output``
    asks what it holds), or None where it cannot be."""
    try:
        with open_any(out, to) as c:
            return frozenset(c), dict(c.metadata)
    except (FFNToolsError, OSError, ValueError):
        return None


def _check_options(to: str, target: Format, given: dict) -> None:
    """Refuse an option ``to`` does not take (named by its flag) and two it declares exclusive (``Option.excludes``)."""
    wrong = sorted(set(given) - target.accepts())
    if wrong:
        declared = {o.name: o.flag for o in options()}
        flags = ", ".join(FLAGS.get(w) or declared.get(w) or "--" + w.replace("_", "-") for w in wrong)
        raise FFNToolsError(f"{flags} does not apply to --to {to}")
    own = {o.name: o for o in target.options}
    for name in given:
        for other in own[name].excludes if name in own else ():
            if given[name] not in (None, False) and given.get(other) not in (None, False):
                raise FFNToolsError(f"choose either {'/'.join(own[other].cli_flags)} or {'/'.join(own[name].cli_flags)}"
                                    ", not both")


def client_differences(ckpt: Checkpoint, target: Format) -> list[Difference]:
    """Each setting the ``target`` format's client would run otherwise, from ``ckpt``'s config as the output
    carries it, than ``ckpt``'s own client runs it (``checks.semantics``; a bounded one says its length)."""
    from ffn_tools.checks.semantics import differences
    from ffn_tools.clients import runtime

    source, client = runtime(ckpt.format), runtime(target)
    if source.runtime == client.runtime or not ckpt.config:
        return []
    return differences(source.runs_of(ckpt), client.runs(ckpt.config),
                       f"the input's client ({source.name})", f"the output's client ({client.name})", "would run",
                       config=source.config_of(ckpt), ckpt=ckpt)
