"""What ``mlx_lm.convert -q`` quantizes, decided by mlx_lm itself on the lazily built model.

``decide`` calls ``mlx_lm.utils.quantize_model`` as ``mlx_lm.convert`` does: with the predicate of a
``--quant-predicate`` recipe (mlx_lm.convert's ``mixed_quant_predicate_builder``), else none, so the model's
own ``quant_predicate`` applies. It quantizes the lazy model in place (nothing is computed), and what it did
is read off the result: the modules it replaced are the quantized ones, the packed shapes the export must
write are MLX's own, and the config's ``quantization`` block is the one it returns.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass

from ffn_tools.errors import FFNToolsError

from .models import mlx_lm_module, parameters

logger = logging.getLogger(__name__)

# mode -> (default group size, default bits, allowed (group size, bits) pairs or None for any listed below)
MODES = {"affine": (64, 4, None), "mxfp4": (32, 4, {(32, 4)}), "nvfp4": (16, 4, {(16, 4)}),
         "mxfp8": (32, 8, {(32, 8)})}
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class Quant:
    """The quantization asked for: group size, bits, mode, and a mixed recipe name (or None)."""

    group_size: int
    bits: int
    mode: str = "affine"
    recipe: str | None = None
    given_group_size: int | None = None  # as given: mlx_lm builds a recipe with it (None included)

    @property
    def params(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


def recipes() -> list[str]:
    """mlx_lm.convert's ``QUANT_RECIPES``."""
    return list(mlx_lm_module("convert").QUANT_RECIPES)


def resolve(quantize, bits: int | None, group_size: int | None, mode: str | None, recipe: str | None) -> Quant | None:
    """The quantization the options ask for, or None; mlx_lm.convert's defaults per mode.

    ``quantize`` is True (``-q``) or bits (the older ``--quantize 4``); ``bits``/``group_size``/``mode``/
    ``recipe`` without it are refused rather than ignored.

    Raises:
        FFNToolsError: an option without ``-q``, a combination MLX does not offer.
    """
    if quantize in (None, False):
        given = [f for f, v in (("--q-bits", bits), ("--q-group-size", group_size), ("--q-mode", mode),
                                ("--quant-predicate", recipe)) if v is not None]
        if given:
            raise FFNToolsError(f"{', '.join(given)} only apply with -q/--quantize; add -q")
        return None
    if quantize is not True:
        if bits is not None and int(bits) != int(quantize):
            raise FFNToolsError(f"--quantize {quantize} and --q-bits {bits} disagree; give one")
        bits = int(quantize)
    mode = mode or "affine"
    if mode not in MODES:
        raise FFNToolsError(f"unknown quantization mode {mode!r}; use one of {', '.join(MODES)}")
    g0, b0, pairs = MODES[mode]
    given_group_size = int(group_size) if group_size is not None else None
    group_size, bits = int(group_size or g0), int(bits or b0)
    if pairs is not None and (group_size, bits) not in pairs:
        ok = " or ".join(f"--q-group-size {g} --q-bits {b}" for g, b in sorted(pairs))
        raise FFNToolsError(f"mode {mode} quantizes with {ok} only (got group size {group_size}, {bits} bits)")
    if mode == "affine" and bits not in AFFINE_BITS:
        raise FFNToolsError(f"cannot quantize to {bits} bits; use one of {', '.join(map(str, AFFINE_BITS))}")
    if mode == "affine" and group_size not in AFFINE_GROUPS:
        raise FFNToolsError(f"group size {group_size} is not supported; use one of "
                            f"{', '.join(map(str, AFFINE_GROUPS))}")
    if recipe is not None:
        if recipe not in recipes():
            raise FFNToolsError(f"unknown quantization recipe {recipe!r}; mlx_lm has {', '.join(recipes())}")
        if mode != "affine":
            raise FFNToolsError("--quant-predicate recipes quantize with mode affine only (as mlx_lm.convert)")
    return Quant(group_size, bits, mode, recipe, given_group_size)


def _own(params: dict) -> dict:
    """The parameters ``to_quantized(**params)`` quantizes with: mode affine unless given, then MLX's defaults
    for that mode in place of a missing or None group size / bits."""
    mode = params.get("mode") or "affine"
    g, b, _ = MODES[mode]
    return {"group_size": params.get("group_size") or g, "bits": params.get("bits") or b, "mode": mode}


@dataclass
class Decision:
    """What ``decide`` found.

    Attributes:
        chosen: module path -> its quantization parameters.
        skipped: module path -> why a quantizable module was left as it is.
        shapes: parameter name -> shape of the quantized lazy model.
        block: the config's ``quantization`` block, as ``quantize_model`` returns it.
    """

    chosen: dict[str, dict]
    skipped: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    block: dict


def decide(model, quant: Quant) -> Decision:
    """Which modules mlx_lm.convert quantizes and how, by mlx_lm's own ``quantize_model`` (see the module doc).

    Raises:
        FFNToolsError: the recipe does not apply to this model (mlx_lm's own ValueError).
    """
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    predicate = None  # quantize_model then takes the model's own quant_predicate, as mlx_lm.convert
    if quant.recipe is not None:
        try:
            predicate = mlx_lm_module("convert").mixed_quant_predicate_builder(quant.recipe, model,
                                                                                 quant.given_group_size)
        except ValueError as e:
            raise FFNToolsError(f"--quant-predicate {quant.recipe}: {e}") from None
    before: dict[str, nn.Module] = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # it prints the bits per weight; {}: a source with no quantization block
        model, config = mlx_lm_module("utils").quantize_model(model, {}, quant.group_size, quant.bits,
                                                              mode=quant.mode, quant_predicate=predicate)
    logger.debug("mlx_lm: %s", said.getvalue().strip())
    after: dict[str, nn.Module] = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    block, chosen, skipped = config["quantization"], {}, {}
    for path, module in before.items():
        if not hasattr(module, "to_quantized"):  # what nn.quantize can quantize at all
            continue
        if after.get(path) is not module:  # replaced by its quantized form
            verdict = block.get(path)
            chosen[path] = _own(verdict) if isinstance(verdict, dict) else quant.params
        elif (last := module.weight.shape[-1]) % quant.group_size:
            skipped[path] = f"last dimension {last} is not a multiple of group size {quant.group_size}"
        else:
            skipped[path] = "the model's quant_predicate keeps it" if quant.recipe is None else "the recipe keeps it"
    return Decision(chosen, skipped, parameters(model), block)
