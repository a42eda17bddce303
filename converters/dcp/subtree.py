"""Which keys of a DCP state dict are the model's, and what the rest is.

A training run saves its model beside its optimizer, its learning-rate schedule and its step. ``dcp.save`` flattens
the nested dict it is given with ``.``, so where the model sits shows only in the keys:

    torchtitan's CheckpointManager   the model's keys at the top (``layers.0...``) beside ``optimizer.*``,
                                     ``lr_scheduler.*``, ``dataloader``, ``train_state``
    PyTorch's DCP tutorial           ``{"app": AppState}``: ``app.model.*`` beside ``app.optim.*``
    an FSDP recipe                   ``{"model": ..., "optimizer": ...}``: ``model.*`` beside ``optimizer.*``

An optimizer's state dict is known by its form, whatever its key: ``X.state.*`` beside ``X.param_groups.*`` (torch's
``Optimizer.state_dict``, and ``get_state_dict``'s, whose ``state`` is keyed by the parameters' names). Training
state, left out, is: every key under an optimizer, every key under a name of ``TRAINING_STATE`` beside the model
(at the top, or beside the optimizer), every key that holds no tensor. The model is the rest, under the prefix
that (in this order) makes the optimizer's parameter names its keys, or is the one key beside the optimizer holding
tensors (``app.model.``, ``model.``), or is the optimizer's parent (torchtitan's: nothing).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from .metadata import Entry

# Keys beside the model that are training state, by their name (torchtitan's CheckpointManager's, torch's usual)
TRAINING_STATE = ("optimizer", "optim", "lr_scheduler", "lr_schedulers", "scheduler", "dataloader", "train_state",
                  "model_parts")
_TRAINING_PREFIXES = ("ft_",)  # torchtitan's fault-tolerance state (ft_*)


@dataclass
class Split:
    """A DCP state dict's keys, divided.

    Attributes:
        prefix: the model's subtree ("" at the top; "app.model." for the tutorial's), its keys read without it.
        weights: the model's tensor keys, as stored (with ``prefix``).
        left_out: label -> the training-state keys under it (an optimizer, a scheduler, objects).
    """

    prefix: str
    weights: list[str]
    left_out: dict[str, list[str]] = field(default_factory=dict)

    def described(self) -> str:
        """What was left out, in one clause: ``optimizer state app.optim.* (75 keys), ...``."""
        return ", ".join(f"{label} ({len(keys)} key{'s' if len(keys) > 1 else ''})"
                         for label, keys in self.left_out.items())


def _prefixes_before(keys, component: str) -> set[str]:
    """Every prefix (with its trailing dot, "" at the top) that ``component`` follows in some key."""
    out: set[str] = set()
    for k in keys:
        parts = k.split(".")
        out.update(".".join(parts[:i]) + ("." if i else "") for i, p in enumerate(parts) if p == component)
    return out


def _optimizers(keys) -> list[str]:
    """The prefixes of the optimizer state dicts among ``keys`` (``"app.optim."``), outermost first."""
    found = _prefixes_before(keys, "state") & _prefixes_before(keys, "param_groups")
    outer = sorted(found, key=len)
    return [p for i, p in enumerate(outer) if not any(p.startswith(q) for q in outer[:i])]


def _parent(prefix: str) -> str:
    """``"app.optim."`` -> ``"app."``; ``"optimizer."`` -> ``""``."""
    return prefix[: prefix.rstrip(".").rfind(".") + 1]


def _common(keys: list[str]) -> list[str]:
    """The component prefixes every key shares, shortest first (``["", "app.", "app.model."]``)."""
    parts = os.path.commonprefix([k.split(".")[:-1] for k in keys]) if keys else []
    return [".".join(parts[:i]) + ("." if i else "") for i in range(len(parts) + 1)]


def split(entries: Mapping[str, Entry]) -> Split:
    """The model's keys of a DCP state dict and the training state beside them (see the module docstring)."""
    optimizers = _optimizers(entries)
    parent = _parent(optimizers[0]) if optimizers else ""
    left_out: dict[str, list[str]] = {}
    rest: list[str] = []
    for key, e in entries.items():
        opt = next((p for p in optimizers if key.startswith(p)), None)
        inner = key[len(parent):].split(".", 1)[0] if key.startswith(parent) else None
        if opt is not None:
            left_out.setdefault(f"optimizer state {opt}*", []).append(key)
        elif inner is not None and (inner in TRAINING_STATE or inner.startswith(_TRAINING_PREFIXES)):
            left_out.setdefault(f"{parent}{inner}" + ("" if key == parent + inner else ".*"), []).append(key)
        elif e.dtype is None:
            left_out.setdefault("objects, not tensors", []).append(key)
        else:
            rest.append(key)
    return Split(_model_prefix(rest, entries, optimizers, parent), rest, left_out)


def _model_prefix(rest: list[str], entries: Mapping[str, Entry], optimizers: list[str], parent: str) -> str:
    candidates = _common(rest)
    named = {k[len(p) + len("state."):].rsplit(".", 1)[0] for p in optimizers for k in entries
             if k.startswith(p + "state.")}  # the parameters' names where the state is keyed by them
    hits = {c: sum(k[len(c):] in named for k in rest) for c in candidates}
    best = max(candidates, key=lambda c: (hits[c], -len(c)))
    if hits[best]:
        return best
    if not optimizers or parent not in candidates:
        return ""
    beside = {k[len(parent):].split(".", 1)[0] for k in rest}
    only = f"{parent}{next(iter(beside))}."
    return only if len(beside) == 1 and only in candidates else parent
