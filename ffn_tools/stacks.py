"""A layer's experts moved whole between stacked forms: 3-D stacks and flattened ones, fused or separate, stored
(out, in) or turned (in, out), through their canonical stack: gate, up (E, I, H), down (E, H, I), biases (E, n).

split-gateup and fuse-gateup use it where a form is flat (DBRX's ``w1``/``v1``/``w2``, (E * I, H), ``w2`` stored
(in, out)): one output tensor holds every expert of the layer, so the entries are per layer, not per FFN. Every
step is a pure move (unflatten, transpose, split/fuse), so a round trip is bit-exact: each form's ``stored_ops`` is
the one definition, read back by its reverse. ``fuse_ops``/``stack_ops`` are the same for one FFN's (or expert's)
gate/up and a stack of them: split-gateup's entries are their reverse.
"""

from __future__ import annotations

from .ffn import FFN
from .layouts import GateUpLayout
from . import ops as oplib
from .ops import Fuse, Op, Reshape, Stack, Transpose
from .plan import Entry
from .registry import FUSED, Form, bias_name

WEIGHTS = ("gate", "up", "down")


def fuse_ops(layout: GateUpLayout, is_bias: bool = False, transpose: bool = False, experts: int | None = None,
             name: str = "tensor") -> tuple[Op, ...]:
    """THE definition of a fused gate/up tensor as stored, from (gate, up) pairs (one pair per expert of a stack of
    ``experts``): each part turned first where ``transpose`` (stored (in, out)), fused in ``layout``, stacked.
    fuse-gateup's entries are these ops; split-gateup's are these ops reversed (``split_ops``)."""
    return (*((Transpose(),) if transpose else ()), Fuse(layout, is_bias, name),
            *((Stack(experts),) if experts is not None else ()))


def split_ops(layout: GateUpLayout, part: int, is_bias: bool = False, transpose: bool = False,
              expert: int | None = None, experts: int | None = None, name: str = "tensor") -> tuple[Op, ...]:
    """Part ``part`` (0 gate, 1 up) of a fused tensor (expert ``expert`` of a stack of ``experts``): ``fuse_ops``
    reversed, then that part taken (the slice of that expert split, not the whole stack)."""
    back = oplib.reverse(fuse_ops(layout, is_bias, transpose, experts, name))
    assert back is not None  # every op of fuse_ops has its reverse
    return oplib.take(back, (2 * (expert or 0) + part,), 1)


def stack_ops(experts: int, transpose: bool = False) -> tuple[Op, ...]:
    """THE definition of a stack of experts' tensors (``transpose``: each turned first); ``unstack_ops`` reverses it."""
    return (*((Transpose(),) if transpose else ()), Stack(experts))


def unstack_ops(experts: int, index: int, transpose: bool = False) -> tuple[Op, ...]:
    """Expert ``index``'s tensor of a stack of ``experts``: ``stack_ops`` reversed, that expert taken."""
    back = oplib.reverse(stack_ops(experts, transpose))
    assert back is not None
    return oplib.take(back, (index,), 1)


def stored_roles(form: Form, names: dict[str, str]) -> list[str]:
    """The roles a layer's stack of ``form`` stores: its weights, and the biases present in ``names``."""
    weights = list(form.templates())
    return weights + [f"{r}_bias" for r in weights if f"{r}_bias" in names]


def expert_shape(form: Form, role: str, d_model: int, d_ffn: int) -> tuple[int, ...]:
    """One expert's tensor ``role`` as ``form`` stores it: (out, in), or (in, out) where it is turned."""
    base = role.removesuffix("_bias")
    out = {"gate": d_ffn, "up": d_ffn, FUSED: 2 * d_ffn, "down": d_model}[base]
    if role.endswith("_bias"):
        return (out,)
    inp = d_ffn if base == "down" else d_model
    return (inp, out) if form.turns(base) else (out, inp)


def stack_shape(form: Form, role: str, experts: int, d_model: int, d_ffn: int) -> tuple[int, ...]:
    """The whole layer's tensor ``role``: (E, ...) stacked, (E * n, ...) flat."""
    one = expert_shape(form, role, d_model, d_ffn)
    return (experts * one[0], *one[1:]) if form.flat else (experts, *one)


def stored_ops(form: Form, role: str, layout: GateUpLayout, experts: int, d_model: int, d_ffn: int) -> tuple[Op, ...]:
    """THE definition of a layer's stored tensor ``role`` of ``form`` from its canonical stack: gate, up (E, I, H),
    down (E, H, I), biases (E, n) (gate_up's from [gate, up], gate_up_bias's from [gate_bias, up_bias]): turned
    where ``form`` stores (in, out), fused in ``layout`` on the stored axis, flattened where ``form`` is flat.
    Its reverse reads the canonical stack back from the stored tensor (``canonical_ops``)."""
    bias, base = role.endswith("_bias"), role.removesuffix("_bias")
    turn = not bias and form.turns(base)
    made: list[Op] = [Transpose()] if turn else []
    if base == FUSED:
        made.append(Fuse(layout.oriented(turn), bias, role))
    if form.flat:
        one = expert_shape(form, role, d_model, d_ffn)
        made.append(Reshape((experts * one[0], *one[1:]), (experts, *one)))
    return tuple(made)


def canonical_ops(form: Form, role: str, parts: tuple[str, ...], layout: GateUpLayout, experts: int, d_model: int,
                  d_ffn: int) -> tuple[Op, ...]:
    """Canonical ``parts`` (gate, up, down, biases) of a layer's stack from its stored tensor ``role`` of ``form``:
    ``stored_ops`` reversed (and, from a fused tensor, those parts taken)."""
    back = oplib.reverse(stored_ops(form, role, layout, experts, d_model, d_ffn))
    assert back is not None  # every op of stored_ops has its reverse
    if role.removesuffix("_bias") != FUSED or len(parts) == 2:
        return back
    return oplib.take(back, (0 if parts[0].startswith("gate") else 1,), 1)


def restack_entries(ckpt, experts: list[FFN], target: Form, names: dict[str, str]) -> list[Entry]:
    """The entries writing one layer's ``experts`` (every expert of one stack, in order) as ``target``, whose
    weight tensors are ``names`` (role -> name; biases are named after their weights): each the source form's
    ``stored_ops`` reversed (to the canonical stack), then the target's ``stored_ops``."""
    f0 = experts[0]
    src = dict(f0.names)
    dtype = ckpt.info(f0.names["down"]).st_dtype
    roles = [r for r in target.templates()]
    roles += [f"{r}_bias" for r in roles if any(f"{p}_bias" in src for p in _parts(r))]
    size = (len(experts), f0.d_model, f0.d_ffn)
    out = []
    for role in roles:
        bias, base = role.endswith("_bias"), role.removesuffix("_bias")
        name = bias_name(names[base]) if bias else names[base]
        suffix = "_bias" if bias else ""
        parts = (f"gate{suffix}", f"up{suffix}") if base == FUSED else (role,)
        held = parts[0] if parts[0] in src else f"{FUSED}{suffix}"  # the source role holding them (gate's form
        # is up's: one path for both)
        inputs = tuple(dict.fromkeys(src[p if p in src else held] for p in parts))
        back = canonical_ops(f0.form, held, parts if len(inputs) == 1 else parts[:1], f0.layout, *size)
        how = "flattened" if target.flat else "stacked"
        out.append(Entry(name, dtype, stack_shape(target, role, *size), inputs,
                         (*back, *stored_ops(target, role, f0.layout, *size)),
                         sources=tuple((ckpt.info(n).st_dtype, tuple(ckpt.info(n).shape)) for n in inputs),
                         text=f"{role} of layer {f0.ref.layer}'s {len(experts)} experts from "
                              f"{', '.join(dict.fromkeys(src.values()))}, {how}"
                              + (", stored (in, out)" if not bias and target.turns(base) else "")))
    return out


def _parts(role: str) -> tuple[str, ...]:
    """The stored roles whose bias makes ``role``'s: gate_up's from gate's and up's (or its own), and back."""
    return {FUSED: (FUSED, "gate", "up"), "gate": ("gate", FUSED), "up": ("up", FUSED)}.get(role, (role,))
