"""mlx_lm, the client of MLX model directories.

Its load check is ``mlx_lm.utils.load_model(lazy=True)``, whose strict load lists missing and unexpected
parameters (its ``mx.load`` does read the files: about 0.6x the weights' size in memory on a 1.1 GB model;
``verify --no-load-check`` skips it). It reads a config through its model's ``ModelArgs`` (``models``): B's
config.json as mlx_lm reads it is compared with A's as an MLX export of A hands it to mlx_lm. It loads a model
through its own ``sanitize``, so A is paired with B as mlx_lm loads A (``consumer``). Its logits are
``load_model``'s model's.

B's config is read by mlx_lm's own code, never through the export's completion of a config (``models.complete_config``):
``mlx_lm.load`` runs what the file says, and a transformers-5 config it cannot read (``rope_theta`` only inside
``rope_parameters``: mlx_lm's llama runs its default 10000) must fail here, not be corrected into passing.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from pathlib import Path
from typing import Any

from ffn_tools.checks.config import ConfigResult, compare_keys, generation_eos
from ffn_tools.checks.load import LoadCheck, MissingClient
from ffn_tools.checks.semantics import (EXPERT_COUNTS, MLA_NORMS, Runs, mla_norm_runs, router_bias_runs, topk_words,
                                        windows, windows_words)
from ffn_tools.checks.side_files import SideFilesResult, compare_side_files
from ffn_tools.clients import Client, compare_config_json
from ffn_tools.errors import FFNToolsError, pip_install
from ffn_tools.io.store import read_config

from . import models

log = logging.getLogger(__name__)


class MlxLm(Client):
    """mlx_lm (see the module docstring)."""

    name = "mlx_lm"
    kernels = ("mlx", "metal")

    def load_check(self, ckpt) -> LoadCheck:
        if absent := ckpt.absent_line():  # verify --layers on part of the shards: the client loads every one
            return LoadCheck(self.name, skipped=f"{absent}; the client loads every shard")
        return check_mlx(ckpt.root)

    def compare_config(self, ca, cb, allow=()) -> ConfigResult:
        """config.json key by key, and B's as mlx_lm's ModelArgs read it against A's (``_compare_mlx``)."""
        return compare_config_json(self, ca, cb, allow, further=lambda res: _compare_mlx(res, ca, cb, set(allow)))

    def compare_side_files(self, ca, cb) -> SideFilesResult:
        """The side files file by file (``checks.side_files``): mlx_lm's tokenizer is transformers' AutoTokenizer
        reading the same files."""
        return compare_side_files(Path(ca.root), Path(cb.root), cb.config)

    def config_of(self, ckpt) -> dict:
        """The config.json on disk: what mlx_lm reads (the view restores the source's)."""
        return read_config(ckpt.root) or ckpt.config or {}

    def runs(self, config: dict) -> dict[str, Runs]:
        """As mlx_lm's model class runs an MLX export of ``config`` (the config the export writes: ``models.target``
        completes it; see ``mlx_runs``); {} where mlx_lm has no model for it (the load check says so)."""
        try:
            t = models.target(config, "config", None)
        except FFNToolsError:
            return {}
        return mlx_runs(t.module, t.args, config.get("max_position_embeddings"), t.fresh)

    def runs_of(self, ckpt) -> dict[str, Runs]:
        """As mlx_lm runs the MLX directory ``ckpt``: its config.json read by mlx_lm's own code (``as_mlx_lm_reads``);
        {} where mlx_lm cannot read it (the config check and the load check say so)."""
        try:
            module, args, config, model_class = as_mlx_lm_reads(ckpt.root)
        except FFNToolsError:
            return {}
        return mlx_runs(module, args, config.get("max_position_embeddings"), lambda: model_class(args))

    def pairing(self, ca, cb):
        from .consumer import AsMlxLoads  # torch: verify has it; an export (which reads this client) need not

        return None if ca.format is cb.format else AsMlxLoads.of(ca, cb)  # A already MLX: nothing to undo

    def ready_for_logits(self, ckpt, side: str) -> None:
        if not Path(ckpt.path).is_dir() or "model_type" not in (ckpt.config or {}):
            raise FFNToolsError(f"--logits: {side} ({ckpt.path}) is not a model directory with a config.json naming "
                                "its model_type; whole-model logits need a directory transformers or mlx_lm can load")
        try:
            import mlx_lm  # noqa: F401
        except ImportError as e:
            raise FFNToolsError(f"--logits: {side} is an MLX checkpoint and mlx_lm is not installed ({e})") from None

    def hint(self, error: str) -> str:
        return ("; MLX's CPU backend runs these ops in float32 only: an export with --dtype float32 runs here"
                if "float32" in error else "")

    def runs_instead(self, error: str) -> str | None:
        """float32 where MLX's CPU backend runs an op in float32 only (``GatherMM``: MoE layers in bf16)."""
        return "float32" if "mlx_lm" in error and "supports float32" in error else None

    def logits(self, path: Path, tokens, dtype: str | None = None):
        import mlx.core as mx
        import numpy as np
        import torch
        from mlx_lm.utils import load_model

        try:
            model, _ = load_model(path)
        except ValueError as e:  # strict loading: missing or unexpected parameters
            return torch.empty(0), [f"mlx_lm: {str(e).splitlines()[0][:300]}"]
        if dtype is not None:  # its floating parameters widened (a quantized layer's scales too: exactly)
            model.set_dtype(getattr(mx, dtype))
        out = model(mx.array(tokens.numpy()))
        return torch.from_numpy(np.array(out.astype(mx.float32))).to(torch.float64), []

    def expert_saliency(self, path: Path, texts, max_tokens):
        from .saliency import expert_saliency

        return expert_saliency(path, texts, max_tokens)

    def masked_logits(self, path: Path, tokens, dtype, dropped, ungrouped=False):
        from .masking import masked_logits

        return masked_logits(path, tokens, dtype, dropped, ungrouped)

    def generate(self, path: Path, prompts, new_tokens, score=None, dtype=None):
        from .generation import generate

        return generate(path, prompts, new_tokens, score, dtype)

    def activations(self, path: Path, sequences, dtype=None):
        from .activations import capture

        return capture(path, sequences, dtype)

    def anchor(self, a: Path, recipe: dict, out: Path, like: Path | None = None) -> str | None:
        from .anchor import anchor

        return anchor(a, recipe, out, like)


def check_mlx(path: Path) -> LoadCheck:
    """Whether ``mlx_lm.load`` would accept the MLX directory at ``path`` (lazily: no weight is evaluated)."""
    try:
        from mlx_lm.utils import load_model
    except ImportError as e:
        raise MissingClient(f"verify's load check of an MLX checkpoint needs mlx_lm, which does not import here "
                            f"({e}): {pip_install('mlx-cpu')} (Linux) or {pip_install('mlx')} (Apple silicon), or "
                            "pass --no-load-check") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = load_model(Path(path), lazy=True, strict=True)
    except ValueError as e:  # mlx_lm's strict load: "Missing N parameters: ..." / "Received N parameters not in model"
        text = " ".join(str(e).split())
        res = LoadCheck("mlx_lm", architecture=None, words=text[:300])
        target = res.missing if "issing" in text else res.unexpected
        target.append(text[:300])
        return res
    except Exception as e:  # noqa: BLE001 - mlx_lm cannot even build the model: say so, do not guess
        return LoadCheck("mlx_lm", refused=f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
    return LoadCheck("mlx_lm", architecture=type(model).__module__.rsplit(".", 1)[-1])


def as_mlx_lm_reads(root) -> tuple[str, Any, dict, Any]:
    """The config.json of the MLX directory ``root`` as ``mlx_lm.load`` reads it, by mlx_lm's own code: its
    ``load_config`` (generation_config.json's eos_token_id merged in), the model class its ``load_model`` picks (that
    function's own default ``get_model_classes``: the remapping by model_type and architecture), and that model's
    ``ModelArgs.from_dict``, which takes the fields the file names and the defaults for the rest (a key kept
    elsewhere, as transformers 5 keeps ``rope_theta`` inside ``rope_parameters``, is not read).

    Returns:
        (the ``mlx_lm.models`` module's name, its ``ModelArgs``, the config dict mlx_lm built them from, the
        ``Model`` class ``mlx_lm.load`` builds from them).

    Raises:
        FFNToolsError: mlx_lm.load would fail on this config.json (no model for its type, a required field absent),
            naming mlx_lm's own error.
    """
    utils = models.mlx_lm_module("utils")
    picker = inspect.signature(utils.load_model).parameters.get("get_model_classes")
    if picker is None or not callable(classes := picker.default):  # how mlx_lm.load picks a model class (0.32)
        import importlib.metadata

        raise FFNToolsError(f"this mlx_lm ({importlib.metadata.version('mlx-lm')}) picks "
                            "its model class otherwise than the mlx_lm ffn-tools reads configs as (0.32: load_model's "
                            "get_model_classes); install mlx-lm 0.32")
    try:
        config = utils.load_config(Path(root))
        model_class, args_class = classes(config=config)
        args = models.args_of(args_class, config)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FFNToolsError(f"mlx_lm.load would fail on it ({type(e).__name__}: {' '.join(str(e).split())[:200]})") \
            from None
    return model_class.__module__.rsplit(".", 1)[-1], args, config, model_class


def _fields(args) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}


def _exported_args(ca) -> tuple[str, dict]:
    """mlx_lm's ``ModelArgs`` fields for A's config as an MLX export of A hands it to mlx_lm (``models.target``
    completes it; generation_config's eos merged in, as ``mlx_lm.convert`` and the export do)."""
    source = dict(ca.config)
    eos = generation_eos(ca)
    if eos:
        source["eos_token_id"] = eos
    t = models.target(source, "config", "lm_head.weight" in ca)
    return t.module, _fields(t.args)


def _compare_mlx(res: ConfigResult, ca, cb, allow) -> None:
    """B's config.json as mlx_lm reads it (``as_mlx_lm_reads``) against A's: as mlx_lm reads A where A is MLX too,
    else as an MLX export of A gives it to mlx_lm. A key B's file lacks is mlx_lm's default, and is said so."""
    try:
        module, args, raw_b, _ = as_mlx_lm_reads(cb.root)
    except FFNToolsError as e:
        res.problems.append(f"mlx_lm cannot read B's config.json: {e}")
        return
    b_args = _fields(args)
    try:
        a_args = _fields(as_mlx_lm_reads(ca.root)[1]) if ca.format is cb.format else _exported_args(ca)[1]
    except FFNToolsError as e:
        res.notes.append(f"A's config is not one mlx_lm reads, so it is not compared as mlx_lm's ModelArgs ({e})")
        return
    res.readers.append(f"mlx_lm's {module} ModelArgs")
    before = {"problems": len(res.problems), "allowed": len(res.allowed)}
    compare_keys(res, a_args, b_args, allow, None)
    for kind, start in before.items():  # the lines compare_keys added: say where B's value comes from
        lines = getattr(res, kind)
        lines[start:] = [line + _defaulted(line.split(":", 1)[0], raw_b, module) for line in lines[start:]]


def _defaulted(key: str, raw_b: dict, module: str) -> str:
    """Why mlx_lm reads ``key`` as it does where B's config.json does not name it: its default, and where the file
    keeps the value under another name that mlx_lm's model does not read (transformers 5's ``rope_parameters``)."""
    top = key.split(".")[0]
    if top in raw_b:
        return ""
    kept = next((p for p in models.ALIASES.get(top, ()) if models.lookup(raw_b, p) is not None), None)
    if kept is None:
        return f" (B's config.json has no {top}: mlx_lm's {module} ModelArgs default)"
    return (f" (mlx_lm's {module} ModelArgs default: B's config.json has {top} only as {kept} "
            f"({models.lookup(raw_b, kept)!r}), which mlx_lm's {module} model does not read; add {top} to B's "
            "config.json, as ffn-tools convert --to mlx writes it)")


# Top-k renormalization an mlx_lm model fixes whatever the config says (its module: jamba.py softmaxes the top-k
# router scores; mixtral.py likewise).
MLX_TOPK = {"jamba": True, "mixtral": True}


def mlx_runs(module: str, args, max_positions=None, build=None) -> dict[str, Runs]:
    """The settings as mlx_lm's model ``module`` runs them from its ``ModelArgs`` ``args``, read from its code's
    arguments: a layer slides only where its ``ModelArgs`` has a ``sliding_window`` and its ``layer_types`` mark the
    layer sliding (``llama``: all full attention unless given), or its ``sliding_window_pattern`` does (Gemma 3, Cohere 2: every layer but each
    pattern-th); a model whose arguments have no ``sliding_window`` runs full attention (Gemma 2). Top-k
    renormalization where its arguments have ``norm_topk_prob``. Models that slide otherwise are not judged. A
    window no shorter than the longest context (``max_positions``, the config's) is no window, as on the other
    side. Off the model ``build()`` makes (lazy: nothing evaluated): the eps of MLA attention's q_a/kv_a norms
    (where its arguments have ``kv_lora_rank``), and whether an MoE's router adds a bias (a parameter its sanitize
    keeps)."""
    fields = {f.name for f in dataclasses.fields(args)}
    layers = getattr(args, "num_hidden_layers", None)
    out: dict[str, Runs] = {}
    if isinstance(layers, int) and layers > 0:
        ws: list[int | None] | None = None
        why = ""
        if "sliding_window" not in fields:
            ws, why = [None] * layers, f" (mlx_lm's {module} model has no sliding window)"
        elif "layer_types" in fields:
            types = args.layer_types or ["full_attention"] * layers
            ws = windows(args.sliding_window, types, layers, max_positions)
            marked = "none here" if "sliding_attention" not in types else "those"
            why = f" (mlx_lm's {module} model slides only the layers its layer_types mark sliding_attention: {marked})"
        elif isinstance(pattern := getattr(args, "sliding_window_pattern", None), int) and pattern > 0:
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
            ws = windows(args.sliding_window, types, layers, max_positions)
        if ws is not None:
            out["sliding_window"] = Runs(ws, windows_words(ws) + why)
    moe = any(isinstance(getattr(args, c, None), int) for c in EXPERT_COUNTS)
    model = None
    if ("kv_lora_rank" in fields or moe) and build is not None:
        try:
            model = build()
        except Exception as e:  # noqa: BLE001 - mlx_lm's own failure to build it: said, not silent
            log.warning("mlx_lm's %s model does not build from this config (%s): the eps of its MLA norms and its "
                        "router's bias were not compared with the other client's", module, type(e).__name__)
    if model is not None:
        eps: dict[str, float] = {}
        for name, m in model.named_modules():
            norm = name.rsplit(".", 1)[-1]
            value = getattr(m, "eps", None)  # mlx.nn.RMSNorm's
            if norm in MLA_NORMS and norm not in eps and isinstance(value, float):
                eps[norm] = value
        out.update(mla_norm_runs(eps, f"mlx_lm's {module} model"))
        if moe:
            out.update(router_bias_runs(models.parameters(model), f"mlx_lm's {module} model"))
    if "norm_topk_prob" in fields and isinstance(args.norm_topk_prob, bool):
        out["norm_topk_prob"] = Runs(args.norm_topk_prob, topk_words(args.norm_topk_prob))
    elif module in MLX_TOPK:
        norm = MLX_TOPK[module]
        out["norm_topk_prob"] = Runs(norm, f"{topk_words(norm)} (mlx_lm's {module} model, whatever the config says)")
    return out
