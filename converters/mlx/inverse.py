"""An MLX model's tensors traced back to the Hugging Face tensors they were made from: the export run backwards.

1. The source's tensors (names and shapes) are what transformers saves for the source's config: its model built
   on the meta device (nothing allocated) and its state dict put through ``save_pretrained``'s own steps
   (``_keys_to_ignore_on_save``, tied weights removed, the v5 conversion mapping reverted).
2. The export's own function maps them (``matching.match``: mlx_lm's model class, the view of the input that
   fits it, the model's ``sanitize`` on stand-ins), so each MLX tensor is known as a rename of one source
   tensor, a stack of several (experts), or computed.
3. Renames invert by name and stacks by slicing, byte for byte. Computed tensors are traced element by element
   (``probe``): where sanitize only moved data and added constants (DeepSeek-V3's ``embed_q``/``unembed_out``
   from ``kv_b_proj``, conv weights turned, Qwen3-Next's norms ``+ 1.0``, DBRX's flat experts), the source
   tensors are gathered back; the MLX tensors sharing sources are inverted together, and only when they hold
   every element of them.

What cannot be inverted keeps its MLX name (``refused`` says why): an output sanitize computes otherwise (a
dequantized FP8 weight, a folded multiplier), one the MLX model lacks or stores in another shape, the outputs
of a source tensor they hold only part of. Source tensors no MLX tensor comes from (``dropped``: a tied head,
an MTP layer, a router bias mlx_lm drops) are not presented. An offset is undone in the stored dtype; it is exact
where ``x + c`` was, else the view says which tensors rounded (``probe.unoffset``).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ffn_tools.errors import CheckpointError, FFNToolsError
from ffn_tools.io.store import Checkpoint, TensorInfo

from .probe import Probe, Trace, plain

log = logging.getLogger(__name__)

SAVED_AS = "ffn_tools_source_saved_as"  # safetensors metadata: how the source's tensors were named (``saved_as``)
MODULE_NAMES = "module-names"  # transformers' own module names (``save_pretrained(save_original_format=False)``)
ORIGINAL = "original"  # ``save_pretrained``'s default format (experts per expert)
LAYOUT_DTYPE = "F32"  # the stand-in dtype of the source layout (its bytes are never read)
TRACE_BUDGET = 256 << 20  # bytes of traces kept from planning; beyond it a read traces its outputs again


@dataclass(frozen=True)
class Source:
    """Where one Hugging Face tensor of the view is read from.

    Attributes:
        name: the Hugging Face name.
        kind: "rename" (one MLX tensor, as it is), "stack" (slice ``expert`` of one MLX tensor) or "gathered"
            (elements of the MLX tensors ``outputs``, constants removed where ``offset``).
        outputs: the MLX tensors read.
    """

    name: str
    kind: str
    outputs: tuple[str, ...]
    expert: int | None = None
    offset: bool = False


@dataclass
class Inverse:
    """The MLX model's tensors as Hugging Face tensors (see the module doc)."""

    sources: dict[str, Source] = field(default_factory=dict)  # Hugging Face name -> source, in the source's order
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the source's tensors
    covered: set[str] = field(default_factory=set)  # MLX tensors the sources read (not presented by name)
    dropped: list[str] = field(default_factory=list)  # source tensors no MLX tensor comes from
    refused: dict[str, str] = field(default_factory=dict)  # MLX tensor -> why it keeps its MLX name
    skipped: str | None = None  # why nothing is inverted
    probe: Probe | None = None
    traces: dict[str, Trace | None] = field(default_factory=dict)  # MLX tensor -> trace (None: not kept)

    def trace(self, output: str) -> Trace:
        t = self.traces.get(output)
        if t is None:
            if self.probe is None:
                raise CheckpointError(f"{output}: not traced")
            t = self.probe.trace(output)
        return t


class _Layout(Checkpoint):
    """The source's tensor names and shapes, without data: what ``matching.match`` plans from."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], config: dict, root: Path):
        infos = {n: TensorInfo(n, LAYOUT_DTYPE, s, root / "config.json") for n, s in shapes.items()}
        super().__init__(root, root, [], infos, {}, config)

    def _read(self, info: TensorInfo):
        raise CheckpointError(f"{info.name}: the source layout has no data")


def source_layout(config: dict, original: bool = True) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) transformers' ``save_pretrained`` writes for a model of ``config``: in the
    original format, its default (per-expert ``experts.{e}.gate_proj.weight`` where transformers 5 stacks them),
    or with ``original`` False as ``save_original_format=False`` writes them, the model's own names
    (``experts.gate_up_proj`` (E, 2I, H)).

    Raises:
        FFNToolsError: transformers is not installed or cannot build the model.
    """
    try:
        import torch
        import transformers
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError as e:
        raise FFNToolsError(f"transformers is not installed ({e.name})") from None
    verbosity = transformers.logging.get_verbosity()
    try:
        transformers.logging.set_verbosity_error()
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Path(d, "config.json").write_text(json.dumps(config))  # transformers' own reading (Infinity, nesting)
            cfg = transformers.AutoConfig.from_pretrained(d)
            cls = next((getattr(transformers, a) for a in config.get("architectures") or ()
                        if isinstance(a, str) and hasattr(transformers, a)), None)
            with torch.device("meta"):
                model = cls(cfg) if cls is not None else transformers.AutoModelForCausalLM.from_config(cfg)
            state = model.state_dict()
            for k in model._keys_to_ignore_on_save or ():
                state.pop(k, None)
            state = remove_tied_weights_from_state_dict(state, model)
            if original:
                state = revert_weight_conversion(model, state)
    except Exception as e:  # noqa: BLE001 - transformers' own failure on this config, any type
        raise FFNToolsError(f"transformers cannot build {config.get('model_type')!r} ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    return {k: tuple(v.shape) for k, v in state.items()}


def saved_as(ckpt: Checkpoint) -> dict[str, str]:
    """What an MLX export of ``ckpt`` records in its safetensors metadata so that reading it back names the experts
    as ``ckpt`` does (``SAVED_AS``): ``MODULE_NAMES`` where its stacked experts are under transformers' own module
    names (``experts.gate_up_proj``, as transformers 5 saves with ``save_original_format=False``) and none of its
    tensors under names only the original format has, else ``ORIGINAL`` (``save_pretrained``'s default: per
    expert); nothing for a checkpoint without routed experts or whose model transformers cannot build (read back
    in the original format). Only a checkpoint with routed experts builds transformers' model to tell."""
    from ffn_tools.detect import find_ffns

    if not ckpt.config:
        return {}
    try:
        if all(f.ref.kind != "expert" for f in find_ffns(ckpt).ffns):
            return {}
        original, own = source_layout(ckpt.config), source_layout(ckpt.config, original=False)
    except FFNToolsError:
        return {}
    names = set(ckpt)
    module_names = bool(names & (own.keys() - original.keys())) and not names & (original.keys() - own.keys())
    return {SAVED_AS: MODULE_NAMES if module_names else ORIGINAL}


def saved_as_line(metadata: Mapping[str, str]) -> str:
    """The changes line of reading an MLX model back: the names its experts get, and why (``SAVED_AS``)."""
    how = metadata.get(SAVED_AS)
    if how == MODULE_NAMES:
        return ("experts read back stacked under transformers' own module names (experts.gate_up_proj, "
                "experts.down_proj), as the source was saved (recorded by the MLX export)")
    why = "as the source was saved (recorded by the MLX export)" if how == ORIGINAL else \
        "save_pretrained's default: the MLX model records no other"
    return f"experts read back per expert in transformers' original format (experts.N.gate_proj.weight ...), {why}"


def layout_of(like: Checkpoint | None, config: dict) -> dict[str, tuple[int, ...]] | None:
    """``like``'s tensors (name -> shape) where they may be the source's layout: an unquantized PyTorch
    checkpoint of the same model type and architecture, every shard here; else None."""
    if like is None or like.format is None or like.format.name != "torch" or like.absent or not like.config:
        return None
    ours, theirs = config, like.config
    if any(k in theirs for k in ("quantization_config", "quantization")) or \
            (ours.get("model_type"), ours.get("architectures")) != (theirs.get("model_type"), theirs.get("architectures")):
        return None
    return {n: tuple(like.info(n).shape) for n in like}


def plan(stored: Mapping[str, tuple[tuple[int, ...], str]], config: dict, root: Path,
         like: Checkpoint | None = None, saved: str | None = None) -> Inverse:
    """Trace the MLX tensors ``stored`` (name -> (shape, dtype) as the view reads them: dequantized) back to
    the source of ``config`` (the source's config, as export restores it). Never raises: what cannot be done is
    ``skipped``/``refused``, and those tensors keep their MLX names.

    The source's layout is what transformers' ``save_pretrained`` writes for ``config`` (``source_layout``:
    builds the model on the meta device, a second of imports), or ``like``'s where it is a PyTorch checkpoint of
    the same model (``layout_of``) whose export is exactly what is stored: every stored tensor one of its
    tensors renamed or stacked, none computed, none refused. ``saved``: how the source named its tensors, as the
    export recorded it (``SAVED_AS``): ``MODULE_NAMES`` traces to transformers' own module names (stacked experts),
    anything else to the original format.
    """
    shapes = layout_of(like, config)
    if like is not None and shapes is not None:
        inv = _traced(stored, config, root, shapes)
        if not (inv.skipped or inv.refused or inv.probe) and inv.covered == set(stored):
            return inv
        log.info("%s: %s is not the layout exported here; tracing transformers' own", root, like.root)
    try:
        shapes = source_layout(config) if saved != MODULE_NAMES else source_layout(config, original=False)
    except FFNToolsError as e:
        log.info("%s: MLX names kept (%s)", root, e)
        return Inverse(skipped=str(e))
    return _traced(stored, config, root, shapes)


def _traced(stored: Mapping[str, tuple[tuple[int, ...], str]], config: dict, root: Path,
            shapes: dict[str, tuple[int, ...]]) -> Inverse:
    """``plan`` from the source layout ``shapes``."""
    from .matching import match

    try:
        tg, view, outputs, _, _ = match(_Layout(shapes, config, root), str(root))
    except FFNToolsError as e:
        log.info("%s: MLX names kept (%s)", root, e)
        return Inverse(skipped=str(e))
    inv = Inverse(shapes=shapes)
    entries = {entry.name: entry for entry in view}
    probed: list[str] = []
    for o in outputs:
        if o.name not in stored or tuple(stored[o.name][0]) != tuple(o.shape):
            if o.name in stored:
                inv.refused[o.name] = f"stored {list(stored[o.name][0])}, the export makes {list(o.shape)}"
            continue
        members = [entries[s] for s in o.sources]
        if not members or not all(plain(m, shapes) for m in members):
            probed.append(o.name)
            continue
        for i, m in enumerate(members):
            src = m.inputs[0]
            if src not in inv.sources:
                inv.sources[src] = Source(src, "stack" if len(members) > 1 else "rename", (o.name,),
                                          i if len(members) > 1 else None)
        inv.covered.add(o.name)  # an input renamed twice: the second copy is the same bytes
    if probed:
        inv.probe = Probe(tg.fresh, shapes, view, LAYOUT_DTYPE)
        _gathered(inv, probed, stored)
    order = list(shapes)
    inv.sources = dict(sorted(inv.sources.items(), key=lambda kv: order.index(kv[0])))
    inv.dropped = [n for n in shapes if n not in inv.sources]
    if inv.refused:
        log.info("%s: kept under their MLX names: %s", root, "; ".join(f"{k} ({v})" for k, v in inv.refused.items()))
    return inv


def _gathered(inv: Inverse, probed: list[str], stored: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """Trace the computed outputs and add the sources they hold whole (grouped: outputs sharing a source)."""
    probe = inv.probe
    assert probe is not None  # noqa: S101 - set by the caller
    traces, owners = {}, {}
    for name in probed:
        try:
            traces[name] = probe.trace(name)
        except FFNToolsError as e:  # NotRearranged, or sanitize itself failing on the probes
            inv.refused[name] = str(e)
            continue
        owners[name] = probe.owners(traces[name])
        if not owners[name]:
            inv.refused[name] = "holds no value of the source (made by mlx_lm's sanitize)"
            del traces[name]
    groups: list[tuple[set[str], set[str]]] = []  # (outputs, sources) sharing sources
    for name, srcs in owners.items():
        if name not in traces:
            continue
        joined = [g for g in groups if g[1] & set(srcs)]
        outs, ins = {name}, set(srcs)
        for g in joined:
            groups.remove(g)
            outs |= g[0]
            ins |= g[1]
        groups.append((outs, ins))
    kept = 0
    for outs, ins in groups:
        ts = [traces[o] for o in sorted(outs)]
        dtypes = {stored[o][1] for o in outs}
        short = [f"{s} ({n} of {math.prod(probe.shapes[s])} values)" for s in sorted(ins)
                 if s not in inv.sources and (n := probe.covered(s, ts)) < math.prod(probe.shapes[s])]
        why = (f"holds only part of {', '.join(short)}" if short else
               f"made from the same source as MLX tensors of other dtypes ({', '.join(sorted(dtypes))})"
               if len(dtypes) > 1 else None)
        if why:
            for o in outs:
                inv.refused[o] = why
            continue
        for s in sorted(ins, key=list(probe.shapes).index):
            if s in inv.sources:
                continue  # also renamed as it is: that copy is read
            mine = [t for t in ts if s in owners[t.output]]
            offset = any(t.offsets is not None for t in mine)
            inv.sources[s] = Source(s, "gathered", tuple(t.output for t in mine), None, offset)
        inv.covered |= outs
        for t in ts:
            kept += t.nbytes
            inv.traces[t.output] = t if kept <= TRACE_BUDGET else None

