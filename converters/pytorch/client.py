"""transformers, the client of Hugging Face PyTorch checkpoints (safetensors and pickles).

Its load check builds the architecture in config.json on the meta device (no memory) and maps the checkpoint's
names the way ``from_pretrained`` maps them (the model's own conversion mapping: renamings and converters such
as the v5 expert stacking); parameters nobody provides would be newly initialised, names nobody takes are
dropped, shapes must match. Buffers (rotary tables) and tied weights are recomputed by the model and ignored;
no weight is read. Its config is read by its config class; it loads weights in the config's dtype; its logits
are ``AutoModelForCausalLM.from_pretrained``'s.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from ffn_tools import quant
from ffn_tools.checks.config import ConfigResult
from ffn_tools.checks.load import LoadCheck, MissingClient
from ffn_tools.checks.semantics import Runs
from ffn_tools.checks.side_files import SideFilesResult, compare_side_files
from ffn_tools.clients import Client, compare_config_json, transformers_reads
from ffn_tools.errors import FFNToolsError
from ffn_tools.io.store import config_dtype, read_config
from ffn_tools.quant.fp8 import is_companion

from .loading import load_model

MAIN_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
              "pytorch_model.bin.index.json")  # what from_pretrained reads in a directory
# Schemes transformers loads through a quantizer that replaces the Linear modules: their stored parts stand for
# ``X.weight`` (its load check sees them dequantized; the others it maps by name itself).
QUANTIZER_SCHEMES = ("compressed-tensors-int", "compressed-tensors-fp8", "nvfp4-compressed-tensors", "nvfp4-modelopt",
                     "gptq", "awq")
FLOATS = ("F64", "F32", "F16", "BF16")
WIDER = {("F16", "F32"), ("BF16", "F32"), ("F16", "F64"), ("BF16", "F64"), ("F32", "F64")}  # stored -> config
NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float": "F32", "half": "F16"}


class Transformers(Client):
    """transformers (see the module docstring)."""

    name = "transformers"
    kernels = ("triton",)  # its fused kernels on CUDA

    def load_check(self, ckpt) -> LoadCheck:
        path = Path(ckpt.path)
        if absent := ckpt.absent_line():  # verify --layers on part of the shards: the client loads every one
            return LoadCheck(self.name, skipped=f"{absent}; the client loads every shard")
        if path.is_file() and path.name not in MAIN_FILES:  # model.split.safetensors beside its source
            return LoadCheck(self.name, skipped=f"{path.name} is a single file, not what a client loads from "
                                                f"{path.parent} (that is {', '.join(MAIN_FILES[:2])})")
        seen = quant.decoded(ckpt, only=QUANTIZER_SCHEMES)
        try:
            if seen is not ckpt:
                res = check_transformers(seen)  # quantized modules as their decompression gives them (X.weight)
                res.architecture = f"{res.architecture}; quantized modules checked as dequantized"
                return res
            return check_transformers(ckpt)
        except MissingClient as e:  # verify runs without transformers: its load check did not run, and says so
            return LoadCheck(self.name, skipped=str(e))

    def load_warning(self, ckpt, plan, out: str | None = None) -> str | None:
        return form_change_warning(ckpt, plan, out)

    def compare_config(self, ca, cb, allow=()) -> ConfigResult:
        """config.json as transformers' config classes read it, and B's dtype against its stored weights'."""
        return compare_config_json(self, ca, cb, allow, further=lambda res: _check_dtype(res, cb))

    def runs(self, config: dict) -> dict[str, Runs]:
        return transformers_reads(config)

    def compare_side_files(self, ca, cb) -> SideFilesResult:
        """The side files as from_pretrained and AutoTokenizer read them, file by file (``checks.side_files``)."""
        return compare_side_files(Path(ca.root), Path(cb.root), cb.config)

    def ready_for_logits(self, ckpt, side: str) -> None:
        if not Path(ckpt.path).is_dir() or "model_type" not in (ckpt.config or {}):
            raise FFNToolsError(f"--logits: {side} ({ckpt.path}) is not a model directory with a config.json naming "
                                "its model_type; whole-model logits need a directory transformers or mlx_lm can load")

    def logits(self, path: Path, tokens, dtype: str | None = None):
        import torch

        model, problems = load_model(path, dtype)
        with torch.no_grad():
            return model.eval()(tokens).logits.to(torch.float64), problems

    def expert_saliency(self, path: Path, texts, max_tokens):
        from .saliency import expert_saliency

        return expert_saliency(path, texts, max_tokens)

    def masked_logits(self, path: Path, tokens, dtype, dropped, ungrouped=False):
        from .masking import masked_logits

        return masked_logits(path, tokens, dtype, dropped, ungrouped)

    def generate(self, path: Path, prompts, new_tokens, score=None, dtype=None):
        from transformers import AutoTokenizer

        from .generation import run

        model, problems = load_model(path, dtype)
        if problems:  # transformers would run weights it made up: that is not B
            raise FFNToolsError("; ".join(problems))
        return run(self.name, model, AutoTokenizer.from_pretrained(path), prompts, new_tokens, score)

    def activations(self, path: Path, sequences, dtype=None):
        from .activations import capture

        model, problems = load_model(path, dtype)
        if problems:  # transformers would run weights it made up: that is not the model
            raise FFNToolsError("; ".join(problems))
        return capture(model.eval(), sequences, getattr(model.config, "num_experts_per_tok", None))


def _model_class(transformers, config: dict):
    for arch in config.get("architectures") or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


# quantization_config methods whose quantizer the load check applies as from_pretrained does (the others' modules
# are checked dequantized: QUANTIZER_SCHEMES)
QUANTIZED_AS_LOADED = ("fp8",)


def _quantizer_method(config: dict) -> str | None:
    q = config.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    return method if method in QUANTIZED_AS_LOADED else None


def _no_transformers(e: ImportError) -> str:
    """Why the load check cannot run (transformers' import raised ``e``), and the fix."""
    name = e.name or "transformers"
    if name == "transformers":
        return "the load check needs transformers, which is not installed here: pip install transformers"
    return (f"the load check needs transformers 5, and this one has no {name}: pip install -U transformers"
            if name.startswith("transformers.") else
            f"the load check needs transformers, which does not import here (no {name}): pip install transformers")


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
        raise MissingClient(_no_transformers(e)) from None
    method = _quantizer_method(config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            on_disk = Path(ckpt.root) / "config.json"  # transformers' own decoding (Infinity, nested configs)
            cfg = (transformers.AutoConfig.from_pretrained(ckpt.root) if on_disk.is_file() else
                   transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "transformers_version"}))
            quantizer = None
            if method is not None:  # as from_pretrained: its quantizer, checked against this environment
                from transformers.quantizers.auto import get_hf_quantizer
                from transformers.utils import logging as hf_logging

                hf_logging.set_verbosity_error()  # its "no GPU: dequantizing" notice: the check is names and shapes

                try:
                    quantizer, cfg, _ = get_hf_quantizer(cfg, None, None, True, {})
                except ImportError as e:  # the quantizer's own requirement: the check cannot run, not a failure
                    return LoadCheck("transformers", skipped=f"transformers' {method} quantizer does not load here "
                                                             f"({e})")
            cls = _model_class(transformers, config)
            with torch.device("meta"):
                model = (cls.from_config(cfg) if cls is transformers.AutoModelForCausalLM else cls(cfg))
                if quantizer is not None:  # its modules replaced as from_pretrained replaces them
                    quantizer.preprocess_model(model=model, dtype=model.dtype, device_map=None, checkpoint_files=[],
                                               use_kernels=False)
    except Exception as e:  # noqa: BLE001 - any failure of transformers' own config or model code
        return LoadCheck("transformers", refused=f"{config.get('model_type')!r}: {type(e).__name__}: "
                                                 f"{' '.join(str(e).split())[:200]}")
    arch = type(model).__name__ + (f", {method} quantizer" if method else "")
    params = dict(model.named_parameters())  # tied weights once; buffers are recomputed, not loaded
    meta = model.state_dict()
    transforms = get_model_conversion_mapping(model, hf_quantizer=quantizer)
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


def _check_dtype(res: ConfigResult, cb) -> None:
    """B's config dtype against the float dtype most of B's unquantized weight bytes are stored in (PyTorch
    formats: transformers and vLLM load with the config's dtype; mlx_lm and Flax keep the stored one). Quantized
    weights are left out: their stored parts (FP8 codes and float32 scales) are their scheme's, and transformers'
    quantizer loads (or dequantizes) them into the config's dtype, as DeepSeek-V3's ``torch_dtype: bfloat16`` over
    FP8 weights says; their dequantized view (float32 here) is not how they are stored."""
    if not cb.rewritable:  # MLX, Flax, GGUF views of PyTorch names: their clients keep the stored dtype
        return
    raw = read_config(Path(cb.root)) if cb.root else None
    said = NAMES.get(config_dtype(raw) or "")
    sizes: dict[str, int] = {}
    for n in cb:
        info = cb.info(n)
        if info.st_dtype in FLOATS and cb.quantized(n) is None and not is_companion(n, cb):  # (a scale as stored)
            sizes[info.st_dtype] = sizes.get(info.st_dtype, 0) + info.nbytes
    if not said or not sizes:
        return
    stored = max(sizes, key=lambda d: sizes[d])
    if stored == said:
        return
    names = {v: k for k, v in NAMES.items() if k not in ("float", "half")}
    if (stored, said) in WIDER:
        res.notes.append(f"B's config.json says dtype {names[said]} over {names[stored]} weights: they load "
                         "widened, exactly")
    else:
        res.problems.append(f"dtype: B's config.json says {names[said]}, but its weights are stored in "
                            f"{names[stored]}: transformers (dtype='auto') and vLLM load them cast to {names[said]}, "
                            "losing precision")


def form_change_warning(ckpt, plan, out: str | None = None) -> str | None:
    """One line when the output of a split or fuse would not load in transformers under the config.json it
    carries, checked by the load check itself on the planned names and shapes (nothing is written or read);
    None when it loads, or when there is nothing to check (no model_type, a single file beside its source).

    Raises:
        MissingClient: no transformers to check with.

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
    except ImportError as e:  # the caller says what it knows without it (the family's data)
        raise MissingClient(_no_transformers(e)) from None
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
