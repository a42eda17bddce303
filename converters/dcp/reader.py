"""A torch.distributed.checkpoint directory seen with Hugging Face names, lazily.

Opening reads ``.metadata`` alone (``metadata.read_metadata``: names, shapes, dtypes, where each chunk lies);
``torch.distributed`` is never initialised. A tensor is assembled from its chunks when asked for, each chunk a
``torch.save`` read with ``weights_only=True``. torchtitan names are mapped to Hugging Face's (``names``): q/k
rows put back in Hugging Face's rotary order (llama3), stacked experts presented one per expert (the stack is
read once and kept while its experts are read in turn: memory stays the largest tensor).

Keys that are training state (optimizer moments, the learning-rate schedule, the data loader, the step: a
training run saves them beside the model's) are not weights: they are left out and said once on stderr, and where
the model is a subtree of the state dict (PyTorch's DCP tutorial's ``app.model.*``, an FSDP recipe's ``model.*``)
its keys are read without that prefix, said too (``subtree``).
Without a config.json beside ``.metadata`` (torchtitan keeps the model's arguments in its TOML, not in the
checkpoint), the config is the one ``ffn-tools --config FILE`` gives, else inferred from the shapes with what
could not be inferred assumed and said (``assumed``).
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ffn_tools import progress
from ffn_tools.errors import CheckpointError, listing
from ffn_tools.io.dtypes import itemsize, st_of_name
from ffn_tools.io.raw import RawTensor
from ffn_tools.io.store import Checkpoint, TensorInfo, config_beside, read_bytes, say_assumed

from ..native.layout import permute
from .metadata import METADATA, Chunk, Entry, read_metadata
from .names import BUFFERS, family_of, heads_of, to_hf
from .subtree import split
from .torchsave import Stored, locate

if TYPE_CHECKING:
    import torch

_TITAN = re.compile(r"^(?:tok_embeddings\.|layers\.\d+\.(?:attention|feed_forward|moe|attention_norm|ffn_norm)\.|"
                    r"norm\.weight$|output\.weight$|lm_head\.weight$)")


def root_of(path: Path) -> Path:
    """The directory of a DCP path (the directory, or its ``.metadata``)."""
    return path.parent if path.name == METADATA else path


def naming_of(keys: list[str]) -> tuple[str, str]:
    """(naming, prefix) of a checkpoint's weight keys: torchtitan's (at the top level, as torchtitan flattens
    its model's state dict, or under ``model.``) or Hugging Face's."""
    for prefix in ("", "model."):
        inner = [k.removeprefix(prefix) for k in keys if k.startswith(prefix)]
        if inner and sum(bool(_TITAN.match(k)) for k in inner) * 2 > len(inner):
            return "torchtitan", prefix
    return "hf", ""


class _Source:
    __slots__ = ("key", "expert", "heads")

    def __init__(self, key: str, expert: int | None = None, heads: int | None = None):
        self.key, self.expert, self.heads = key, expert, heads


class DcpCheckpoint(Checkpoint):
    """See the module docstring.

    Attributes:
        naming: "torchtitan" or "hf".
        family: the torchtitan family (``names.FAMILIES``), None for hf naming.
        prefix: the model's subtree in the state dict ("" at the top), its keys read without it.
        training_state: the keys left out (optimizer, scheduler, ...).
        assumed: what the config took without reading it (empty where config.json or --config gave it).
    """

    kind, described = "dcp", "a torch.distributed.checkpoint"

    def __init__(self, path: Path):
        root = root_of(path)
        if not (root / METADATA).is_file():
            raise CheckpointError(f"{root}: no {METADATA}; a torch.distributed.checkpoint directory has one")
        self.entries = read_metadata(root)
        parts = split(self.entries)
        self.naming, under = naming_of([k[len(parts.prefix):] for k in parts.weights if not BUFFERS.search(k)])
        self.prefix = prefix = parts.prefix + under
        weights = parts.weights
        config, self.assumed = config_beside(root), list[str]()
        self.family = family_of(config, [k.removeprefix(prefix) for k in weights]) if self.naming == "torchtitan" \
            else None
        if self.family:  # a model's buffers are weights where its family maps them (DeepSeek's router bias)
            buffers = {k for k in weights if BUFFERS.search(k) and not to_hf(k.removeprefix(prefix), self.family)}
            tables = sorted(k for k in buffers if k.endswith("freqs_cis"))
            if tables:  # every torchtitan step saves it; transformers computes its own from the config
                parts.left_out["the rotary table (freqs_cis: transformers computes its own from the config)"] = tables
            if moe := sorted(buffers.difference(tables)):
                parts.left_out[f"MoE load-balancing buffers of no Hugging Face name in torchtitan's {self.family}"] = moe
            weights = [k for k in weights if k not in buffers]
        kept = set(weights)
        self.training_state = [k for k in self.entries if k not in kept]
        self._sources: dict[str, _Source] = {}
        self._stored: dict[Chunk, Stored | None] = {}
        self._handles: dict[Path, BinaryIO] = {}
        infos: dict[str, TensorInfo] = {}
        files = sorted({c.file for e in self.entries.values() for c in e.chunks}, key=lambda f: f.name)
        if self.family is None:
            for k in weights:
                e, name = self.entries[k], k.removeprefix(prefix)
                infos[name] = TensorInfo(name, st_of_name(e.dtype), e.shape, e.chunks[0].file, self._start(e))
                self._sources[name] = _Source(k)
        else:
            inner = {k.removeprefix(prefix): k for k in weights}
            found = {short: to_hf(short, self.family) for short in inner}
            unknown = [short for short, f in found.items() if f is None]
            if unknown:
                raise CheckpointError(f"{root}: {len(unknown)} key(s) of no torchtitan {self.family} name: "
                                      f"{listing(unknown)}; a model with other names reads with its keys as they are "
                                      "only if they are Hugging Face names")
            mapped: list[tuple[str, str, int | None, str | None]] = []  # (hf name, key, expert, rotary)
            for short, (spec, where) in ((s, f) for s, f in found.items() if f is not None):
                key = inner[short]
                if spec.stacked:
                    mapped += [(spec.hf.format(L=where["L"], E=x), key, x, None)
                               for x in range(self.entries[key].shape[0])]
                else:
                    mapped.append((spec.hf.format(**where), key, None, spec.rotary))
            shapes = {n: self.entries[k].shape[1:] if x is not None else self.entries[k].shape for n, k, x, _ in mapped}
            if config is None:
                config, self.assumed = infer_config(self.family, shapes, self.entries[mapped[0][1]].dtype)
            heads = heads_of(config)
            for name, key, x, rotary in mapped:
                h = heads.get(rotary) if rotary else None
                if rotary and not isinstance(h, int):
                    raise CheckpointError(f"{root}: {key} needs the number of heads to put its rows in Hugging "
                                          "Face's rotary order; give a config.json with ffn-tools --config FILE")
                e = self.entries[key]
                start = None if rotary else self._start(e)
                if start is not None and x is not None:
                    start += x * math.prod(shapes[name]) * itemsize(st_of_name(e.dtype))  # expert x's rows of the stack
                infos[name] = TensorInfo(name, st_of_name(e.dtype), shapes[name], e.chunks[0].file, start)
                self._sources[name] = _Source(key, expert=x, heads=h)
        if not infos:
            self.close()
            raise CheckpointError(f"{root}: no weights in this torch.distributed.checkpoint "
                                  f"({len(self.training_state)} training-state keys only)")
        super().__init__(path, root, files, infos, {"format": "pt"}, config)
        self._stack: tuple[str, torch.Tensor] | None = None
        if self.prefix:
            progress.say(f"{root}: the model is the subtree {self.prefix}* (its keys read without that prefix)")
        if self.training_state:
            progress.say(f"{root}: {len(self.training_state)} training-state key(s) not read as weights, left out: "
                         f"{parts.described()}")
        unbiased = [n for n in infos if n.endswith(".mlp.gate.weight") and self.family == "deepseek_v3"
                    and n.replace(".weight", ".e_score_correction_bias") not in infos]
        if unbiased:  # torchtitan registers the buffer only where load balancing is on (load_balance_coeff)
            progress.say(f"{root}: {len(unbiased)} MoE layer(s) have no router bias here (torchtitan's moe.expert_bias_E:"
                         " load balancing off), so no e_score_correction_bias is written for them; transformers starts"
                         " it at zeros, which routes as torchtitan did without one")
        say_assumed(root, self.assumed)

    def _locate(self, c: Chunk, dtype: str | None) -> Stored | None:
        """Where chunk ``c``'s bytes lie as the tensor, C-order (``torchsave.locate``), found once."""
        if c not in self._stored:
            f = self._handles.get(c.file)
            if f is None:  # a rank's file holds every chunk of that rank: opened once
                f = self._handles[c.file] = open(c.file, "rb")  # noqa: SIM115 - closed in close()
            self._stored[c] = locate(f, c.start, c.length, itemsize(st_of_name(dtype)), c.sizes)
        return self._stored[c]

    def _start(self, e: Entry) -> int | None:
        """The offset of tensor ``e``'s bytes in its file where one chunk holds all of it as stored: then they are
        read with pread and copied by conversions as they are."""
        if len(e.chunks) != 1 or tuple(e.chunks[0].sizes) != e.shape:
            return None
        stored = self._locate(e.chunks[0], e.dtype)
        return stored.start if stored else None

    def _load_chunk(self, c: Chunk, key: str, dtype: str | None) -> torch.Tensor:
        """Chunk ``c`` of ``key``: its bytes read as they lie where ``locate`` finds them, else torch.load."""
        stored = self._locate(c, dtype)
        if stored is None:
            return _load_chunk(c, key)
        return RawTensor(st_of_name(dtype), c.sizes, read_bytes(c.file, stored.start, stored.nbytes)).to_torch()

    def _whole(self, key: str) -> torch.Tensor:
        """Tensor ``key`` assembled from its chunks."""
        import torch

        e: Entry = self.entries[key]
        if len(e.chunks) == 1 and tuple(e.chunks[0].sizes) == e.shape:
            return self._load_chunk(e.chunks[0], key, e.dtype)
        out = torch.empty(e.shape, dtype=getattr(torch, str(e.dtype)))
        covered = 0
        for c in e.chunks:
            piece = self._load_chunk(c, key, e.dtype)
            view = out
            for dim, (o, n) in enumerate(zip(c.offsets, c.sizes)):
                view = view.narrow(dim, o, n)
            view.copy_(piece)
            covered += piece.numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.root}: the chunks of {key} cover {covered} of its {out.numel()} elements")
        return out

    def _read(self, info: TensorInfo) -> torch.Tensor:
        src = self._sources[info.name]
        if src.expert is None:
            t = self._whole(src.key)
            return permute(t, src.heads) if src.heads else t
        if self._stack is None or self._stack[0] != src.key:
            self._stack = None  # the previous stack goes before this one is read
            self._stack = (src.key, self._whole(src.key))
        return self._stack[1][src.expert]

    def close(self) -> None:
        self._stack = None
        for f in self._handles.values():
            f.close()
        self._handles.clear()


def _load_chunk(c: Chunk, key: str) -> torch.Tensor:
    import torch

    with open(c.file, "rb") as f:
        f.seek(c.start)
        data = f.read(c.length)
    if len(data) != c.length:
        raise CheckpointError(f"{c.file}: ends before {key}'s chunk at {list(c.offsets)} (byte {c.start})")
    try:
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged chunk, whatever torch.load says
        raise CheckpointError(f"{c.file}: {key}'s chunk at {list(c.offsets)} does not load ({e})") from None
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(c.sizes):
        raise CheckpointError(f"{c.file}: {key}'s chunk at {list(c.offsets)} holds "
                              f"{getattr(t, 'shape', type(t).__name__)}, the metadata says {list(c.sizes)}")
    return t


# torchtitan's defaults for what the shapes do not say (its llama3 and qwen3 model args)
_ASSUMED = {"llama3": {"head_dim": 128, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
            "qwen3": {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "num_experts_per_tok": 8}}


def infer_config(family: str, shapes: dict[str, tuple[int, ...]], dtype: str | None) -> tuple[dict, list[str]]:
    """A Hugging Face config.json for a torchtitan checkpoint from its tensors' shapes (by Hugging Face name), and
    what was assumed (what shapes do not say: torchtitan's defaults for the family).

    Raises:
        CheckpointError: a family whose config is not inferred here (DeepSeek-V3's MLA sizes).
    """
    if family not in _ASSUMED:
        raise CheckpointError(f"a torchtitan {family} checkpoint without a config.json: give the model's with "
                              "ffn-tools --config FILE (its attention's sizes are not inferred here)")
    layer = "model.layers.0."
    vocab, dim = shapes["model.embed_tokens.weight"]
    layers = 1 + max(int(m[1]) for k in shapes if (m := re.match(r"model\.layers\.(\d+)\.", k)))
    defaults = _ASSUMED[family]
    q, k = shapes[layer + "self_attn.q_proj.weight"][0], shapes[layer + "self_attn.k_proj.weight"][0]
    q_norm = shapes.get(layer + "self_attn.q_norm.weight")
    head_dim = q_norm[0] if q_norm else defaults["head_dim"]
    assumed = [] if q_norm else [f"head_dim {head_dim}"]
    config: dict[str, Any] = {"hidden_size": dim, "vocab_size": vocab, "num_hidden_layers": layers,
                              "head_dim": head_dim,
              "num_attention_heads": q // head_dim, "num_key_value_heads": k // head_dim, "hidden_act": "silu",
              "tie_word_embeddings": "lm_head.weight" not in shapes, "dtype": dtype}
    for key in ("rope_theta", "rms_norm_eps"):
        config[key] = defaults[key]
        assumed.append(f"{key} {defaults[key]}")
    dense = next((s for n, s in shapes.items() if n.endswith("mlp.gate_proj.weight")), None)
    experts = sorted({int(m[1]) for n in shapes if (m := re.match(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.", n))})
    if dense:
        config["intermediate_size"] = dense[0]
    if family == "llama3":
        config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    elif experts:
        moe = next(s for n, s in shapes.items() if n.endswith("experts.0.gate_proj.weight"))
        config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=len(experts),
                      moe_intermediate_size=moe[0], num_experts_per_tok=defaults["num_experts_per_tok"],
                      norm_topk_prob=True, decoder_sparse_step=1)
        config.setdefault("intermediate_size", moe[0])
        assumed += [f"num_experts_per_tok {defaults['num_experts_per_tok']}", "norm_topk_prob true"]
    else:
        config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    return config, [f"assumed {', '.join(assumed)} (torchtitan's {family} defaults)"]
