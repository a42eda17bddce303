"""mlx_lm's own model class for a config: the spec an MLX export must meet.

``target(config)`` imports ``mlx_lm.models.<type>`` (mlx_lm's remapping tables read from its source, then
the type with ``_text`` dropped: transformers' text-only ``qwen3_5_text`` is mlx_lm's ``qwen3_5``) and builds
``Model(ModelArgs.from_dict(config))``. MLX is lazy: the model's random initial weights are never computed,
so building even a large model costs only its Python objects. Its parameter tree (names, shapes) is what
``mlx_lm.load`` will demand, strictly.

Importing ``mlx_lm`` itself imports transformers and torch (its tokenizer code), over a second and a half;
the model modules need only mlx, so they are imported without running ``mlx_lm/__init__``.

What transformers v5 moved out of the place mlx_lm's ``ModelArgs`` read it is declared in ``ALIASES`` and
filled in (only keys the config lacks, only fields the ``ModelArgs`` has); ``complete_config`` says what.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from ffn_tools.errors import FFNToolsError

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
}
TIE_KEY = "tie_word_embeddings"


def _mlx_lm_dir() -> Path:
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        raise FFNToolsError("MLX export needs mlx-lm; install with: pip install 'ffn-tools[mlx]'")
    return Path(list(spec.submodule_search_locations)[0])


def remappings() -> tuple[dict, dict]:
    """mlx_lm's ``MODEL_REMAPPING`` and ``MODEL_ARCHITECTURE_REMAPPING``, read from its ``utils.py`` source
    (importing that module imports torch)."""
    tree = ast.parse((_mlx_lm_dir() / "utils.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("MODEL_REMAPPING", "MODEL_ARCHITECTURE_REMAPPING"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    return found.get("MODEL_REMAPPING", {}), found.get("MODEL_ARCHITECTURE_REMAPPING", {})


def _import_model_module(name: str) -> types.ModuleType | None:
    """``mlx_lm.models.<name>`` without running ``mlx_lm/__init__`` (which imports torch); None if absent.

    When mlx_lm is already imported, the usual import. Otherwise the package is stood in for while the model
    module imports, and every ``mlx_lm`` module is taken out of ``sys.modules`` afterwards, so a later
    ``import mlx_lm`` runs as if this had not happened.
    """
    if not (_mlx_lm_dir() / "models" / f"{name}.py").is_file():
        return None
    if "mlx_lm" in sys.modules and not getattr(sys.modules["mlx_lm"], "_ffn_tools_stand_in", False):
        return importlib.import_module(f"mlx_lm.models.{name}")
    before = set(sys.modules)
    stand_in = types.ModuleType("mlx_lm")
    stand_in.__path__ = [str(_mlx_lm_dir())]
    stand_in._ffn_tools_stand_in = True
    sys.modules["mlx_lm"] = stand_in
    try:
        return importlib.import_module(f"mlx_lm.models.{name}")
    finally:
        for k in set(sys.modules) - before:
            if k == "mlx_lm" or k.startswith("mlx_lm."):
                del sys.modules[k]


def module_name(config: dict) -> str | None:
    """The ``mlx_lm.models`` module mlx_lm would build ``config`` with (its remapping), else the model_type
    without ``_text``; None when mlx_lm has neither."""
    remap, arch_remap = remappings()
    model_type = config.get("model_type")
    archs = config.get("architectures") or ()
    archs = (archs,) if isinstance(archs, str) else archs
    first = next((arch_remap[(model_type, a)] for a in archs if (model_type, a) in arch_remap),
                 remap.get(model_type, model_type))
    for name in dict.fromkeys((first, remap.get(model_type.removesuffix("_text"), model_type.removesuffix("_text")))):
        if (_mlx_lm_dir() / "models" / f"{name}.py").is_file():
            return name
    return None


def _lookup(config: dict, path: str):
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
            value = next((v for p in paths if (v := _lookup(config, p)) is not None), None)
            if value is not None:
                config[key] = value
                added.append(key)
    rope = config.get("rope_parameters")
    if "rope_scaling" in fields and config.get("rope_scaling") is None and isinstance(rope, dict) \
            and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        config["rope_scaling"] = {"type": scaling["rope_type"], **scaling}
        added.append("rope_scaling")
    return config, added


@dataclass
class Target:
    """mlx_lm's model for a config, built lazily.

    Attributes:
        module: the ``mlx_lm.models`` module name.
        model: the model (nothing evaluated).
        config: the config it was built from (the source's, completed).
        added: config keys added to the source's (``complete_config``, ``tie_word_embeddings``).
        params: parameter name -> shape, as ``mlx_lm.load`` demands them.
    """

    module: str
    model: object
    config: dict
    added: list[str]
    params: dict[str, tuple[int, ...]]


def _fields(args_cls) -> dict[str, object]:
    """ModelArgs field -> default (``dataclasses.MISSING`` when required)."""
    out = {}
    for f in dataclasses.fields(args_cls):
        out[f.name] = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
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
    fields = _fields(mod.ModelArgs)
    config, added = complete_config(config, fields)
    default = fields.get(TIE_KEY)
    if TIE_KEY not in config and has_head is not None and TIE_KEY in fields and \
            (default is dataclasses.MISSING or bool(default) != (not has_head)):
        config[TIE_KEY] = not has_head
        added.append(TIE_KEY)
    missing = sorted(k for k, v in fields.items() if v is dataclasses.MISSING and k not in config)
    if missing:
        raise FFNToolsError(f"{where}: config.json lacks {', '.join(missing)}, which mlx_lm's {name} model "
                            "requires (ModelArgs); add them to config.json")
    try:
        model = mod.Model(mod.ModelArgs.from_dict(config))
    except Exception as e:  # noqa: BLE001 - mlx_lm's own failure on this config, any type
        raise FFNToolsError(f"{where}: mlx_lm's {name} model cannot be built from this config.json "
                            f"({type(e).__name__}: {e}); mlx_lm.load would fail the same way") from None
    from mlx.utils import tree_flatten

    params = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    return Target(name, model, config, added, params)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx-lm")
    except Exception:  # noqa: BLE001 - metadata missing: say nothing specific
        return ""
