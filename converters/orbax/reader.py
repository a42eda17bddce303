"""An Orbax checkpoint seen with Hugging Face names, one array (or one layer of it) at a time.

Two layouts, recognised from the key paths:

- ``hf``: the Hugging Face Flax tree (``converters.flax.tree``: ``model/layers/0/mlp/gate_proj/kernel`` = W.T), as
  ``orbax.checkpoint`` saves a Flax model's params (under ``params/`` or not).
- ``nnx``: FFNs only, each the state of an NNX module of ``nnx.Linear`` gate, up and down
  (``layers_{L}[_experts_{E}|_shared_expert]/{gate,up,down}/{kernel,bias}[/value]``, as the Flax format's linen
  layout names them), read back with the names ``extract`` gives FFNs.
- ``maxtext``: MaxText's decoder (``converters.orbax.maxtext``): each Hugging Face tensor is one layer's (and
  expert's) slab of a scanned array (saved with ``scan_layers: false``: of ``decoder/layers_{L}``'s arrays). A
  slab is read alone where the array is chunked by layer (as ffn-tools writes it); where one chunk holds every
  layer (as Orbax writes by default) the array is read once and kept while its layers are read in turn: memory
  stays the largest array.

config.json beside ``_METADATA`` (ffn-tools writes one) is the model's; else ``ffn-tools --config FILE``; else, for
MaxText, one inferred from the shapes, with what was assumed said (MaxText keeps its model's settings in its YAML).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ffn_tools import progress
from ffn_tools.errors import CheckpointError, listing
from ffn_tools.io.dtypes import st_of_name
from ffn_tools.io.store import Checkpoint, TensorInfo, config_beside, config_dtype, say_assumed

from ..flax import tree as flax_tree
from . import maxtext as mt
from .store import OrbaxTree, item_dir

if TYPE_CHECKING:
    import torch


def to_torch(a) -> torch.Tensor:
    """A numpy array (bfloat16 as ml_dtypes') as a torch tensor of the same bits."""
    import ml_dtypes
    import numpy as np
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


# Fields of a Flax TrainState beside its ``params`` (MaxText's checkpoints of a run) that are training state
TRAINING_STATE = ("opt_state", "step")


def layout_of(paths: list[tuple[str, ...]]) -> tuple[str, tuple[str, ...]]:
    """(layout, prefix) of a tree's array paths: MaxText's (under ``params/params``, ``params`` or nothing: the
    arrays of its decoder there, any other array then named as unknown) or the Hugging Face Flax tree (under
    ``params`` or nothing)."""
    for prefix in (mt.ROOT, mt.ROOT[:1], ()):
        inner = [p[len(prefix):] for p in paths if p[: len(prefix)] == prefix]
        if any(p[:2] == ("decoder", "layers") or p[:1] == ("token_embedder",) for p in inner):
            return "maxtext", prefix
    if paths and flax_tree.linen_ffns([_unvalued(p) for p in paths]) is not None:
        return "nnx", ()
    strip = ("params",) if paths and all(p[:1] == ("params",) for p in paths) else ()
    return "hf", strip


def _unvalued(keys: tuple[str, ...]) -> tuple[str, ...]:
    """An NNX state's key path without its trailing ``value`` (``nnx.state`` keeps one; a pure dict none)."""
    return keys[:-1] if keys and keys[-1] == "value" else keys


class OrbaxCheckpoint(Checkpoint):
    """See the module docstring.

    Attributes:
        layout: "hf", "nnx" or "maxtext".
        assumed: what the config took without reading it.
    """

    kind, described = "orbax", "an Orbax"

    def __init__(self, path: Path):
        root, step = item_dir(Path(path))
        if step:
            progress.say(step)
        self.tree = OrbaxTree(root)
        self.training_state = [p for p in self.tree.paths if p[:1] and p[0] in TRAINING_STATE]
        self.paths = [p for p in self.tree.paths if not (p[:1] and p[0] in TRAINING_STATE)]
        self.layout, self.prefix = layout_of(self.paths)
        config = config_beside(root, root.parent)
        self.assumed: list[str] = []
        self._sources: dict[str, tuple[Any, ...]] = {}
        self._cache: tuple[tuple[str, ...], Any] | None = None
        infos: dict[str, TensorInfo] = {}
        file = root / "_METADATA"
        if self.layout == "nnx":
            self._nnx(infos, file)
        elif self.layout == "hf":
            for keys in self.paths:
                shape, dtype = self.tree.shape_dtype(keys)
                name, transposed = flax_tree.hf_name(keys[len(self.prefix):], len(shape), root)
                infos[name] = TensorInfo(name, st_of_name(dtype), shape[::-1] if transposed else shape, file)
                self._sources[name] = ("hf", keys, transposed)
        else:
            found = self._maxtext_arrays()
            if config is None:
                config, self.assumed = infer_config(found, self.tree)
            self.model = mt.Model.of(config)
            key = next((k for k, (p, _) in found.items() if p.hf.endswith("k_proj.weight")), None)
            hf_dtype = config_dtype(config) or (self.tree.shape_dtype(key)[1] if key else None)  # the query's
            for keys, (param, layer) in found.items():
                shape, dtype = self.tree.shape_dtype(keys)
                for name, where, slab in _slabs(param, shape, layer):
                    out = hf_dtype if (param.kind == "query" and hf_dtype) else dtype
                    infos[name] = TensorInfo(name, st_of_name(out), mt.hf_shape(param, slab), file)
                    self._sources[name] = ("maxtext", keys, where, param, out)
        super().__init__(path, root, [file], infos, {"format": "pt"}, config)
        if self.training_state:
            fields = sorted({p[0] for p in self.training_state})
            progress.say(f"{root}: {len(self.training_state)} training-state array(s) not read as weights, left out: "
                         + ", ".join(f"{f}/* ({sum(p[0] == f for p in self.training_state)})" for f in fields)
                         + (f"; the model read from {'/'.join(self.prefix)}/*" if self.prefix else ""))
        say_assumed(root, self.assumed)

    def _nnx(self, infos: dict[str, TensorInfo], file: Path) -> None:
        """The FFN trees of an NNX state, named as ``extract`` names FFNs, kernels read back (out, in).

        Raises:
            CheckpointError: a tree whose kernels do not fit one another (listed).
        """
        plain = {_unvalued(k): k for k in self.paths}
        ffns = flax_tree.linen_ffns(list(plain)) or {}
        shapes = {p: (dtype, shape) for p, k in plain.items() for shape, dtype in [self.tree.shape_dtype(k)]}
        problems = [msg for ffn in ffns.values() for msg in flax_tree.check_linen(ffn, shapes)]
        if problems:
            raise CheckpointError(f"{self.tree.root}: not an NNX state of gate/up/down modules: "
                                  + "; ".join(sorted(problems)))
        for p, keys in plain.items():
            ffn = ffns[p[: len(p) - 2]]
            name = f"{ffn.canonical}.{p[-2]}.{'weight' if p[-1] == 'kernel' else 'bias'}"
            dtype, shape = shapes[p]
            kernel = p[-1] == "kernel"
            infos[name] = TensorInfo(name, st_of_name(dtype), shape[::-1] if kernel else shape, file)
            self._sources[name] = ("hf", keys, kernel)

    def _maxtext_arrays(self) -> dict[tuple[str, ...], tuple[mt.Param, int | None]]:
        """Each array of the tree, the Hugging Face tensor whose slabs it holds, and for a tree saved with
        ``scan_layers: false`` (``decoder/layers_{L}/...``, one array a layer) its layer.

        Raises:
            CheckpointError: arrays of no known MaxText name (listed).
        """
        known: dict[tuple[str, ...], list[mt.Param]] = {}
        for p in mt.PARAMS:
            for block in set(mt.MOE_BLOCKS.values()):
                known.setdefault(tuple(k.replace("{MOE}", block) for k in p.path), []).append(p)
        found, unknown = {}, []
        for keys in self.paths:
            if keys[: len(self.prefix)] != self.prefix:
                unknown.append("/".join(keys))
                continue
            inner, layer = keys[len(self.prefix):], None
            m = re.fullmatch(r"layers_(\d+)", inner[1]) if len(inner) > 2 and inner[0] == "decoder" else None
            if m:  # scan_layers false: the layer in the name, no layer axis
                inner, layer = ("decoder", "layers", *inner[2:]), int(m[1])
            if inner not in known:
                unknown.append("/".join(keys))
                continue
            params = known[inner]
            moe = [p for p in params if p.expert or "{MOE}" in p.path]
            if moe:  # Mixtral's or Qwen3-MoE's names: by the block's name
                mixtral = "MoeBlock_0" in inner
                params = [p for p in params if (".block_sparse_moe." in p.hf) == mixtral]
            found[keys] = (params[0], layer)
        if unknown:
            raise CheckpointError(f"{self.tree.root}: {len(unknown)} array(s) of no MaxText name known here: "
                                  f"{listing(unknown)}")
        return found

    def _array(self, keys: tuple[str, ...], where: tuple):
        """Slab ``where`` of array ``keys``: read alone where chunks are per layer (and expert), else from the whole
        array, read once and kept while its slabs are read."""
        if not where:
            return self.tree.read(keys)
        chunk = self.tree.chunk(keys)
        if all(chunk[i] == 1 for i, w in enumerate(where) if isinstance(w, int)):
            return self.tree.read(keys, where)
        if self._cache is None or self._cache[0] != keys:
            self._cache = None  # the previous array goes before this one is read
            self._cache = (keys, self.tree.read(keys))
        return self._cache[1][where]

    def _read(self, info: TensorInfo) -> torch.Tensor:
        import torch

        src = self._sources[info.name]
        if src[0] == "hf":
            t = to_torch(self.tree.read(src[1]))
            return t.T.contiguous() if src[2] else t
        _, keys, where, p, out = src
        slab = to_torch(self._array(keys, where))
        return mt.from_slab(p, slab, self.model, getattr(torch, out)).contiguous()

    def close(self) -> None:
        self._cache = None


def _slabs(p: mt.Param, shape: tuple[int, ...], layer: int | None = None):
    """(Hugging Face name, index in the array, slab shape) of every slab of a MaxText array of ``shape`` (``layer``:
    the one layer an unscanned array holds)."""
    if not p.scanned:
        yield p.hf, (), shape
        return
    if layer is not None:
        if p.expert:
            for e in range(shape[0]):
                yield p.hf.format(L=layer, E=e), (e,), tuple(shape[1:])
        else:
            yield p.hf.format(L=layer), (), shape
        return
    if p.expert:
        experts, layers, rest = shape[0], shape[1], tuple(shape[2:])
        for layer in range(layers):
            for e in range(experts):
                yield p.hf.format(L=layer, E=e), (e, layer), rest
        return
    layers = shape[1]
    slab = (shape[0], *shape[2:])
    for layer in range(layers):
        yield p.hf.format(L=layer), (slice(None), layer), slab


_ASSUMED = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}


def infer_config(found: dict[tuple[str, ...], tuple[mt.Param, int | None]],
                 tree: OrbaxTree) -> tuple[dict, list[str]]:
    """A Hugging Face config.json for a MaxText tree from its shapes, and what was assumed."""
    by_hf: dict[str, tuple[tuple[int, ...], str]] = {}  # template -> (one layer's shape, experts first; dtype)
    layers: set[int] = set()
    for keys, (p, layer) in found.items():
        shape, dtype = tree.shape_dtype(keys)
        if p.scanned and layer is None:
            layers.update(range(shape[1]))
            shape = (shape[0], *shape[2:])
        elif layer is not None:
            layers.add(layer)
        by_hf[p.hf] = (shape, dtype)
    vocab, hidden = by_hf["model.embed_tokens.weight"][0]
    _, heads, head_dim = by_hf["model.layers.{L}.self_attn.q_proj.weight"][0]
    k_shape, dtype = by_hf["model.layers.{L}.self_attn.k_proj.weight"]  # the query may be stored wider
    qwen = "model.layers.{L}.self_attn.q_norm.weight" in by_hf
    mixtral = "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight" in by_hf
    qwen_moe = "model.layers.{L}.mlp.experts.{E}.gate_proj.weight" in by_hf
    model_type = "mixtral" if mixtral else ("qwen3_moe" if qwen_moe else "qwen3") if qwen else "llama"
    config: dict[str, Any] = {
        "model_type": model_type, "architectures": [{"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                                                     "qwen3": "Qwen3ForCausalLM",
                                                     "qwen3_moe": "Qwen3MoeForCausalLM"}[model_type]],
        "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": len(layers), "num_attention_heads": heads,
        "num_key_value_heads": k_shape[1], "head_dim": head_dim, "hidden_act": "silu", "dtype": dtype,
        "tie_word_embeddings": "lm_head.weight" not in by_hf, **_ASSUMED}
    assumed = [f"{k} {v}" for k, v in _ASSUMED.items()] + ["no Llama 3.1 rotary scaling (q/k not interleaved)"]
    dense = by_hf.get("model.layers.{L}.mlp.gate_proj.weight")
    if dense:
        config["intermediate_size"] = dense[0][1]
    expert = by_hf.get("model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight") or \
        by_hf.get("model.layers.{L}.mlp.experts.{E}.gate_proj.weight")
    if expert:
        experts, _, inner = expert[0]
        if mixtral:
            config.update(num_local_experts=experts, intermediate_size=inner, num_experts_per_tok=2)
        else:
            config.update(num_experts=experts, moe_intermediate_size=inner, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1)
            config.setdefault("intermediate_size", inner)
        assumed.append(f"num_experts_per_tok {config['num_experts_per_tok']}")
    if not qwen:
        assumed.append("the query kernel scaled by head_dim**-0.5, as MaxText's converters store it")
    return config, [f"assumed {', '.join(assumed)} (MaxText keeps them in its YAML, not the checkpoint)"]

