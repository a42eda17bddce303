"""An adapter laid out as a given base stores its weights: the targets named as the base names its tensors.

A LoRA trained through PEFT on transformers v5's in-memory model targets ``mlp.experts.gate_up_proj`` (E, 2I, H);
the same model's checkpoint on disk holds ``block_sparse_moe.experts.{e}.w1.weight`` and ``.w3.weight``; a Phi-3
LoRA targets ``gate_up_proj`` of a base someone split. ``conform`` tries the exact re-layouts (``relayout``) in
turn and keeps the first whose every target is a tensor of the base, of the LoRA's shape.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import listing
from .model import Adapter, AdapterError
from .places import places
from .relayout import fuse, split

STEPS: tuple[tuple[str, Callable], ...] = (
    ("as it is", lambda a, s: (a, [])),
    ("split", lambda a, s: split(a, s)),
    ("fused", lambda a, s: fuse(a, False, s)),
    ("fused and stacked", lambda a, s: fuse(a, True, s)),
    ("split, then stacked", lambda a, s: _then(split(a, s), lambda b: fuse(b, True, s))),
)


def _then(first, step):
    adapter, changes = first
    out, more = step(adapter)
    return out, changes + more


def misfits(adapter: Adapter, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The adapter's targets the base lacks or holds in another shape, each said."""
    out = []
    for target, lora in adapter.loras.items():
        if target not in shapes:
            out.append(f"{target} (not in the base)")
        elif tuple(shapes[target]) != lora.shape:
            out.append(f"{target} (LoRA delta {list(lora.shape)}, base {list(shapes[target])})")
    return out


def renamed(adapter: Adapter, shapes: dict[str, tuple[int, ...]], scheme=None) -> Adapter:
    """The adapter with each FFN target renamed to the base tensor of the same FFN, projection and form, where
    the names differ but not the place (two groups of one family: ``mlp.experts.{e}.gate_proj`` and Mixtral's
    ``block_sparse_moe.experts.{e}.w1``)."""
    from dataclasses import replace

    if not misfits(adapter, shapes):
        return adapter
    ours = places(adapter.loras, adapter.config, scheme)
    theirs = {(p.group.kind, p.layer, p.expert, p.role, p.form.stacked): n
              for n, p in places(list(shapes), adapter.config, scheme).items()}
    out = {}
    for target, lora in adapter.loras.items():
        p = ours.get(target)
        name = theirs.get((p.group.kind, p.layer, p.expert, p.role, p.form.stacked)) if p and target not in shapes \
            else None
        if name is not None and tuple(shapes[name]) == lora.shape and name not in adapter.loras:
            out[name] = replace(lora, target=name)
        else:
            out[target] = lora
    return adapter.with_loras(out)


def conform(adapter: Adapter, shapes: dict[str, tuple[int, ...]], scheme=None) -> tuple[Adapter, list[str]]:
    """``adapter`` re-laid out exactly so that its targets are the base's tensors (``shapes``: name -> shape).

    Returns:
        The adapter and what was changed ([] when it fitted as it was).

    Raises:
        AdapterError: no exact re-layout fits, naming the targets that do not.
    """
    first = misfits(adapter, shapes)
    if not first:
        return adapter, []
    for how, step in STEPS:
        try:
            candidate, changes = step(adapter, scheme)
        except AdapterError:
            continue
        candidate = renamed(candidate, shapes, scheme)
        if not misfits(candidate, shapes):
            if how == "as it is":
                return candidate, ["adapter's targets renamed as the base names the same projections"]
            return candidate, [f"adapter {how} to fit the base's tensors: " + "; ".join(changes)]
    raise AdapterError(f"{adapter.path}: its LoRA targets do not fit the base, as they are or re-laid out: "
                       f"{listing(first, 4)}; is it this base's adapter?")
