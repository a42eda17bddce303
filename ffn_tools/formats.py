"""The one interface every checkpoint format implements: a format is a package of ``converters`` with one
``Format`` object, registered in ``converters.FORMATS``.

A format says what it is as declared data (its name, the options its export takes and the flags that set
them, whether it writes, whether an index of it may name shards not on disk, the files of its own layout) and
does four things: recognise a path (``can_read``), open it as a lazy ``Checkpoint`` with Hugging Face PyTorch
names (``open``), write any checkpoint in its own layout from a plan (``export``), and name the runtimes that
load it (``runtimes``, built by ``load_runtime``; ``clients.runtime`` picks one: how that runtime reads a config,
whether it would load a checkpoint, its logits, its tokenizer). The core and ``verify`` talk to formats only
through this interface: they never ask which format a checkpoint is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

from .errors import FFNToolsError, pip_install

if TYPE_CHECKING:
    from .clients import Client
    from .io.store import Checkpoint


@dataclass(frozen=True)
class Option:
    """One option of a format's export, declared as data: the keyword ``export`` (and ``ffn_tools.convert``) takes,
    and the command-line flag that sets it, which the CLI draws from this alone (``ffn_tools.cli.convert``).

    Attributes:
        name: the keyword ("q_bits"); the command line passes it under this name.
        help: the flag's help, complete (a demanding user's ``--help``: what it does, its default).
        flags: the flags that set it, the first long one the one messages name; default ``--name-with-dashes``.
        type: ``str``, ``int``, or ``bool`` (a flag: given is True, absent is None).
        choices: the values allowed (shown in ``--help``), of ``type``.
        metavar: the value's placeholder in ``--help``.
        minimum: the least value of an ``int``.
        existing_file: the value is the path of a file that must exist.
        case_sensitive: whether ``choices`` are matched case-sensitively.
        optional_value: the flag may be given bare (True) or with a value, read by ``parse`` (mlx_lm's ``-q``).
        parse: reads a value given to an ``optional_value`` flag; raises ValueError saying why it is refused.
        excludes: the names of options (of the same format) it cannot be given with.
        commands: the commands that take it.
        default: its value when it is not given (None: not given; the export's own default applies).
    """

    name: str
    help: str
    flags: tuple[str, ...] = ()
    type: type = str
    choices: tuple = ()
    metavar: str | None = None
    minimum: int | None = None
    existing_file: bool = False
    case_sensitive: bool = True
    optional_value: bool = False
    parse: Callable[[str], Any] | None = None
    excludes: tuple[str, ...] = ()
    commands: tuple[str, ...] = ("convert",)
    default: Any = None

    @property
    def cli_flags(self) -> tuple[str, ...]:
        return self.flags or ("--" + self.name.replace("_", "-"),)

    @property
    def flag(self) -> str:
        """The flag messages name (its first long one: ``--quantize`` of ``-q/--quantize``)."""
        return next(f for f in self.cli_flags if f.startswith("--"))


class Format(ABC):
    """A checkpoint format (see the module docstring).

    Attributes:
        name: the ``--to`` name and the name detection gives ("torch", "mlx").
        extra: the pip extra that installs what it needs ("mlx-cpu"), for the message when it is missing.
        options: the format's own options (``Option``: its keyword, flag, help): ``convert``'s CLI draws its flags
            and ``--to`` choices from the registry's formats alone.
        takes: the options of the ``convert`` command itself its ``export`` also takes ("dry_run", "scheme",
            "layout"); any other given to it is refused (``accepts``).
        writes: ``export`` writes this format (else the format is read only).
        partial_shards: ``open(path, absent_shards=True)`` reads an index whose shards are not all on disk.
        detect_order: formats are tried in this order when a path is detected (lowest first; the catch-all
            PyTorch reader last).
        owns: name patterns (``fnmatch``) of the files its layout holds beside the weights that only it reads (a DCP's
            ``*.distcp``, Orbax's ``_METADATA``): never side files of a conversion (``owner_of``), whatever the
            input's format, so they neither travel into another format nor overwrite an output's own.
        runtimes: the names of the runtimes that load it here (``Client.runtime``: "transformers", "mlx_lm"), the
            default first; ``verify --client NAME`` picks another. Empty: no runtime here loads it (``unloaded``
            says why, and ``clients.runtime`` gives a ``NoClient`` saying so).
        unloaded: why no runtime here loads it, where ``runtimes`` is empty.
    """

    name: ClassVar[str]
    extra: ClassVar[str] = ""
    options: ClassVar[tuple[Option, ...]] = ()
    takes: ClassVar[frozenset[str]] = frozenset()
    writes: ClassVar[bool] = True
    partial_shards: ClassVar[bool] = False
    detect_order: ClassVar[int] = 50
    owns: ClassVar[tuple[str, ...]] = ()
    runtimes: ClassVar[tuple[str, ...]] = ()
    unloaded: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _DECLARED.append(cls)

    @classmethod
    def accepts(cls) -> frozenset[str]:
        """The keyword options its ``export`` takes: its own ``options`` and the command's it ``takes``."""
        return frozenset(o.name for o in cls.options) | cls.takes

    @abstractmethod
    def can_read(self, path: Path) -> bool:
        """Whether ``path`` is in this format: cheap (names, headers), never raising."""

    @abstractmethod
    def read(self, path: Path, absent_shards: bool = False, like: "Checkpoint | None" = None) -> "Checkpoint":
        """``path`` opened lazily (``open`` wraps it and records the format on the checkpoint). ``like``: the
        checkpoint this one will be compared with (verify's A), which a reader may take as the source's tensor
        layout where it proves to be one (MLX's view: instead of building transformers' model).

        Raises:
            CheckpointError: ``path`` cannot be read as this format.
        """

    def open(self, path: Path, absent_shards: bool = False, like: "Checkpoint | None" = None) -> "Checkpoint":
        """``path`` opened lazily as a Hugging Face PyTorch-named view, ``ckpt.format`` this format.

        Args:
            absent_shards: an index may name shards not on disk (``Checkpoint.absent``); only where
                ``partial_shards`` (elsewhere a missing shard is refused as always).

        Raises:
            CheckpointError: ``path`` cannot be read as this format.
        """
        ckpt = self.read(Path(path), absent_shards=absent_shards and self.partial_shards, like=like)
        ckpt.format = ckpt.stored.format = self  # a decoding view and what it decodes
        ckpt.like = ckpt.stored.like = like  # what it was read beside: opened again so (``Checkpoint.__reduce__``)
        return ckpt

    def preparing(self, ckpt: "Checkpoint", **options) -> ContextManager[None]:
        """A context in which ``export`` of ``ckpt`` with ``options`` (``export``'s) may begin its slow start early,
        while the caller checks the conversion (a GGUF's converter process importing torch and transformers, MLX's
        quantizing workers), ended when the context ends whether or not ``export`` ran (default: nothing to
        begin)."""
        return nullcontext()

    def export(self, ckpt: "Checkpoint", out: Path, **options) -> dict:
        """Write ``ckpt`` (any format's view) in this format at ``out``; returns the summary (``output``, ...).

        Raises:
            FFNToolsError: this format is read only, or the output cannot be written.
        """
        raise FFNToolsError(f"ffn-tools reads {self.name} checkpoints but does not write them; convert to one of "
                            "the formats it writes")

    def recipe(self, ckpt: "Checkpoint", dtype: str | None, quantized: bool) -> dict | None:
        """The ``convert`` options that write an unquantized checkpoint in ``ckpt``'s form: its dtype (``dtype``,
        as verify names its weights') and quantization (``quantized``: it has some), as this format's export
        takes them; None where no export of ffn-tools re-derives it (``verify --generate``'s noise floor is then
        not measured, and says so)."""
        return None

    def load_runtime(self, name: str) -> "Client":
        """The client of the runtime ``name``, one of ``runtimes`` (``clients.runtime`` checks the name and picks
        the default; call that). Imports the runtime's module only now (a torch-only install never imports
        mlx_lm's)."""
        raise FFNToolsError(f"the {self.name} format declares the runtimes {self.runtimes} but builds none of them "
                            "(its load_runtime is missing)")

    def __repr__(self) -> str:
        return f"<format {self.name}>"


REGISTRY = "ffn_tools.converters"  # the package that registers the formats (``FORMATS``, ``ADAPTERS``)


def registry():
    """The formats' registry module (``converters``: ``FORMATS``, ``ADAPTERS``, ``get``, ``open_any``, ``convert``...),
    imported by name on first use: the one way the core (the api, the command line, adapters) reaches the formats;
    it imports no format's package and names none."""
    import importlib

    return importlib.import_module(REGISTRY)


_DECLARED: list[type[Format]] = []  # every Format class defined (imported) so far: what ``owner_of`` knows


def owner_of(filename: str) -> str | None:
    """The name of the format whose own file ``filename`` is (``Format.owns``), or None: the one place that decides
    which of an input's files are another format's, never carried as side files. Formats are known once imported
    (detection imports every one; a conversion, its input's and its output's)."""
    for cls in _DECLARED:
        if any(fnmatchcase(filename, pattern) for pattern in cls.owns):
            return cls.name
    return None


# Optional packages: import name -> the extras of ffn-tools that install it (one per platform where they differ;
# none: the package is installed by its own name). The one table the hints for a missing package come from: the
# command line's (any ImportError), a format's whose package does not import (``converters.get``), an adapter
# format's.
EXTRAS = {"mlx": ("mlx", "mlx-cpu"), "mlx_lm": ("mlx", "mlx-cpu"), "jax": ("flax",), "flax": ("flax",),
          "msgpack": ("flax",), "ml_dtypes": ("flax",), "orbax": ("flax",), "tensorstore": ("flax",),
          "triton": ("cuda",), "transformers": (), "gguf": ("gguf",), "llama_cpp": ("gguf",)}
PLATFORMS = {"mlx": "Apple silicon", "mlx-cpu": "Linux"}  # extras for one platform each


def how_to_install(name: str) -> str:
    """The pip command(s) that install the optional package ``name`` (a key of EXTRAS), from where this ffn-tools
    was installed (``errors.pip_install``)."""
    extras = EXTRAS[name]
    if not extras:
        return f"pip install {name}"
    return " or ".join(pip_install(e) + (f" ({PLATFORMS[e]})" if e in PLATFORMS else "") for e in extras)


def missing_package(e: ImportError) -> str | None:
    """One line naming the optional package an ImportError is about and how to install it, or None.

    The package is the ImportError's ``name``; without one (a shared library that does not load, as
    ``libmlx.so`` when mlx is installed without a backend), the optional package whose module was importing
    when it failed (the innermost frame of the traceback that belongs to one).
    """
    name = (e.name or "").split(".")[0]
    broken = False
    if name not in EXTRAS:
        frames = []
        tb = e.__traceback__
        while tb is not None:
            frames.append(str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0])
            tb = tb.tb_next
        name = next((f for f in reversed(frames) if f in EXTRAS), "")
        broken = True
    if name not in EXTRAS:
        return None
    if broken:
        return f"this needs {name}, which does not load here ({' '.join(str(e).split())[:160]}): {how_to_install(name)}"
    return f"this needs {name}, which is not installed here: {how_to_install(name)}"
