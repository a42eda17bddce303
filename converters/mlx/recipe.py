"""What ``mlx_lm.convert -q`` quantizes, decided by mlx_lm's own rules on the lazily built model.

``decide`` replays ``mlx_lm.utils.quantize_model``: a module is quantized when it has ``to_quantized`` and
its weight's last dimension is a multiple of the group size, and the predicate (a ``--quant-predicate``
recipe, else the model's own ``quant_predicate``) does not say no; a dict from the predicate is that
module's own parameters and goes into the config's ``quantization`` block. The recipes are mlx_lm's
``mixed_quant_predicate_builder`` (read from ``mlx_lm/convert.py``, which imports torch, by loading just
that function). ``nn.quantize`` is then run on the lazy model, so the packed shapes the export must write
come from MLX itself.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ffn_tools.errors import FFNToolsError

from .models import _mlx_lm_dir

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
    """mlx_lm's ``QUANT_RECIPES`` (read from its convert.py source)."""
    return list(_convert_source()[1])


def _convert_source() -> tuple[ast.FunctionDef, list[str]]:
    tree = ast.parse((_mlx_lm_dir() / "convert.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "mixed_quant_predicate_builder")
    names = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "QUANT_RECIPES")
    return fn, names


def _recipe_builder():
    """mlx_lm's ``mixed_quant_predicate_builder``, compiled from its source alone."""
    import mlx.nn as nn

    fn, _ = _convert_source()
    module = ast.Module(body=[fn], type_ignores=[])
    scope = {"nn": nn, "Callable": object, "Union": object, "__name__": "mlx_lm_convert_recipes"}
    exec(compile(ast.fix_missing_locations(module), str(_mlx_lm_dir() / "convert.py"), "exec"), scope)  # noqa: S102
    return scope["mixed_quant_predicate_builder"]


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
    given = int(group_size) if group_size is not None else None
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
    return Quant(group_size, bits, mode, recipe, given)


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
        shapes: parameter name -> shape of the quantized model (from ``nn.quantize`` on the lazy model).
        block: the config's ``quantization`` block.
    """

    chosen: dict[str, dict]
    skipped: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    block: dict


def decide(model, quant: Quant) -> Decision:
    """Which modules mlx_lm.convert quantizes and how, by its own rules (see the module doc)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    predicate = getattr(model, "quant_predicate", None)
    if quant.recipe is not None:
        try:
            predicate = _recipe_builder()(quant.recipe, model, quant.given_group_size)
        except ValueError as e:
            raise FFNToolsError(f"--quant-predicate {quant.recipe}: {e}") from None
    block, chosen, skipped = dict(quant.params), {}, {}

    def wrapped(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        if module.weight.shape[-1] % quant.group_size:
            skipped[path] = f"last dimension {module.weight.shape[-1]} is not a multiple of group size {quant.group_size}"
            return False
        verdict = predicate(path, module) if predicate is not None else True
        if not verdict:
            skipped[path] = "the model's quant_predicate keeps it" if quant.recipe is None else "the recipe keeps it"
        if isinstance(verdict, dict):
            block[path] = verdict
        if verdict:
            chosen[path] = _own(verdict) if isinstance(verdict, dict) else quant.params
        return verdict

    nn.quantize(model, quant.group_size, quant.bits, mode=quant.mode, class_predicate=wrapped)
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    return Decision(chosen, skipped, shapes, block)
