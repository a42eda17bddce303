"""The one interface every adapter format implements (``AdapterFormat``), and the way to them: the formats'
registry's ``ADAPTERS`` table (``converters.ADAPTERS``, beside ``converters.FORMATS``): a format reads a directory
or file into an ``Adapter`` and writes one back. Formats are imported on first use (reading a PEFT adapter never
imports mlx).

The dependency goes one way: ``converters/`` implement this package's interfaces (``AdapterFormat``, ``Adapter``,
``conform``); nothing in ``adapters/`` imports ``converters/`` or names a format. It reaches the adapter formats and
a checkpoint (``open_checkpoint`` below) through the registry, by its module name, in this one module.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from ..errors import FFNToolsError
from ..formats import REGISTRY, missing_package, registry
from ..io.store import read_config
from .model import Adapter, AdapterError

def names() -> tuple[str, ...]:
    """The adapter formats' names, in detection order."""
    return tuple(registry().ADAPTERS)


class AdapterFormat(ABC):
    """An adapter format. ``needs_base``: writing it needs the base model's config.json (its names or
    architecture are the runtime's, not Hugging Face's); ``options``: the options of ``write`` (any other given to
    a conversion to it is refused)."""

    name: ClassVar[str]
    needs_base: ClassVar[bool] = False
    options: ClassVar[frozenset[str]] = frozenset()  # the keyword options its ``write`` takes (GGUF's outtype)

    @abstractmethod
    def can_read(self, path: Path) -> bool:
        """Whether ``path`` is an adapter of this format: cheap, never raising."""

    @abstractmethod
    def read(self, path: Path, config: dict | None = None) -> Adapter:
        """The adapter at ``path``; ``config``: the base's config.json, where known (needed by formats whose
        names are not Hugging Face's).

        Raises:
            AdapterError: not readable as this format, or a kind of adapter not supported (saying which).
        """

    @abstractmethod
    def write(self, adapter: Adapter, out: Path, config: dict | None = None, base: Path | None = None,
              **options) -> list[str]:
        """Write ``adapter`` into the new directory (or file) ``out`` (the caller's temporary path); returns the
        files written. ``config``/``base``: the base model's config.json and directory; ``options``: the
        format's own (GGUF's ``outtype``).

        Raises:
            AdapterError: the adapter cannot be held by this format (say why).
        """

    def __repr__(self) -> str:
        return f"<adapter format {self.name}>"


def get(name: str) -> AdapterFormat:
    """The adapter format called ``name``."""
    table = registry().ADAPTERS
    if name not in table:
        raise FFNToolsError(f"unknown adapter format {name!r}; use one of {', '.join(table)}")
    try:
        module = importlib.import_module(table[name], REGISTRY)
    except ImportError as e:
        fix = missing_package(e)  # the one table of which extra installs what (``formats.EXTRAS``)
        raise FFNToolsError(f"adapter format {name!r} needs a package that is not installed ({e})"
                            + (f": {fix}" if fix else "")) from None
    return module.ADAPTER


def named(to: str) -> str:
    """The adapter format ``convert --to TO`` writes (the registry's ``ADAPTER_ALIASES``; else the format called
    ``to``)."""
    return registry().ADAPTER_ALIASES.get(to, to)


def open_checkpoint(path, like=None):
    """The checkpoint at ``path`` opened by whichever format reads it (the registry's ``open_any``; ``like``:
    the checkpoint it will be compared with): the one way adapters reach a checkpoint format."""
    return registry().open_any(path, like=like)


def detect(path: Path) -> AdapterFormat | None:
    """The format of the adapter at ``path``, or None when it is no adapter any format reads."""
    for name in names():
        try:
            fmt = get(name)
        except FFNToolsError:
            continue
        if fmt.can_read(Path(path)):
            return fmt
    return None


def is_adapter(path) -> bool:
    return detect(Path(path)) is not None


def read(path, config: dict | None = None) -> Adapter:
    """The adapter at ``path``, whatever its format.

    Raises:
        AdapterError: no adapter there, or it cannot be read.
    """
    fmt = detect(Path(path))
    if fmt is None:
        raise AdapterError(f"{path}: not a LoRA adapter ffn-tools reads (PEFT's adapter_config.json + "
                           "adapter_model.safetensors, mlx_lm's adapters.safetensors, or a GGUF LoRA)")
    return fmt.read(Path(path), config)


BASE_KEYS = ("base_model_name_or_path", "model")  # PEFT's adapter_config.json names its base so; mlx_lm's so


def named_base(adapter_path: Path) -> tuple[str | None, str | None]:
    """(the key, the base model it names) of the adapter's adapter_config.json, or (None, None)."""
    import json

    try:
        cfg = json.loads((Path(adapter_path) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None, None
    for key in BASE_KEYS:
        if isinstance(cfg, dict) and isinstance(cfg.get(key), str) and cfg[key]:
            return key, cfg[key]
    return None, None


def base_candidates(adapter_path: Path, named: str) -> list[Path]:
    """Where a base an adapter names may be, in the order tried: the working directory first (PEFT's
    ``AutoPeftModel`` hands ``base_model_name_or_path`` to transformers' ``from_pretrained``, which reads a relative
    path from there, as mlx_lm's ``load`` reads its ``model``), then the adapter's own directory."""
    import os

    tried = [Path(os.path.abspath(named))]
    beside = Path(os.path.abspath(Path(adapter_path) / named))
    return tried + ([beside] if beside != tried[0] else [])


def base_config(adapter_path: Path, base) -> tuple[Path | None, dict | None]:
    """(base directory, its config.json): ``base`` where given, else the base an adapter names that is a local
    directory (PEFT's base_model_name_or_path, mlx_lm's ``model``: ``base_candidates``)."""
    if base is not None:
        root = Path(base) if Path(base).is_dir() else Path(base).parent
        return root, read_config(root)
    _, named = named_base(Path(adapter_path))
    for root in base_candidates(Path(adapter_path), named) if named else []:
        if root.is_dir():
            return root, read_config(root)
    return None, None


def no_base(adapter_path: Path, base=None) -> str:
    """Why no base config.json was found for the adapter at ``adapter_path``: what is missing and where it was
    looked for (for a refusal that ends by saying how to give it)."""
    if base is not None:
        root = Path(base) if Path(base).is_dir() else Path(base).parent
        return f"the base given, {base}, has no config.json (looked for {root / 'config.json'})"
    key, named = named_base(Path(adapter_path))
    if named is None:
        return f"{Path(adapter_path) / 'adapter_config.json'} names no base model ({' or '.join(BASE_KEYS)})"
    tried = base_candidates(Path(adapter_path), named)
    found = next((r for r in tried if r.is_dir()), None)
    if found is not None:
        return f"the base its {key} names, {found}, has no config.json"
    hub = named.count("/") == 1 and not named.startswith((".", "/", "~"))
    return (f"its {key} {named!r} is no directory here (tried {' and '.join(str(t) for t in tried)})"
            + ("; a Hugging Face Hub id is not downloaded by ffn-tools" if hub else ""))


def load(path, base=None, config: dict | None = None) -> Adapter:
    """The adapter at ``path``, with its base's config where known (``base_config``; else ``config``)."""
    _, found = base_config(Path(path), base)
    return read(Path(path), found or config)
