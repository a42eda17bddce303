"""What the MLX export takes from mlx_lm, pinned against mlx_lm itself: the model class ``mlx_lm.load`` would
build for a config (its remapping tables, read as attributes), the ``ModelArgs`` it reads the config into, and
which modules ``mlx_lm.convert -q`` quantizes with which parameters (its own ``quantize_model`` and recipes)."""

from __future__ import annotations

import importlib

import pytest

from ffn_tools.errors import FFNToolsError

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

import mlx.nn as nn  # noqa: E402
import mlx_lm.utils  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import ffn_tools.converters.mlx.models as models  # noqa: E402  (our own: must import where mlx does)
import ffn_tools.converters.mlx.recipe as recipe  # noqa: E402

mlx_convert = importlib.import_module("mlx_lm.convert")  # the module: mlx_lm.convert is its convert function

# 8 layers, so a mixed recipe gives layers different bits; intermediate 96 is no multiple of group size 64.
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 8, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 160,
         "tie_word_embeddings": False}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
             "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 64,
             "rms_norm_eps": 1e-6, "vocab_size": 160, "rope_theta": 10000.0, "tie_word_embeddings": False,
             "max_position_embeddings": 128, "norm_topk_prob": True}


def test_the_remapping_tables_are_mlx_lms_own():
    assert models.remappings() == (mlx_lm.utils.MODEL_REMAPPING, mlx_lm.utils.MODEL_ARCHITECTURE_REMAPPING)
    assert models.remappings()[0] is mlx_lm.utils.MODEL_REMAPPING


def _loads_here(config: dict) -> bool:
    try:
        mlx_lm.utils._get_classes(config)
    except ValueError:  # the module needs a package that is not installed
        return False
    return True


def test_the_model_class_is_the_one_mlx_lm_load_builds():
    remap, arch_remap = models.remappings()
    configs = [{"model_type": t} for t in ("llama", "qwen3_moe", "mixtral", *remap)]
    configs += [{"model_type": t, "architectures": [a]} for t, a in arch_remap]
    checked = 0
    for config in configs:
        if not _loads_here(config):
            continue
        model_class, args_class = mlx_lm.utils._get_classes(config)  # what mlx_lm.load_model uses by default
        mod = models._import_model_module(models.module_name(config))
        assert (mod.Model, mod.ModelArgs) == (model_class, args_class), config
        assert models.loadable_type(config) == config["model_type"]
        checked += 1
    assert checked >= 5
    # transformers' text-only type: no module of its own; mlx_lm.load reads it as the type without _text
    with pytest.raises(ValueError, match="not supported"):
        mlx_lm.utils._get_classes({"model_type": "qwen3_5_text"})
    assert models.module_name({"model_type": "qwen3_5_text"}) == "qwen3_5"
    assert models.loadable_type({"model_type": "qwen3_5_text"}) == "qwen3_5"
    assert mlx_lm.utils._get_classes({"model_type": "qwen3_5"})[0] is \
        models._import_model_module("qwen3_5").Model
    assert models.module_name({"model_type": "apex1"}) is None
    assert models.module_name({"model_type": "no.such"}) is None


def test_target_args_are_model_args_from_the_completed_config():
    v5 = {k: v for k, v in QWEN3_MOE.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 5e5}}
    t = models.target(v5, "cfg")
    mod = models._import_model_module("qwen3_moe")
    assert isinstance(t.args, mod.ModelArgs) and t.args == mod.ModelArgs.from_dict(t.config)
    assert t.args.rope_theta == 5e5 and "rope_theta" in t.added
    assert t.args is not t.model.args  # its own: building a model may change the one it is given


def test_no_mlx_lm_model_is_refused_naming_the_type():
    with pytest.raises(FFNToolsError, match="has no model for model_type 'apex1'"):
        models.target({"model_type": "apex1"}, "x")


def _theirs(config: dict, quant, predicate=None):
    """The model and config mlx_lm.convert's quantize step gives (its recipe builder when a recipe is named)."""
    t = models.target(config, "cfg")
    model = t.fresh()
    if quant.recipe is not None:
        predicate = mlx_convert.mixed_quant_predicate_builder(quant.recipe, model, quant.given_group_size)
    return mlx_lm.utils.quantize_model(model, {}, quant.given_group_size, quant.bits, mode=quant.mode,
                                       quant_predicate=predicate)


@pytest.mark.parametrize("config, args", [
    (LLAMA, (True, None, None, None, "mixed_3_6")),
    (LLAMA, (True, None, 32, None, "mixed_2_6")),
    (LLAMA, (True, 3, 32, None, None)),
    (LLAMA, (True, None, None, None, None)),
    (QWEN3_MOE, (True, None, None, None, None)),  # the model's own quant_predicate: its router 8 bits
    (QWEN3_MOE, (True, None, None, "mxfp4", None)),
])
def test_decide_quantizes_what_mlx_lm_quantizes(config, args, capsys):
    quant = recipe.resolve(*args)
    d = recipe.decide(models.target(config, "cfg").fresh(), quant)
    assert capsys.readouterr().out == ""  # mlx_lm's "[INFO] Quantized ..." would spoil --json
    model, theirs = _theirs(config, quant)
    assert d.block == theirs["quantization"]
    quantized = {p: {"group_size": m.group_size or recipe.MODES[m.mode][0], "bits": m.bits, "mode": m.mode}
                 for p, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module) if hasattr(m, "bits")}
    assert d.chosen == quantized
    left = {p for p, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module) if hasattr(m, "to_quantized")}
    assert set(d.skipped) == left
    assert d.shapes == {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def test_decide_says_why_a_module_is_left():
    d = recipe.decide(models.target(LLAMA, "cfg").fresh(), recipe.resolve(True, None, None, None, None))
    assert d.skipped["model.layers.0.mlp.down_proj"] == "last dimension 96 is not a multiple of group size 64"
    assert "model.layers.0.mlp.up_proj" in d.chosen
    d = recipe.decide(models.target(QWEN3_MOE, "cfg").fresh(), recipe.resolve(True, None, None, None, None))
    assert d.chosen["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert d.block["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}  # as the predicate gave it


def test_recipes_are_mlx_lms_and_a_misfit_is_its_own_error():
    assert recipe.recipes() == mlx_convert.QUANT_RECIPES
    with pytest.raises(FFNToolsError, match="unknown quantization recipe 'mixed_9_9'; mlx_lm has mixed_2_6"):
        recipe.resolve(True, None, None, None, "mixed_9_9")
    no_down = models.target(LLAMA, "cfg").fresh()
    for layer in no_down.model.layers:  # no down_proj: the recipe cannot place its layer index
        layer.mlp = nn.Identity()
    with pytest.raises(FFNToolsError, match="--quant-predicate mixed_3_6: Model does not have expected keys"):
        recipe.decide(no_down, recipe.resolve(True, None, None, None, "mixed_3_6"))
