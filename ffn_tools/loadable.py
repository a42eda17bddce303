"""Would a checkpoint load in its real client? Tensor names and shapes against what the consumer's own code
expects.

transformers: the architecture in config.json is built on the meta device (no memory) and the checkpoint's
names are mapped the way ``from_pretrained`` maps them (the model's own conversion mapping: renamings and
converters such as the v5 expert stacking); parameters nobody provides would be newly initialised, names
nobody takes are dropped, shapes must match. Buffers (rotary tables) and tied weights are recomputed by the
model and ignored; no weight is read. mlx_lm: ``mlx_lm.utils.load_model(lazy=True)``, whose strict load lists
missing and unexpected parameters (its ``mx.load`` does read the files: about 0.6x the weights' size in memory
on a 1.1 GB model; ``verify --no-load-check`` skips it). Flax has no client here (transformers 5 dropped
Flax): the check says it did not run.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .errors import FFNToolsError, listing
from .io.store import Format

SHOWN = 4  # names per category in the one-line summary (the JSON has them all)


@dataclass
class LoadCheck:
    """The outcome: ``skipped`` says why no check applies (no client loads this kind of checkpoint here);
    ``refused`` that the client refuses to build B's model at all (a failure); otherwise the three lists say
    what would go wrong."""

    client: str
    missing: list[str] = field(default_factory=list)  # parameters the model would initialise afresh
    unexpected: list[str] = field(default_factory=list)  # checkpoint tensors the model would ignore
    mismatched: list[str] = field(default_factory=list)  # "name: checkpoint [..], model [..]"
    skipped: str | None = None
    architecture: str | None = None
    refused: str | None = None

    @property
    def ok(self) -> bool:
        return self.skipped is None and not (self.refused or self.missing or self.unexpected or self.mismatched)

    def summary(self) -> str:
        """One line: what would happen on load."""
        if self.skipped:
            return f"load check ({self.client}) did not run: {self.skipped}"
        if self.refused:
            return f"would not load: {self.client} cannot build the model from its config ({self.refused})"
        if self.ok:
            return f"loads in {self.client} ({self.architecture}): every parameter provided, nothing left over"
        if self.client == "mlx_lm":  # its strict load's own words
            return f"would not load in mlx_lm: {'; '.join(self.missing + self.unexpected)}"
        parts = []
        for what, items in (("newly initialized", self.missing), ("unexpected (ignored)", self.unexpected),
                            ("of the wrong shape", self.mismatched)):
            if items:
                parts.append(f"{len(items)} tensor{'s' * (len(items) > 1)} {what}: {listing(items, SHOWN)}")
        return f"would load in {self.client} ({self.architecture}) with " + "; ".join(parts)

    def as_dict(self) -> dict:
        return {"client": self.client, "architecture": self.architecture, "ok": self.ok, "skipped": self.skipped,
                "refused": self.refused,
                "missing": self.missing, "unexpected": self.unexpected, "mismatched": self.mismatched}


MAIN_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
              "pytorch_model.bin.index.json")  # what from_pretrained reads in a directory


class MissingClient(FFNToolsError):
    """The client that loads this checkpoint is not installed, so the load check cannot run (exit 2)."""


def check(ckpt) -> LoadCheck:
    """Check ``ckpt`` (an open checkpoint of any format, as stored) against its client.

    Raises:
        MissingClient: the client is not installed here (``verify --no-load-check`` skips the check).
    """
    path = Path(ckpt.path)
    if ckpt.format is Format.GGUF:
        return check_llama_cpp(path)
    if absent := ckpt.absent_line():  # verify --layers on part of the shards: the client loads every one
        return LoadCheck("mlx_lm" if ckpt.format is Format.MLX else "transformers",
                         skipped=f"{absent}; the client loads every shard")
    if path.is_file() and path.name not in MAIN_FILES:  # model.split.safetensors beside its source
        return LoadCheck("transformers", skipped=f"{path.name} is a single file, not what a client loads from "
                                                 f"{path.parent} (that is {', '.join(MAIN_FILES[:2])})")
    if ckpt.format is Format.MLX:
        return check_mlx(ckpt.root)
    if ckpt.format is Format.FLAX:
        return LoadCheck("flax", skipped="no client loads Flax checkpoints here (transformers 5 has no Flax)")
    if ckpt.format is Format.NATIVE:
        return LoadCheck("native", skipped="Meta's and Mistral's own code loads native checkpoints, not a client "
                                           "here; `ffn-tools convert --to torch` makes one transformers loads")
    from .ctview import CompressedView, view

    if not isinstance(ckpt, CompressedView) and isinstance(seen := view(ckpt), CompressedView):
        res = check_transformers(seen)  # quantized modules as their decompression gives them (X.weight)
        res.architecture = f"{res.architecture}; quantized modules checked as dequantized"
        return res
    return check_transformers(ckpt)


def _model_class(transformers, config: dict):
    for arch in config.get("architectures") or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def check_transformers(ckpt) -> LoadCheck:
    """Names and shapes of ``ckpt`` against the transformers model its config.json describes."""
    config = ckpt.config or {}
    if "model_type" not in config:
        return LoadCheck("transformers", skipped="no config.json with a model_type beside the weights")
    try:
        import torch
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                     rename_source_key)
    except ImportError as e:
        raise MissingClient(f"verify's load check needs transformers, which is not installed here ({e.name}): "
                            "pip install transformers, or pass --no-load-check") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            on_disk = Path(ckpt.root) / "config.json"  # transformers' own decoding (Infinity, nested configs)
            cfg = (transformers.AutoConfig.from_pretrained(ckpt.root) if on_disk.is_file() else
                   transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "transformers_version"}))
            cls = _model_class(transformers, config)
            with torch.device("meta"):
                model = (cls.from_config(cfg) if cls is transformers.AutoModelForCausalLM else cls(cfg))
    except Exception as e:  # noqa: BLE001 - any failure of transformers' own config or model code
        return LoadCheck("transformers", refused=f"{config.get('model_type')!r}: {type(e).__name__}: "
                                                 f"{' '.join(str(e).split())[:200]}")
    arch = type(model).__name__
    params = dict(model.named_parameters())  # tied weights once; buffers are recomputed, not loaded
    meta = model.state_dict()
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    produced: dict[str, list[tuple[str, str | None]]] = {}
    for name in sorted(ckpt, key=dot_natural_key):  # from_pretrained's order (some renamings keep state)
        target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, meta)
        if target not in meta and name in meta:  # as from_pretrained: a name the model has is not renamed
            target, pattern = rename_source_key(name, [], [], model.base_model_prefix, meta)
        produced.setdefault(target, []).append((name, pattern))
        conv = next((c for c in converters if pattern is not None and pattern in c.source_patterns), None)
        if conv is None:
            continue
        for other in conv.target_patterns[1:]:  # one-to-many (a fused qkv split in three)
            if conv.target_patterns[0] in target:
                produced.setdefault(target.replace(conv.target_patterns[0], other), []).append((name, pattern))
    ignore_missing = [re.compile(p) for p in (model._keys_to_ignore_on_load_missing or [])]
    ignore_unexpected = [re.compile(p) for p in (model._keys_to_ignore_on_load_unexpected or [])]
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    res = LoadCheck("transformers", architecture=arch)
    res.missing = sorted(k for k in params if k not in produced and k not in tied
                         and not any(p.search(k) for p in ignore_missing))
    res.unexpected = sorted(n for t, srcs in produced.items() if t not in meta for n, _ in srcs
                            if not any(p.search(n) for p in ignore_unexpected))
    for target, srcs in produced.items():
        if target in params and len(srcs) == 1 and srcs[0][1] is None:  # a plain rename: shapes must agree
            have, want = tuple(ckpt.info(srcs[0][0]).shape), tuple(params[target].shape)
            if have != want:
                res.mismatched.append(f"{srcs[0][0]}: checkpoint {list(have)}, model {list(want)}")
    return res


LLAMA_CPP_CONTEXT = 32  # tokens of context the load check asks llama.cpp for: building the model is the check


def check_llama_cpp(path: Path) -> LoadCheck:
    """llama.cpp itself (llama-cpp-python's ``Llama``) builds the model of a GGUF: every tensor its
    architecture needs, of the shape and type it needs, with the metadata it reads; it refuses otherwise."""
    try:
        import llama_cpp
    except ImportError as e:
        raise MissingClient(f"verify's load check of a GGUF needs llama-cpp-python, which is not installed here "
                            f"({e.name}): pip install 'ffn-tools[gguf]', or pass --no-load-check") from None
    try:
        with _quiet_stderr():
            model = llama_cpp.Llama(model_path=str(path), n_ctx=LLAMA_CPP_CONTEXT, vocab_only=False, verbose=False)
        arch = model.metadata.get("general.architecture")
        model.close()
    except Exception as e:  # noqa: BLE001 - llama.cpp's refusal (a ValueError naming the file, or worse)
        return LoadCheck("llama.cpp", refused=f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
    return LoadCheck("llama.cpp", architecture=arch)


class _quiet_stderr:
    """llama.cpp logs while loading, from C to file descriptor 2 and through llama-cpp-python's callback to
    ``sys.stderr``; both silenced (its refusal is the exception)."""

    def __enter__(self):
        import contextlib
        import io
        import os

        self._python = contextlib.redirect_stderr(io.StringIO())
        self._python.__enter__()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        import os

        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._python.__exit__(*exc)


def check_mlx(path: Path) -> LoadCheck:
    """Whether ``mlx_lm.load`` would accept the MLX directory at ``path`` (lazily: no weight is evaluated)."""
    try:
        from mlx_lm.utils import load_model
    except ImportError as e:
        raise MissingClient(f"verify's load check needs mlx_lm for an MLX checkpoint, and it is not installed here "
                            f"({e.name}): pip install 'ffn-tools[mlx-cpu]' (Linux) or 'ffn-tools[mlx]', or pass "
                            "--no-load-check") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = load_model(Path(path), lazy=True, strict=True)
    except ValueError as e:  # mlx_lm's strict load: "Missing N parameters: ..." / "Received N parameters not in model"
        text = " ".join(str(e).split())
        res = LoadCheck("mlx_lm", architecture=None)
        target = res.missing if "issing" in text else res.unexpected
        target.append(text[:300])
        return res
    except Exception as e:  # noqa: BLE001 - mlx_lm cannot even build the model: say so, do not guess
        return LoadCheck("mlx_lm", refused=f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
    return LoadCheck("mlx_lm", architecture=type(model).__module__.rsplit(".", 1)[-1])


def form_change_warning(ckpt, plan, out: str | None = None) -> str | None:
    """One line when the output of a split or fuse would not load in transformers under the config.json it
    carries, checked by the load check itself on the planned names and shapes (nothing is written or read);
    None when it loads, when there is nothing to check (no model_type, a single file beside its source) or
    no transformers to check with (the warning would be a guess).

    Args:
        ckpt: the input checkpoint.
        plan: the command's plan (its entries are the output tensors).
        out: the output path, for the message.
    """
    config = ckpt.config or {}
    if "model_type" not in config or (out and Path(out).suffix == ".safetensors"):
        return None  # a single file beside its source is not what a client loads
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    res = check_transformers(_Planned(ckpt, plan))
    if res.ok or res.skipped:
        return None
    back = "`ffn-tools fuse-gateup` or `split-gateup` restores the input's form"
    return (f"{out or 'the output'} {res.summary()} under the config.json it carries; this form is for other "
            f"tools (MLX, llama.cpp-style converters, vLLM-style loaders); {back}")


class _Planned:
    """The output of a plan as the load check reads a checkpoint: names, shapes, the input's config."""

    def __init__(self, ckpt, plan):
        self.config, self.root, self.path = ckpt.config, ckpt.root, ckpt.path
        self._shapes = {e.name: tuple(e.shape) for e in plan.entries}

    def __iter__(self):
        return iter(self._shapes)

    def __contains__(self, name) -> bool:
        return name in self._shapes

    def info(self, name: str):
        return _Shape(self._shapes[name])


@dataclass(frozen=True)
class _Shape:
    shape: tuple
