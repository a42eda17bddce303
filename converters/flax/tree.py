"""Names of the two Flax tree layouts, both ways, as data.

``hf``: the tree Hugging Face Flax models used (transformers 4.x ``FlaxLlamaForCausalLM`` & co.). A PyTorch
name splits on ``.`` into nested keys; a 2-D ``weight`` becomes ``kernel`` = W.T (in, out), or
``embedding`` (unchanged) when its module is an embedding; everything else (norm ``weight`` as
``FlaxLlamaRMSNorm`` names it, biases, transformers-v5 stacked expert tensors) keeps its name and
orientation. The mapping is a bijection, so reading inverts it exactly.

``linen``: FFNs only, each the parameters of a Linen module with three ``nn.Dense`` named gate, up, down:

    params/layers_{L}/{gate,up,down}/{kernel,bias}                 dense FFN of layer L
    params/layers_{L}_experts_{E}/{gate,up,down}/{kernel,bias}     routed expert E of layer L
    params/layers_{L}_shared_expert/{gate,up,down}/{kernel,bias}   shared expert of layer L

kernels (in, out): gate, up (d_model, d_ffn), down (d_ffn, d_model); ``bias`` only where the FFN has one.
A bare module tree (``{"params": {"gate": ..., "up": ..., "down": ...}}``) reads as layer 0. Read back,
each FFN is named as ``extract`` names it: ``layers.{L}[.experts.{E}|.shared_expert].{gate,up,down}.weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ffn_tools.errors import CheckpointError, FFNToolsError
from ffn_tools.registry import PROJECTIONS

# Modules whose 2-D ``weight`` is an embedding table (stored as ``embedding``, not transposed).
EMBEDDING_MODULES = frozenset({"embed_tokens", "embed_in", "tok_embeddings", "wte", "wpe", "word_embeddings",
                               "position_embeddings", "token_type_embeddings", "embed_positions", "shared"})
RESERVED = ("kernel", "embedding")  # leaf names the hf layout derives; a PyTorch name cannot end in them

ROLES = PROJECTIONS  # gate, up, down
LINEN_ROOT = "params"
LINEN_SUBTREE = {"dense": "layers_{layer}", "expert": "layers_{layer}_experts_{expert}",
                 "shared": "layers_{layer}_shared_expert"}
CANONICAL_PREFIX = {"dense": "layers.{layer}", "expert": "layers.{layer}.experts.{expert}",
                    "shared": "layers.{layer}.shared_expert"}
_LINEN_RX = re.compile(r"layers_(?P<layer>[0-9]+)(?:_experts_(?P<expert>[0-9]+)|(?P<shared>_shared_expert))?")


def hf_path(name: str, ndim: int) -> tuple[tuple[str, ...], bool]:
    """The hf-layout tree path of a PyTorch tensor, and whether it is stored transposed.

    Raises:
        FFNToolsError: the name ends in a component the layout reserves.
    """
    parts = name.split(".")
    if parts[-1] in RESERVED:
        raise FFNToolsError(f"tensor {name!r} cannot be stored in the hf Flax layout: a name ending in "
                            f"{parts[-1]!r} would read back as a .weight; rename it or use --flax-layout linen")
    if parts[-1] == "weight" and ndim == 2:
        if len(parts) > 1 and parts[-2] in EMBEDDING_MODULES:
            return (*parts[:-1], "embedding"), False
        return (*parts[:-1], "kernel"), True  # (out, in) -> kernel (in, out)
    return tuple(parts), False


def hf_name(path: tuple[str, ...], ndim: int, file) -> tuple[str, bool]:
    """The PyTorch name of an hf-layout leaf, and whether it is transposed back (the inverse of ``hf_path``).

    Raises:
        CheckpointError: a kernel or embedding that is not 2-D.
    """
    if path[-1] in RESERVED:
        if ndim != 2:
            raise CheckpointError(f"{file}: {'/'.join(path)} has {ndim} dims; an hf-layout {path[-1]} is 2-D "
                                  f"({'(in, out) = W.T' if path[-1] == 'kernel' else '(vocab, d_model)'}); "
                                  "re-export the tree with 2-D kernels")
        return ".".join((*path[:-1], "weight")), path[-1] == "kernel"
    return ".".join(path), False


@dataclass(frozen=True)
class LinenFFN:
    """One FFN subtree of a linen-layout tree."""

    prefix: tuple[str, ...]  # tree path of the module's parameters, e.g. ("params", "layers_0")
    layer: int
    kind: str  # "dense" | "expert" | "shared"
    expert: int = -1

    @property
    def canonical(self) -> str:
        return CANONICAL_PREFIX[self.kind].format(layer=self.layer, expert=self.expert)


def linen_subtree(layer: int, kind: str, expert: int) -> tuple[str, str]:
    """The tree path of an FFN's module parameters."""
    return LINEN_ROOT, LINEN_SUBTREE[kind].format(layer=layer, expert=expert)


def linen_ffns(paths: list[tuple[str, ...]]) -> dict[tuple[str, ...], LinenFFN] | None:
    """The FFN subtrees when ``paths`` (a tree's leaf paths) are a linen-layout tree, else None.

    A tree is linen when every leaf is ``[params/]SUBTREE/{gate,up,down}/LEAF`` with SUBTREE as above, or
    ``[params/]{gate,up,down}/LEAF`` (one bare module: layer 0). Leaf names are checked by ``check_linen``.
    """
    strip = 1 if paths and all(p[0] == LINEN_ROOT for p in paths) else 0
    rest = [p[strip:] for p in paths]
    if rest and all(len(r) == 2 and r[0] in ROLES for r in rest):
        return {tuple(paths[0][:strip]): LinenFFN(tuple(paths[0][:strip]), 0, "dense")}
    if not rest or not all(len(r) == 3 and r[1] in ROLES for r in rest):
        return None
    subtrees = {p[: strip + 1]: _LINEN_RX.fullmatch(p[strip]) for p in paths}  # each module once, in tree order
    out: dict[tuple[str, ...], LinenFFN] = {}
    for prefix, m in subtrees.items():
        if m is None:
            return None
        kind = "expert" if m["expert"] else "shared" if m["shared"] else "dense"
        out[prefix] = LinenFFN(prefix, int(m["layer"]), kind, int(m["expert"]) if m["expert"] else -1)
    return out


def check_linen(ffn: LinenFFN, leaves: dict[tuple[str, ...], tuple[str, tuple[int, ...]]]) -> list[str]:
    """Problems of one linen FFN subtree (empty when fine). ``leaves``: path -> (dtype name, shape)."""
    where = "/".join(ffn.prefix) or "the top level"
    mine = {p[len(ffn.prefix):]: v for p, v in leaves.items() if p[: len(ffn.prefix)] == ffn.prefix}
    problems = [f"{where}/{'/'.join(p)}: unexpected; a Dense layer holds only kernel and bias"
                for p in mine if p[1] not in ("kernel", "bias")]
    missing = [f"{where}/{r}/kernel" for r in ROLES if (r, "kernel") not in mine]
    if missing:
        return problems + [f"{', '.join(missing)}: missing; an FFN needs gate, up and down kernels"]
    h, i = (mine[("gate", "kernel")][1] + (None, None))[:2]
    want = {("gate", "kernel"): (h, i), ("up", "kernel"): (h, i), ("down", "kernel"): (i, h),
            ("gate", "bias"): (i,), ("up", "bias"): (i,), ("down", "bias"): (h,)}
    for p, (_, shape) in sorted(mine.items()):
        if p in want and tuple(shape) != want[p]:
            problems.append(f"{where}/{'/'.join(p)}: shape {list(shape)}, expected {list(want[p])} "
                            f"(kernels are (in, out): gate, up (d_model, d_ffn), down (d_ffn, d_model); "
                            f"from {where}/gate/kernel {list(mine[('gate', 'kernel')][1])}); store it as W.T")
    dtypes = {v[0] for v in mine.values()}
    if len(dtypes) > 1:
        listed = ", ".join(f"{'/'.join(p)} {v[0]}" for p, v in sorted(mine.items()))
        problems.append(f"{where}: mixes dtypes ({listed}); an FFN has one dtype: cast its parameters to one "
                        "(e.g. jax.tree.map(lambda a: a.astype(jnp.float32), params)) before saving")
    return problems
