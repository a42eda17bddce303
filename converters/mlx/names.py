"""Which input tensor becomes which mlx_lm parameter: mlx_lm's own ``sanitize``, run on stand-ins.

Every input tensor is stood in for by a lazy ``mx.zeros`` of its shape and dtype (never computed), and the
model's ``sanitize`` (the function ``mlx_lm.load`` and ``mlx_lm.convert`` run on a checkpoint) maps them.
An output that *is* one of the stand-ins, its graph untouched, is that input, renamed or not: a byte copy. One
that is a stand-in changed in place (Falcon-H1's ``param *= multiplier``: the same array object, a new graph)
and any other output were computed by ``sanitize``. The common computation, routed experts stacked on a new
first axis, is recognized by name (``...experts.{e}.{proj}.weight`` -> ``...switch_mlp.{proj}.weight`` or
``...experts.{proj}.weight``, with ``PROJECTION_ALIASES``) and shape, and written as byte copies too; every
other computed output is evaluated by running ``sanitize`` on the real, lazily loaded tensors
(``SanitizeRun``). Inputs without an output were dropped by ``sanitize`` (rotary buffers, a tied head, an
MTP layer) or used for a computed output; export reports them.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import mlx.core as mx

from ffn_tools.errors import FFNToolsError, listing

from .quant import MX_DTYPES, ST_DTYPES

# Expert projection names in checkpoints -> the names mlx_lm's switch layers may give the stack.
PROJECTION_ALIASES: dict[str, tuple[str, ...]] = {
    "w1": ("gate_proj",), "w3": ("up_proj",), "w2": ("down_proj",),
    "up_proj": ("up_proj", "fc1"), "down_proj": ("down_proj", "fc2"),
}
_EXPERT = re.compile(r"(?P<pre>.+)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)\.(?P<kind>weight|bias)")


@dataclass(frozen=True)
class Output:
    """One parameter of the MLX model and where it comes from.

    Attributes:
        name, shape, dtype: the parameter (dtype as safetensors names it).
        sources: input names: one (that tensor), E (stacked on a new first axis, in order), or none
            (computed by ``sanitize``; see ``SanitizeRun``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    sources: tuple[str, ...]

    @property
    def computed(self) -> bool:
        return not self.sources


def _stack_keys(name: str) -> list[str]:
    m = _EXPERT.fullmatch(name)
    if not m:
        return []
    pre, proj, kind = m["pre"], m["proj"], m["kind"]
    return [f"{pre}.{box}.{alias}.{kind}" for alias in dict.fromkeys((proj, *PROJECTION_ALIASES.get(proj, ())))
            for box in ("switch_mlp", "experts")]


MAX_DIM = 2 ** 31 - 1  # MLX holds a shape as 32-bit ints: no MLX array, so no MLX checkpoint, has a larger dim


def stand_ins(shapes: Mapping[str, tuple[tuple[int, ...], str]]) -> dict[str, mx.array]:
    """A lazy zero array per input (name -> (shape, safetensors dtype)); nothing is allocated.

    Raises:
        FFNToolsError: a dimension MLX cannot hold (an empty tensor with a huge shape is valid safetensors).
    """
    big = [f"{n} {list(shape)}" for n, (shape, _) in shapes.items() if any(d > MAX_DIM for d in shape)]
    if big:
        raise FFNToolsError(f"{listing(big, 3)}: a dimension past 2^31 - 1, which an MLX array cannot have (MLX "
                            "shapes are 32-bit): no MLX checkpoint can hold this tensor; drop it or fix its shape")
    return {n: mx.zeros(shape, MX_DTYPES.get(st, mx.uint8)) for n, (shape, st) in shapes.items()}


def _graph(a: mx.array) -> str:
    """``a``'s lazy graph as text: it changes when an operation rebinds ``a`` in place (``a *= m``)."""
    out = io.StringIO()
    mx.export_to_dot(out, a)
    return out.getvalue()


def sanitize(model, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The model's ``sanitize`` on ``weights`` (a copy of the dict; models without one keep it).

    Raises:
        FFNToolsError: sanitize itself failed (a tensor it needs is missing, a shape it cannot reshape).
    """
    if not hasattr(model, "sanitize"):
        return dict(weights)
    try:
        return model.sanitize(dict(weights))
    except KeyError as e:
        raise FFNToolsError(f"mlx_lm's sanitize needs {e.args[0]}, which the checkpoint lacks") from None
    except Exception as e:  # noqa: BLE001 - mlx_lm's own failure, any type
        raise FFNToolsError(f"mlx_lm's sanitize fails on this checkpoint ({type(e).__name__}: {e})") from None


def map_outputs(model, shapes: Mapping[str, tuple[tuple[int, ...], str]]) -> tuple[list[Output], list[str]]:
    """Every tensor ``sanitize`` produces from inputs of ``shapes``, and the inputs without an output of
    their own (dropped, or used by a computed output).

    Returns:
        (outputs in sanitize's order, unused input names in input order).
    """
    inputs = stand_ins(shapes)
    graphs = {n: _graph(a) for n, a in inputs.items()}
    result = sanitize(model, inputs)
    # a stand-in sanitize scaled in place is computed: the same object, another graph
    ident = {id(a): n for n, a in inputs.items() if _graph(a) == graphs[n]}
    used = {ident[id(a)] for a in result.values() if id(a) in ident}
    spare: dict[str, list[tuple[int, str]]] = {}
    for n in inputs:
        if n not in used and (m := _EXPERT.fullmatch(n)):  # only an expert's tensor has stack keys
            for key in _stack_keys(n):
                spare.setdefault(key, []).append((int(m["e"]), n))
    outputs = []
    for name, a in result.items():
        if id(a) in ident:
            outputs.append(Output(name, tuple(a.shape), shapes[ident[id(a)]][1], (ident[id(a)],)))
            continue
        members = sorted(spare.get(name, ()))
        srcs = tuple(n for _, n in members)
        first = shapes[srcs[0]] if srcs else None
        if first is not None and [e for e, _ in members] == list(range(len(srcs))) and tuple(a.shape) == (len(srcs), *first[0]) \
                and all(shapes[s] == first for s in srcs) and ST_DTYPES.get(a.dtype) == first[1]:
            outputs.append(Output(name, tuple(a.shape), first[1], srcs))
            used.update(srcs)
        else:
            outputs.append(Output(name, tuple(a.shape), ST_DTYPES.get(a.dtype, "U8"), ()))
    return outputs, [n for n in inputs if n not in used]


class SanitizeRun:
    """Outputs ``sanitize`` computes, evaluated from the real tensors.

    ``load()`` gives every input as an ``mx.array`` (lazily loaded where it can be: ``mx.load`` of the
    safetensors file reads a tensor only when it is used). Evaluated arrays keep their inputs' data, so a run
    is started afresh after ``budget`` bytes of outputs: memory stays near that plus one output's inputs.

    It is data: ``models`` and ``load`` are values that pickle (``models.Builder``: mlx_lm's module name and the
    config; ``tensors.Inputs``: the checkpoint and the view), and a pickled run leaves what it computed behind.
    """

    def __init__(self, models: Callable[[], object], load: Callable[[], dict[str, mx.array]], budget: int = 1 << 30):
        """``models`` gives a new model per run (sanitize may change the model it runs on)."""
        self.models, self.load, self.budget = models, load, budget
        self._result: dict[str, mx.array] | None = None
        self._spent = 0

    def __getstate__(self) -> dict:
        """What the run is, without what it computed: it runs again where it lands."""
        return {**self.__dict__, "_result": None, "_spent": 0}

    def get(self, name: str) -> mx.array:
        if self._result is None or self._spent > self.budget or name not in self._result:  # asked again: afresh
            self._result, self._spent = sanitize(self.models(), self.load()), 0
        a = self._result.pop(name)
        mx.eval(a)
        self._spent += a.nbytes
        return a
