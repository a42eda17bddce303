"""Each MoE layer of a checkpoint as expert surgery moves it: its routed experts' tensors (per expert, or the
stacks holding them all), and its router's, found from the scheme's names (``detect.find_ffns``) and the router
names of ``routers``.

Per-expert names are renamed by their expert segment (``{head}{expert}.`` -> ``{head}{new}.``, every tensor of
that expert's module: weights, biases, scales); a stack's tensors are every tensor beside its FFN tensors
(``{module}.*``: the weights, their biases, scales and blocks), each of dim 0 E (or E blocks of rows, flat).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..detect import FFNSet
from ..errors import FFNToolsError
from ..ffn import FFN
from .routers import ROUTER_TENSORS


@dataclass
class MoELayer:
    """One layer's routed experts as stored.

    Attributes:
        layer: its number (``FFNRef.layer``).
        experts: E, its routed experts.
        heads: per-expert form: expert -> the prefix its tensors' names start with (``...experts.3.``).
        tensors: per-expert form: expert -> its tensors' names.
        stacks: stacked form: the tensors holding every expert (dim 0 E), name -> True where flat (E blocks of
            rows).
        routers: the router's tensors (dim 0 E).
        block: the module holding the router (``model.layers.0.mlp``).
    """

    layer: int
    experts: int
    heads: dict[int, str] = field(default_factory=dict)
    tensors: dict[int, list[str]] = field(default_factory=dict)
    stacks: dict[str, bool] = field(default_factory=dict)
    routers: list[str] = field(default_factory=list)
    block: str = ""

    @property
    def names(self) -> list[str]:
        """Every tensor this layer's surgery rewrites."""
        return [*(n for ns in self.tensors.values() for n in ns), *self.stacks, *self.routers]


def _head(f: FFN) -> str:
    """``model.layers.0.mlp.experts.`` of a per-expert FFN: its name before the expert index."""
    role, name = next((r, n) for r, n in f.names.items() if r in f.form.templates())
    tail = f.form.templates()[role].split("{expert}", 1)[1]
    stem = f"{f.ref.expert}{tail}"
    if not name.endswith(stem) or not tail.startswith("."):
        raise FFNToolsError(f"{name}: cannot tell its expert index's place in the name (template "
                            f"{f.form.templates()[role]})")
    return name[:-len(stem)]


def _module(name: str) -> str:
    return name.rpartition(".")[0]


def moe_layers(ckpt, ffns: FFNSet) -> dict[int, MoELayer]:
    """Every layer with routed experts, as ``MoELayer``: the FFNs ``ffns`` found in ``ckpt`` (the names its readers
    give), their tensors as ``ckpt.stored`` holds them (the same names, or, where a view reads the experts of a
    stack one by one, as MLX's ``switch_mlp`` does, the stacks: every stored tensor beside the router of dim 0 E
    but the layer's other FFNs'). Quantized parts (scales, biases, blocks) move with their weights.

    Raises:
        FFNToolsError: a layer's experts in two groups or forms, numbered from an offset, a stack's tensor whose
            dim 0 is not E, a router not found or of another dim 0, per-expert tensors not stored anywhere.
    """
    by_layer: dict[int, list[FFN]] = defaultdict(list)
    for f in ffns.ffns:
        if f.ref.kind == "expert":
            by_layer[f.ref.layer].append(f)
    if not by_layer:
        raise FFNToolsError(f"{ckpt.path}: no routed experts (scheme {ffns.scheme.name}): nothing to prune")
    stored = ckpt.stored
    names = list(stored)
    heads: dict[str, tuple[int, int]] = {}
    layers: dict[int, MoELayer] = {}
    for layer, experts in sorted(by_layer.items()):
        f0 = experts[0]
        if len({(f.group.name, f.form_name) for f in experts}) > 1:
            raise FFNToolsError(f"layer {layer}: its routed experts are in several groups or forms "
                                f"({sorted({f.group.name for f in experts})}): one set of experts per layer")
        if f0.group.first_expert is not None:
            raise FFNToolsError(f"layer {layer}: experts numbered after others ({f0.group.name}: its router scores "
                                "them with the routed ones): not handled by expert surgery")
        if sorted(f.ref.expert for f in experts) != list(range(len(experts))):
            raise FFNToolsError(f"layer {layer}: experts {sorted(f.ref.expert for f in experts)} are not 0-"
                                f"{len(experts) - 1}")
        m = layers[layer] = MoELayer(layer, len(experts))
        if f0.index is None:
            for f in experts:
                m.heads[f.ref.expert] = head = _head(f) + f"{f.ref.expert}."
                heads[head] = (layer, f.ref.expert)
                m.tensors[f.ref.expert] = []
            container = _module(m.heads[0].rstrip("."))
        else:
            modules = {_module(n) for n in f0.names.values()}
            for n in names:  # the stack's tensors, or under it (MLX's GPT-OSS: experts.gate_proj.{weight,scales})
                if any(n.startswith(f"{mod}.") for mod in modules):
                    m.stacks[n] = _stack_rows(stored, n, len(experts), f0.form.flat)
            if not m.stacks:  # the router alone would be cut: a model its runtime refuses, written without a word
                raise FFNToolsError(f"layer {layer}: no stored tensor holds its {len(experts)} stacked experts (read "
                                    f"as {sorted(f0.names.values())[0]}): expert surgery cannot move them")
            container = _module(f0.names["down"])
        m.block, m.routers = _routers(stored, layer, container, len(experts))
    for n in names:  # every tensor of a per-expert module: its weights, biases, scales
        parts = n.split(".")
        for i in range(1, len(parts) - 1):
            if parts[i].isdigit() and (hit := heads.get(".".join(parts[:i + 1]) + ".")) is not None:
                layers[hit[0]].tensors[hit[1]].append(n)
                break
    for layer, m in layers.items():
        if m.heads and not any(m.tensors.values()):  # read per expert, stored stacked
            _stacked_beside(stored, m, ffns)
    return layers


def _stacked_beside(stored, m: MoELayer, ffns: FFNSet) -> None:
    """``m``'s experts, read one by one, as ``stored`` holds them: the tensors under the router's module of dim
    0 E that are neither the router's nor another FFN's of the layer (the shared expert's)."""
    block = m.block
    others = {_module(n) for f in ffns.ffns if f.ref.layer == m.layer and f.ref.kind != "expert"
              for n in f.names.values()}
    for n in stored:
        if n.startswith(block + ".") and n not in m.routers and _module(n) not in others:
            shape = tuple(stored.info(n).shape)
            if shape and shape[0] == m.experts:
                m.stacks[n] = False
    if not m.stacks:
        raise FFNToolsError(f"layer {m.layer}: its experts ({m.heads[0]}...) are stored neither under those names "
                            f"nor as stacks of {m.experts} under {block}")
    m.heads, m.tensors = {}, {}


def _stack_rows(ckpt, name: str, experts: int, flat: bool) -> bool:
    shape = tuple(ckpt.info(name).shape)
    if shape and (shape[0] == experts or (flat and shape[0] % experts == 0)):
        return flat and shape[0] != experts
    raise FFNToolsError(f"{name}: shape {list(shape)} beside a stack of {experts} experts, but its dim 0 is not "
                        f"{experts}{' (or a multiple, flat)' if flat else ''}: cannot tell its experts apart")


def _routers(ckpt, layer: int, container: str, experts: int) -> tuple[str, list[str]]:
    """The block above the experts (``container``: ``model.layers.0.mlp.experts``) holding the router, and the
    router's tensors."""
    block, tried = container, []
    for _ in range(2):
        block = _module(block)
        found = [n for s in ROUTER_TENSORS if (n := f"{block}.{s}") in ckpt]
        tried.append(block)
        if found:
            bad = [n for n in found if not ckpt.info(n).shape or ckpt.info(n).shape[0] != experts]
            if bad:
                raise FFNToolsError(f"layer {layer}: router tensor {bad[0]} has shape "
                                    f"{list(ckpt.info(bad[0]).shape)}, not {experts} rows (one per expert)")
            return block, found
    raise FFNToolsError(f"layer {layer}: no router found beside its experts (looked for "
                        f"{', '.join(ROUTER_TENSORS)} under {' and '.join(tried)}): its rows must move with the "
                        "experts")
