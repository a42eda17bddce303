"""mlx_lm's own model class for a config: the spec an MLX export must meet.

``target(config)`` imports ``mlx_lm.models.<type>`` (the type as mlx_lm's ``MODEL_REMAPPING`` and
``MODEL_ARCHITECTURE_REMAPPING`` map it, which is what ``mlx_lm.load`` does; else the type with ``_text``
dropped: transformers' text-only ``qwen3_5_text`` is mlx_lm's ``qwen3_5``) and builds
``Model(ModelArgs.from_dict(config))``. MLX is lazy: the model's random initial weights are never computed,
so building even a large model costs only its Python objects. Its parameter tree (names, shapes) is what
``mlx_lm.load`` will demand, strictly.

mlx_lm is imported the ordinary way, on first use: its package imports its tokenizer code, hence
transformers, hence torch, about 2.5 s on a two-core machine (1.2 s of it torch; ``mlx.nn`` alone is 20 ms).
Nothing else of the MLX export needs torch.

What transformers v5 moved out of the place mlx_lm's ``ModelArgs`` read it is declared in ``ALIASES`` and
filled in (only keys the config lacks, only fields the ``ModelArgs`` has); ``complete_config`` says what.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ffn_tools.errors import FFNToolsError, pip_install

if TYPE_CHECKING:
    import mlx.nn as nn

# ModelArgs field -> where a transformers v5 config keeps it (dotted paths, first present wins).
ALIASES: dict[str, tuple[str, ...]] = {
    "rope_theta": ("rope_parameters.rope_theta", "rope_parameters.full_attention.rope_theta"),
    "rope_local_base_freq": ("rope_parameters.sliding_attention.rope_theta",),
    "partial_rotary_factor": ("rope_parameters.partial_rotary_factor",),
    "rotary_emb_base": ("rope_theta", "rope_parameters.rope_theta"),
    "rotary_pct": ("partial_rotary_factor", "rope_parameters.partial_rotary_factor"),
    "num_experts": ("num_local_experts", "n_routed_experts"),
    "num_local_experts": ("num_experts", "n_routed_experts"),
    "n_routed_experts": ("num_experts", "num_local_experts"),
    "num_layers": ("num_hidden_layers",),
    "layer_norm_epsilon": ("layer_norm_eps", "rms_norm_eps"),
    "layer_norm_eps": ("layer_norm_epsilon", "rms_norm_eps"),
    "block_dim": ("hidden_size",),  # LFM2's v4 name of its width
}
# v4 per-layer flags that transformers v5 spells out as a list of layer kinds: key -> (list key, the kind flagged)
LAYER_FLAGS: dict[str, tuple[str, str]] = {"is_moe_layer": ("mlp_layer_types", "sparse")}
TIE_KEY = "tie_word_embeddings"


def mlx_lm_module(name: str) -> types.ModuleType:
    """``mlx_lm.<name>`` (``utils``, ``convert``), imported as usual (see the module doc for its cost).

    Raises:
        FFNToolsError: mlx-lm (or mlx) is not installed, or does not import here.
    """
    try:
        return importlib.import_module(f"mlx_lm.{name}")
    except ImportError as e:
        raise FFNToolsError(f"MLX export needs mlx-lm, which does not import here ({type(e).__name__}: {e}); "
                            f"install with: {pip_install('mlx-cpu')} (Linux) or {pip_install('mlx')} (Apple silicon)"
                            ) from None


def remappings() -> tuple[dict, dict]:
    """mlx_lm's ``MODEL_REMAPPING`` and ``MODEL_ARCHITECTURE_REMAPPING`` (model_type -> module, and
    (model_type, architecture) -> module), as ``mlx_lm.load`` applies them."""
    utils = mlx_lm_module("utils")
    return utils.MODEL_REMAPPING, utils.MODEL_ARCHITECTURE_REMAPPING


def _has_module(name: str) -> bool:
    """Whether mlx_lm has a module ``mlx_lm.models.<name>`` (found, not imported)."""
    mlx_lm_module("utils")
    if not name.isidentifier():
        return False
    return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None


def _import_model_module(name: str) -> types.ModuleType:
    """``mlx_lm.models.<name>``, a module ``module_name`` found.

    Raises:
        FFNToolsError: mlx_lm has no such module, or it does not import (a package it needs is not installed).
    """
    if not _has_module(name):
        raise FFNToolsError(f"mlx_lm {_version()} has no module mlx_lm.models.{name}")
    try:
        return importlib.import_module(f"mlx_lm.models.{name}")
    except (ImportError, SystemExit) as e:  # a model module needing a package that is not installed
        raise FFNToolsError(f"mlx_lm's {name} model cannot be imported here ({type(e).__name__}: {e}); "
                            "mlx_lm.load could not run it either") from None


def module_name(config: dict) -> str | None:
    """The ``mlx_lm.models`` module mlx_lm would build ``config`` with (its remapping), else the model_type
    without ``_text``; None when mlx_lm has neither.

    Raises:
        FFNToolsError: the config has no model_type.
    """
    remap, arch_remap = remappings()
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise FFNToolsError("config.json has no model_type; mlx_lm picks its model class by it")
    archs = config.get("architectures") or ()
    archs = (archs,) if isinstance(archs, str) else archs
    first = next((arch_remap[(model_type, a)] for a in archs if (model_type, a) in arch_remap),
                 remap.get(model_type, model_type))
    for name in dict.fromkeys((first, remap.get(model_type.removesuffix("_text"), model_type.removesuffix("_text")))):
        if _has_module(name):
            return name
    return None


def loadable_type(config: dict) -> str:
    """The model_type mlx_lm.load resolves to the module ``module_name`` found: the config's own, or without
    ``_text`` (mlx_lm has no module for transformers' text-only ``qwen3_5_text``, but loads ``qwen3_5``)."""
    remap, _ = remappings()
    model_type = config["model_type"]
    if _has_module(remap.get(model_type, model_type)):
        return model_type
    return model_type.removesuffix("_text")


def lookup(config: dict, path: str):
    """The value at dotted ``path`` in ``config`` (``rope_parameters.rope_theta``), or None."""
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def complete_config(config: dict, fields) -> tuple[dict, list[str]]:
    """``config`` with the ``ModelArgs`` fields it lacks filled from where transformers v5 keeps them
    (``ALIASES``) and ``rope_scaling`` rebuilt from ``rope_parameters``; returns (config, keys added)."""
    config, added = dict(config), []
    for key, paths in ALIASES.items():
        if key in fields and key not in config:
            value = next((v for p in paths if (v := lookup(config, p)) is not None), None)
            if value is not None:
                config[key] = value
                added.append(key)
    for key, (kinds, flagged) in LAYER_FLAGS.items():
        if key in fields and key not in config and isinstance(config.get(kinds), list):
            config[key] = [k == flagged for k in config[kinds]]
            added.append(key)
    types_ = config.get("layer_types")
    for key, full in (("sliding_window_pattern", "full_attention"), ("full_attention_interval", "full_attention")):
        if key in fields and key not in config and (period := _period(types_, full)) is not None:
            config[key] = period  # transformers v5 spells the v4 period out as layer_types
            added.append(key)
    if "head_dim" in fields and config.get("head_dim") is None and isinstance(config.get("hidden_size"), int) \
            and isinstance(config.get("num_attention_heads"), int) and config["num_attention_heads"] > 0:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]  # transformers' own default
        added.append("head_dim")
    rope = config.get("rope_parameters")
    if "rope_scaling" in fields and config.get("rope_scaling") is None:
        if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            config["rope_scaling"] = {"type": scaling["rope_type"], **scaling}
            added.append("rope_scaling")
        elif "rope_scaling" not in config and fields["rope_scaling"] is dataclasses.MISSING:
            config["rope_scaling"] = None  # required by the ModelArgs, and none is what the source means
            added.append("rope_scaling")
    return config, added


def _period(layer_types, kind: str) -> int | None:
    """p when ``layer_types`` repeats p-1 other layers then one ``kind`` layer (as v4's pattern/interval keys
    said), else None."""
    if not isinstance(layer_types, list) or kind not in layer_types:
        return None
    p = layer_types.index(kind) + 1
    ok = all((t == kind) == ((i + 1) % p == 0) for i, t in enumerate(layer_types))
    return p if ok else None


@dataclass(frozen=True)
class Builder:
    """Makes a new lazy model of mlx_lm's ``mlx_lm.models.<module>`` from ``config``: plain data (the module's
    name and the config), so a plan holding it pickles with plain ``pickle`` and builds the model again where it
    lands (a ``--ray`` task: the module is imported there, on first use)."""

    module: str
    config: dict = field(compare=False)  # the Target's own dict: keys the export adds later are seen

    def __call__(self) -> nn.Module:
        mod = _import_model_module(self.module)
        m = mod.Model(args_of(mod.ModelArgs, self.config))
        m.eval()
        return m


@dataclass
class Target:
    """mlx_lm's model for a config, built lazily.

    Attributes:
        module: the ``mlx_lm.models`` module name.
        model: the model (nothing evaluated).
        config: the config it was built from (the source's, completed).
        added: config keys added to the source's (``complete_config``, ``tie_word_embeddings``).
        params: parameter name -> shape, as ``mlx_lm.load`` demands them.
        build: makes a new lazy model (a ``Builder``: data); renamed: the source's model_type when config has mlx_lm's instead.
        args: the module's ``ModelArgs.from_dict(config)``, as ``mlx_lm.load`` reads the config (an instance
            of its own: the model may change the one it was built with).
    """

    module: str
    model: nn.Module
    config: dict
    added: list[str]
    params: dict[str, tuple[int, ...]]
    build: Builder | None = None  # a new lazy model: sanitize may change one, so each run gets its own
    renamed: str | None = None  # the source's model_type where mlx_lm needs another (see ``loadable_type``)
    prequant: dict | None = None  # the quantization the input keeps (MXFP4), as mlx_lm's config block says it
    args: Any = None  # the module's ModelArgs dataclass: a class known only once the module is imported

    def fresh(self) -> nn.Module:
        if self.build is None:
            raise RuntimeError("internal error: this Target has no Builder to make a new model with")
        return self.build()


def _fields(mod) -> dict[str, object]:
    """ModelArgs field -> default (``dataclasses.MISSING`` when required); a composite model's text arguments
    too (Qwen 3.5's ``TextModelArgs``, built from the same config when it has no ``text_config``), from the
    module and those of the model class's bases (Qwen 3.5 MoE's model is Qwen 3.5's)."""
    out: dict[str, object] = {}
    spaces = [vars(mod)] + [c.__init__.__globals__ for c in mod.Model.__mro__[1:]
                            if c.__module__.startswith("mlx_lm.") and hasattr(c.__init__, "__globals__")]
    classes = [c for space in spaces for c in space.values() if isinstance(c, type) and dataclasses.is_dataclass(c)
               and c.__name__.endswith("ModelArgs")]
    for cls in sorted(classes, key=lambda c: c is not mod.ModelArgs):
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
    return out


def target(config: dict | None, where: str, has_head: bool | None = None) -> Target:
    """Build mlx_lm's model for ``config`` (see the module doc).

    Args:
        has_head: whether the checkpoint has ``lm_head.weight``; when the config has no
            ``tie_word_embeddings``, transformers ties the head exactly when the checkpoint lacks one (its
            ``save_pretrained`` drops a tied head), so the key is added where mlx_lm's default differs.

    Raises:
        FFNToolsError: no config, no mlx_lm module for its model_type, or a config ``ModelArgs`` rejects.
    """
    if not config:
        raise FFNToolsError(f"{where}: no config.json; MLX export needs it to know the architecture "
                            "(model_type) mlx_lm will build; put the model's config.json beside the weights")
    if not isinstance(config.get("model_type"), str):
        raise FFNToolsError(f"{where}: config.json has no model_type; mlx_lm picks its model class by it")
    name = module_name(config)
    if name is None:
        raise FFNToolsError(f"{where}: mlx_lm {_version()} has no model for model_type "
                            f"{config['model_type']!r} (no mlx_lm/models/{config['model_type']}.py), so "
                            "mlx_lm.load could not run the export; convert to torch or flax instead")
    mod = _import_model_module(name)
    fields = _fields(mod)
    config, added = complete_config(config, fields)
    renamed = None
    if loadable_type(config) != config["model_type"]:
        renamed, config["model_type"] = config["model_type"], loadable_type(config)
    default = fields.get(TIE_KEY)
    if TIE_KEY not in config and has_head is not None and TIE_KEY in fields and \
            (default is dataclasses.MISSING or bool(default) != (not has_head)):
        config[TIE_KEY] = not has_head
        added.append(TIE_KEY)
    try:
        args = args_of(mod.ModelArgs, config)
    except TypeError as e:
        own = {f.name: f for f in dataclasses.fields(mod.ModelArgs)}
        missing = sorted(k for k, f in own.items() if f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING and k not in config)
        if missing:
            raise FFNToolsError(f"{where}: config.json lacks {', '.join(missing)}, which mlx_lm's {name} model "
                                "requires (its ModelArgs); mlx_lm.load would fail the same way") from None
        raise FFNToolsError(f"{where}: mlx_lm's {name} ModelArgs rejects this config.json ({e})") from None
    try:
        model = mod.Model(args)
        model.eval()
    except Exception as e:  # noqa: BLE001 - mlx_lm's own failure on this config, any type
        raise FFNToolsError(f"{where}: mlx_lm's {name} model cannot be built from this config.json "
                            f"({type(e).__name__}: {e}); mlx_lm.load would fail the same way") from None
    return Target(name, model, config, added, parameters(model), Builder(name, config), renamed,
                  args=args_of(mod.ModelArgs, config))


_PARAMETERS: dict[type, frozenset[str]] = {}


def args_of(cls: Any, config: dict) -> Any:
    """``cls.from_dict(config)``: a module's ``ModelArgs`` as mlx_lm builds it. mlx_lm's ``BaseModelArgs.from_dict``
    works out the class's signature again for every key of the config (0.1 s for a config of a hundred keys, and a
    plan builds its model again and again); where the class keeps that ``from_dict``, the same keys are passed,
    in the same order, its parameters read once per class."""
    from mlx_lm.models.base import BaseModelArgs

    if getattr(cls.from_dict, "__func__", None) is not getattr(BaseModelArgs.from_dict, "__func__"):
        return cls.from_dict(config)  # its own
    params = _PARAMETERS.get(cls)
    if params is None:
        params = _PARAMETERS[cls] = frozenset(inspect.signature(cls).parameters)
    return cls(**{k: v for k, v in config.items() if k in params})


def check_runs(tg: Target, where: str) -> str | None:
    """mlx_lm's model run on one token as ``mlx_lm.generate`` runs it (with its prompt cache), lazily: its
    graph is built and nothing computed (MLX evaluates nothing unless asked; a model that reads a value back
    evaluates only what precedes it). A model that builds from a config may still not run on it: LFM2's
    indexes its cache by the first attention and the first conv layer, so one without a conv layer builds,
    loads, and fails on its first token (IndexError).

    Returns:
        None, or a line saying the check could not run here (the model runs Metal kernels; no Metal here).

    Raises:
        FFNToolsError: the model fails when it runs, naming the error and where mlx_lm raised it.
    """
    import traceback

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = tg.fresh()
    try:
        model(mx.array([[0]]), cache=make_prompt_cache(model))
    except Exception as e:  # noqa: BLE001 - mlx_lm's own failure on this config, any type
        frame = traceback.extract_tb(e.__traceback__)[-1]
        at = f"{frame.filename.rpartition('site-packages/')[2]}:{frame.lineno} in {frame.name}"
        if "No Metal back-end" in str(e):  # its own kernels, which run on Apple silicon only: not a failure
            return (f"mlx_lm's {tg.module} model runs Metal kernels ({at}): whether it runs on this config was not "
                    "tried here (no Metal back-end)")
        raise FFNToolsError(f"{where}: mlx_lm's {tg.module} model builds from this config.json but fails on its "
                            f"first token ({type(e).__name__}: {e}, at {at}): mlx_lm.load would load the export "
                            "and generation would fail; mlx_lm does not run this configuration") from None
    return None


def parameters(model) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of an mlx model (sanitize may change the model: read it after)."""
    from mlx.utils import tree_flatten

    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))  # no destination: mlx returns a list
    return {k: tuple(v.shape) for k, v in flat}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx-lm")
    except Exception:  # noqa: BLE001 - metadata missing: say nothing specific
        return ""
