"""MaxText's decoder tree, as data: which array holds each Hugging Face tensor, where in it, and how it is turned.

MaxText (``scan_layers: true``, its default) stacks every per-layer parameter on axis 1 (``param_scan_axis``), so
one array holds a parameter of all layers; routed experts are stacked on axis 0 before it. Its converters save the
tree under ``params/params`` (``TrainState(params={"params": ...})``) in a CheckpointManager step (``<out>/0/items``).
Names and shapes (L layers, X experts; kernels are (in, out)):

    params/token_embedder/embedding                              (vocab, H)           embed_tokens as it is
    params/decoder/logits_dense/kernel                           (H, vocab)           lm_head.T (absent: tied)
    params/decoder/decoder_norm/scale                            (H,)                 model.norm
    params/decoder/layers/pre_self_attention_layer_norm/scale    (H, L)               input_layernorm
    params/decoder/layers/post_self_attention_layer_norm/scale   (H, L)               post_attention_layernorm
    params/decoder/layers/self_attention/query/kernel            (H, L, heads, hd)    q_proj.T, times hd**-0.5
    params/decoder/layers/self_attention/{key,value}/kernel      (H, L, kv_heads, hd) k_proj.T, v_proj.T
    params/decoder/layers/self_attention/out/kernel              (heads, L, hd, H)    o_proj.T
    params/decoder/layers/self_attention/{query,key}_norm/scale  (hd, L)              Qwen3's q_norm, k_norm
    params/decoder/layers/mlp/{wi_0,wi_1}/kernel                 (H, L, I)            gate_proj.T, up_proj.T
    params/decoder/layers/mlp/wo/kernel                          (I, L, H)            down_proj.T
    params/decoder/layers/{MOE}/gate/kernel                      (H, L, X)            the router's weight.T
    params/decoder/layers/{MOE}/{wi_0,wi_1,wo}                   (X, L, H, I), (X, L, I, H)  each expert's .T

``{MOE}`` is ``MoeBlock_0`` (Mixtral) or ``moe_block`` (Qwen3-MoE). As MaxText's own converter
(``checkpoint_conversion/utils/param_mapping.py``) does: the query kernel is scaled by ``head_dim**-0.5`` (MaxText's
attention does not scale; not with Qwen3's qk-norm), computed in float32 and kept there where the scaling is not
exact in the weights' dtype (then the read back divides and rounds once: the source's bits again); Llama 3.1's
rotary (``rope_scaling`` of type llama3) pairs interleaved halves, so q and k are permuted into that order.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ffn_tools.io.dtypes import as_st
from ffn_tools.ops import Cast, Op, Permute, Reshape, Transpose

if TYPE_CHECKING:
    import torch

ROOT = ("params", "params")  # where MaxText's converters put the tree (read without the second "params" too)
MOE_BLOCKS = {"mixtral": "MoeBlock_0", "qwen3_moe": "moe_block"}
MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Param:
    """One Hugging Face tensor (per layer where ``hf`` has ``{L}``, per expert where ``{E}``) in MaxText's tree.

    Attributes:
        hf: the Hugging Face name.
        path: the MaxText array's key path below ``ROOT`` (``{MOE}`` the MoE block's name).
        kind: how it is turned: "as_is", "T" (a 2-D transpose), "heads_in" (W.T with its out dimension split into
            heads: q, k, v), "heads_out" (o_proj.T with its in dimension split), "query" (heads_in, scaled, rotary).
        heads: "q" or "k" for heads_in/heads_out: which head count splits it.
    """

    hf: str
    path: tuple[str, ...]
    kind: str
    heads: str | None = None

    @property
    def scanned(self) -> bool:
        return "{L}" in self.hf

    @property
    def expert(self) -> bool:
        return "{E}" in self.hf

    def pattern(self) -> re.Pattern:
        return re.compile(re.escape(self.hf).replace(re.escape("{L}"), r"(?P<L>\d+)").replace(
            re.escape("{E}"), r"(?P<E>\d+)"))


_L = "model.layers.{L}"
_D = ("decoder", "layers")
PARAMS = (
    Param("model.embed_tokens.weight", ("token_embedder", "embedding"), "as_is"),
    Param("lm_head.weight", ("decoder", "logits_dense", "kernel"), "T"),
    Param("model.norm.weight", ("decoder", "decoder_norm", "scale"), "as_is"),
    Param(f"{_L}.input_layernorm.weight", (*_D, "pre_self_attention_layer_norm", "scale"), "as_is"),
    Param(f"{_L}.post_attention_layernorm.weight", (*_D, "post_self_attention_layer_norm", "scale"), "as_is"),
    Param(f"{_L}.self_attn.q_proj.weight", (*_D, "self_attention", "query", "kernel"), "query", "q"),
    Param(f"{_L}.self_attn.k_proj.weight", (*_D, "self_attention", "key", "kernel"), "heads_in", "k"),
    Param(f"{_L}.self_attn.v_proj.weight", (*_D, "self_attention", "value", "kernel"), "heads_in", "k"),
    Param(f"{_L}.self_attn.o_proj.weight", (*_D, "self_attention", "out", "kernel"), "heads_out", "q"),
    Param(f"{_L}.self_attn.q_norm.weight", (*_D, "self_attention", "query_norm", "scale"), "as_is"),
    Param(f"{_L}.self_attn.k_norm.weight", (*_D, "self_attention", "key_norm", "scale"), "as_is"),
    Param(f"{_L}.mlp.gate_proj.weight", (*_D, "mlp", "wi_0", "kernel"), "T"),
    Param(f"{_L}.mlp.up_proj.weight", (*_D, "mlp", "wi_1", "kernel"), "T"),
    Param(f"{_L}.mlp.down_proj.weight", (*_D, "mlp", "wo", "kernel"), "T"),
    # Mixtral's names (block_sparse_moe, w1/w3/w2) and Qwen3-MoE's (mlp, gate/up/down_proj)
    Param(f"{_L}.block_sparse_moe.gate.weight", (*_D, "{MOE}", "gate", "kernel"), "T"),
    Param(f"{_L}.block_sparse_moe.experts.{{E}}.w1.weight", (*_D, "{MOE}", "wi_0"), "T"),
    Param(f"{_L}.block_sparse_moe.experts.{{E}}.w3.weight", (*_D, "{MOE}", "wi_1"), "T"),
    Param(f"{_L}.block_sparse_moe.experts.{{E}}.w2.weight", (*_D, "{MOE}", "wo"), "T"),
    Param(f"{_L}.mlp.gate.weight", (*_D, "{MOE}", "gate", "kernel"), "T"),
    Param(f"{_L}.mlp.experts.{{E}}.gate_proj.weight", (*_D, "{MOE}", "wi_0"), "T"),
    Param(f"{_L}.mlp.experts.{{E}}.up_proj.weight", (*_D, "{MOE}", "wi_1"), "T"),
    Param(f"{_L}.mlp.experts.{{E}}.down_proj.weight", (*_D, "{MOE}", "wo"), "T"),
)


@dataclass(frozen=True)
class Model:
    """What MaxText's tree of one model needs beyond names: its sizes and how its query is stored."""

    model_type: str
    heads: int
    kv_heads: int
    head_dim: int
    scale_query: bool  # no qk-norm: the query kernel carries head_dim**-0.5
    interleaved: bool  # Llama 3.1's rotary: q and k rows of each head in interleaved order

    @classmethod
    def of(cls, config: dict) -> Model:
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
        return cls(config["model_type"], heads, int(config.get("num_key_value_heads") or heads), head_dim,
                   config["model_type"] not in ("qwen3", "qwen3_moe"),
                   isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "llama3")

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def interleaves(self, p: Param) -> bool:
        """``p``'s rows are put in interleaved rotary order (q and k, under Llama 3.1's rotary)."""
        return self.interleaved and (p.kind == "query" or p.hf.endswith("k_proj.weight"))

    def exact_scale(self) -> bool:
        """head_dim**-0.5 is a power of two (head_dim a power of 4): scaling is exact in any float dtype."""
        return math.log2(self.head_dim) % 2 == 0


def array_path(p: Param, model_type: str) -> tuple[str, ...]:
    return tuple(k.replace("{MOE}", MOE_BLOCKS.get(model_type, "MoeBlock_0")) for k in p.path)


def find(name: str) -> tuple[Param, int | None, int | None] | None:
    """(param, layer, expert) of a Hugging Face name, or None where MaxText's tree has no place for it."""
    for p in PARAMS:
        m = p.pattern().fullmatch(name)
        if m:
            g = m.groupdict()
            return p, int(g["L"]) if "L" in g else None, int(g["E"]) if "E" in g else None
    return None


def rotary_order(rows: int, head_dim: int) -> tuple[int, ...]:
    """Row order of each head from halves order (Hugging Face) to interleaved pairs, as MaxText's ``adjust_rope``:
    output row i is input row order[i] (``Permute``)."""
    half = head_dim // 2
    return tuple(h * head_dim + p * half + j for h in range(rows // head_dim) for j in range(half) for p in range(2))


def _halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(rows // head_dim, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def query_dtype(model: Model, dtype: torch.dtype) -> torch.dtype:
    """The dtype the query kernel is stored in: the weights' where its scaling is exact there, else one wider."""
    import torch

    if not model.scale_query or (model.exact_scale() and dtype in (torch.bfloat16, torch.float32, torch.float64)):
        return dtype
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def scale_in(model: Model, dtype: torch.dtype) -> float:
    """head_dim**-0.5 as a number of ``dtype`` (float32's for float32: MaxText multiplies by
    ``np.float32(1 / np.sqrt(head_dim))``); dividing by the same number inverts the product up to one rounding of
    ``dtype``, far below one of the weights' narrower dtype."""
    import torch

    return float(torch.tensor(model.scale, dtype=torch.float64).to(dtype).to(torch.float64))


@dataclass(frozen=True)
class Scale(Op):
    """Each tensor times ``factor`` in its own dtype: MaxText's query scaling (the product its converter computes)."""

    factor: float

    def apply(self, ts: list) -> list:
        return [t * self.factor for t in ts]

    def describe(self) -> str:
        return f"scaled by {self.factor!r}"


def slab_ops(p: Param, shape: tuple[int, ...], dtype: torch.dtype, model: Model) -> tuple[Op, ...]:
    """The ops making Hugging Face tensor ``p`` (of ``shape``, in ``dtype``) its slab of MaxText's array: pure moves
    but for the query's scaling (``from_slab`` undoes them)."""
    if p.kind == "as_is":
        return ()
    if p.kind == "T":
        return (Transpose(),)
    heads = model.heads if p.heads == "q" else model.kv_heads
    rows, cols = shape
    if p.kind == "heads_out":  # o_proj (H, heads*hd) -> (heads, hd, H)
        return Transpose(), Reshape((heads, model.head_dim, rows), (cols, rows))
    ops: list[Op] = [Permute(rotary_order(rows, model.head_dim))] if model.interleaves(p) else []
    if p.kind == "query" and model.scale_query:
        wide = query_dtype(model, dtype)  # computed in the stored dtype, as MaxText's converter (float32)
        ops += [Cast(as_st(wide), as_st(dtype)), Scale(scale_in(model, wide))]
    return *ops, Transpose(), Reshape((cols, heads, model.head_dim), (cols, rows))


def from_slab(p: Param, s: torch.Tensor, model: Model, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``to_slab``: the Hugging Face tensor (in ``dtype``) of slab ``s``."""
    import torch

    if p.kind == "as_is":
        return s
    if p.kind == "T":
        return s.T.contiguous()
    if p.kind == "heads_out":
        heads, hd, h = s.shape
        return s.reshape(heads * hd, h).T.contiguous()
    h = s.shape[0]
    w = s.reshape(h, -1).T.contiguous()
    if p.kind == "query" and model.scale_query:
        w = (w.to(torch.float64) / scale_in(model, s.dtype)).to(dtype)
    if model.interleaves(p):
        w = _halves(w, model.head_dim)
    return w.contiguous()


def slab_shape(p: Param, shape: tuple[int, ...], model: Model) -> tuple[int, ...]:
    """The slab's shape of a Hugging Face tensor of ``shape``."""
    if p.kind == "as_is":
        return shape
    if p.kind == "T":
        return shape[::-1]
    if p.kind == "heads_out":
        return (model.heads, model.head_dim, shape[0])
    return (shape[1], model.heads if p.heads == "q" else model.kv_heads, model.head_dim)


def hf_shape(p: Param, slab: tuple[int, ...]) -> tuple[int, ...]:
    """The inverse of ``slab_shape``."""
    if p.kind == "as_is":
        return slab
    if p.kind == "T":
        return slab[::-1]
    if p.kind == "heads_out":
        return (slab[2], slab[0] * slab[1])
    return (slab[1] * slab[2], slab[0])


def stacked_shape(slab: tuple[int, ...], layers: int | None, experts: int | None) -> tuple[int, ...]:
    """The MaxText array's shape: layers at axis 1 (after the experts' axis 0), none for unscanned."""
    if layers is None:
        return slab
    if experts is not None:
        return (experts, layers, *slab)
    return (slab[0], layers, *slab[1:])


def index(layer: int | None, expert: int | None) -> tuple:
    """Where a slab sits in its array."""
    if layer is None:
        return ()
    return (expert, layer) if expert is not None else (slice(None), layer)
