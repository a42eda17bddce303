"""Orbax export as a plan: one ``Entry`` per array (hf layout) or per slab of a scanned array (maxtext layout), run
by ``plan.execute`` with ``OrbaxArrayWriter``, which creates each array when its first slab comes and writes every
slab into its place: one Hugging Face tensor in memory at a time, whatever the number of layers.

Entries are named ``ARRAY`` or ``ARRAY[L]`` / ``ARRAY[E,L]`` (the array's key path joined with ``/``), so
``--dry-run`` lists where every tensor goes. All moves are exact; the one computation, MaxText's query scaling, is
inverted exactly on read (``maxtext.query_dtype``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ffn_tools.errors import FFNToolsError, listing
from ffn_tools.io.dtypes import as_st, short_name, torch_dtype
from ffn_tools.io.store import Checkpoint
from ffn_tools.io.writer import OutTensor, Writer, produced_tensor
from ffn_tools.ops import Cast, Copy
from ffn_tools.plan import Entry, Plan, dequantized_line, unquantized_config

from ..flax.export import hf_entry, linen
from . import maxtext as mt
from .store import OrbaxWriter

LAYOUTS = ("hf", "maxtext", "nnx")

if TYPE_CHECKING:
    import torch

    from ffn_tools.progress import Progress


@dataclass(frozen=True)
class Array:
    """One array of the output: key path, shape, dtype (safetensors string), chunk shape."""

    keys: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]


def _name(keys: tuple[str, ...], where: tuple) -> str:
    if not where:
        return "/".join(keys)
    return "/".join(keys) + f"[{','.join(str(w) for w in where if isinstance(w, int))}]"


def _hf(ckpt: Checkpoint, dtype) -> tuple[list[Entry], dict[str, tuple[Array, tuple]]]:
    entries, slots = [], {}
    for n in ckpt:
        e, path = hf_entry(ckpt, n, dtype)
        entries.append(e)
        slots[e.name] = (Array(path, tuple(e.shape), e.st_dtype, tuple(e.shape)), ())
    return entries, slots


def _nnx(ckpt: Checkpoint, dtype, scheme, layout) -> tuple[list[Entry], dict[str, tuple[Array, tuple]], dict]:
    """The linen layout's FFN trees as NNX states: ``layers_{L}/{gate,up,down}/{kernel,bias}/value``."""
    entries, paths, config = linen(ckpt, dtype, scheme, layout)
    slots = {e.name: (Array((*p[1:], "value"), tuple(e.shape), e.st_dtype, tuple(e.shape)), ())
             for e, p in zip(entries, paths)}
    return entries, slots, config


def _maxtext(ckpt: Checkpoint, dtype) -> tuple[list[Entry], dict[str, tuple[Array, tuple]]]:
    config = ckpt.config or {}
    if config.get("model_type") not in mt.MODEL_TYPES:
        raise FFNToolsError(f"{ckpt.path}: MaxText's tree is known here for model types {', '.join(mt.MODEL_TYPES)}; "
                            f"this is {config.get('model_type')!r}: write --orbax-layout hf")
    model = mt.Model.of(config)
    placed, unknown = [], []
    for n in ckpt:
        found = mt.find(n)
        (placed.append((n, *found)) if found else unknown.append(n))
    if unknown:
        raise FFNToolsError(f"{ckpt.path}: {len(unknown)} tensor(s) have no place in MaxText's tree: "
                            f"{listing(unknown)}; write --orbax-layout hf")
    layers = 1 + max((layer for _, _, layer, _ in placed if layer is not None), default=-1)
    experts: dict[tuple[str, ...], int] = {}
    for _, p, _, e in placed:
        if e is not None:
            keys = mt.array_path(p, model.model_type)
            experts[keys] = max(experts.get(keys, 0), e + 1)
    entries, slots = [], {}
    for n, p, layer, e in placed:
        info = ckpt.info(n)
        src = info.dtype
        out = dtype if dtype is not None and src.is_floating_point else src
        store = mt.query_dtype(model, out) if p.kind == "query" else out
        slab = mt.slab_shape(p, info.shape, model)
        keys = (*mt.ROOT, *mt.array_path(p, model.model_type))
        shape = mt.stacked_shape(slab, layers if p.scanned else None, experts.get(keys[2:]) if p.expert else None)
        chunks = ((1, 1, *slab) if p.expert else (slab[0], 1, *slab[1:])) if p.scanned else shape
        where = mt.index(layer, e)

        how = {"as_is": "as it is", "T": "transposed"}.get(p.kind, "transposed, heads split")
        if p.kind == "query" and model.scale_query:
            how += f", scaled by head_dim**-0.5 ({short_name(store)})"
        if model.interleaves(p):
            how += ", rotary pairs interleaved"
        name = _name(keys, where)
        made = ((Cast(as_st(out), info.st_dtype),) if out != src else ()) + mt.slab_ops(p, tuple(info.shape), out, model)
        entries.append(Entry(name, store, slab, (n,), made or (Copy(),), sources=((info.st_dtype, tuple(info.shape)),),
                             text=f"{n}, {how}"))
        slots[name] = (Array(keys, shape, as_st(store), chunks), where)
    return entries, slots


def build_plan(ckpt: Checkpoint, layout: str, dtype: torch.dtype | None, scheme=None,
               gate_up_layout=None) -> tuple[Plan, OrbaxArrayWriter]:
    """The plan of an Orbax export and its writer.

    Raises:
        FFNToolsError: unknown layout; for maxtext, a model type or tensors MaxText's tree has no place for.
    """
    if layout not in LAYOUTS:
        raise FFNToolsError(f"unknown Orbax layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    config: dict | None
    if layout == "nnx":
        entries, slots, config = _nnx(ckpt, dtype, scheme, gate_up_layout)
    else:
        entries, slots = (_hf if layout == "hf" else _maxtext)(ckpt, dtype)
        config, _ = unquantized_config(ckpt.config, dtype)
    plan = Plan(ckpt, entries, config, summary={"layout": layout})
    if layout == "nnx":
        ffns = len({e.name.split("/")[1] for e in entries})
        plan.changes = [f"layout nnx: {ffns} FFNs as NNX states of a gate/up/down nnx.Linear module "
                        "(layers_{L}[_experts_{E}|_shared_expert]/{gate,up,down}/{kernel,bias}/value, "
                        "kernels (in, out)); other tensors not written"]
    elif layout == "hf":
        plan.changes = ["layout hf: the Hugging Face Flax tree (kernel = W.T, embeddings as embedding), one array "
                        "a leaf"]
    else:
        model = mt.Model.of(ckpt.config or {})
        arrays = len({a.keys for a, _ in slots.values()})
        line = (f"layout maxtext: {arrays} arrays under params/params, layers stacked on axis 1 (experts on axis 0), "
                "kernels (in, out), chunked by layer")
        if model.scale_query:
            line += "; query kernels scaled by head_dim**-0.5 as MaxText's converters do" + (
                "" if model.exact_scale() else " (stored wider: the scaling is not exact in the weights' dtype)")
        if model.interleaved:
            line += "; q/k rotary pairs interleaved (Llama 3.1's rotary in MaxText)"
        plan.changes = [line]
    plan.changes += dequantized_line(plan, "Orbax")
    return plan, OrbaxArrayWriter(slots)


class OrbaxArrayWriter(Writer):
    """``plan.execute``'s writer for Orbax: see the module docstring. ``slots``: entry name -> (its array, where)."""

    suffix = "\0"  # an Orbax checkpoint is a directory
    resumable = False  # written as one store, not as shards a resume ledger can keep (--resume refused)

    def output_bytes(self, items, *, max_shard_size, metadata, single):
        """Not known before writing (this store's own layout): ``--dry-run`` scales its sample's bytes."""
        return None

    def __init__(self, slots: dict[str, tuple[Array, tuple]]):
        self.slots = slots

    def write_file(self, path: Path, items: Sequence[OutTensor], metadata: dict | None,
                   progress: Progress | None = None) -> None:
        raise RuntimeError("internal error: an Orbax checkpoint is a directory")

    def write_sharded(self, out_dir: Path, items: Sequence[OutTensor], *, max_shard_size: int | None,
                      metadata: dict | None, progress: Progress | None = None, ledger=None) -> list[str]:
        writer = OrbaxWriter(out_dir)
        opened: dict[tuple[str, ...], Any] = {}
        pending: tuple[Any, OutTensor] | None = None  # one write in flight while the next tensor is made
        for t in items:
            array, where = self.slots[t.name]
            store = opened.get(array.keys)
            if store is None:
                store = opened[array.keys] = writer.create(array.keys, array.shape, _numpy_dtype(array.dtype),
                                                           array.chunks)
            data = to_numpy(produced_tensor(t))
            if pending is not None:
                _done(*pending, progress)
            pending = ((store[where] if where else store).write(data), t)
        if pending is not None:
            _done(*pending, progress)
        return writer.finish()


def _done(future, t: OutTensor, progress: Progress | None) -> None:
    future.result()  # raises the write's error
    if progress:
        progress.update(t.progress_bytes)


def _numpy_dtype(st: str):
    import ml_dtypes
    import numpy as np

    return ml_dtypes.bfloat16 if st == "BF16" else np.dtype(str(torch_dtype(st)).removeprefix("torch."))


def to_numpy(t: torch.Tensor):
    """A torch tensor as a numpy array of the same bits (bfloat16 as ml_dtypes')."""
    import ml_dtypes
    import torch

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()
