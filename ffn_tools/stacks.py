"""A layer's experts moved whole between stacked forms: 3-D stacks and flattened ones, fused or separate, stored
(out, in) or turned (in, out), through their canonical stack: gate, up (E, I, H), down (E, H, I), biases (E, n).

split-gateup and fuse-gateup use it where a form is flat (DBRX's ``w1``/``v1``/``w2``, (E * I, H), ``w2`` stored
(in, out)): one output tensor holds every expert of the layer, so the entries are per layer, not per FFN. Every
step is a pure move (unflatten, transpose, ``layouts.split``/``fuse``), so a round trip is bit-exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .ffn import FFN
from .layouts import GateUpLayout, fuse, split
from . import ops as oplib
from .ops import Fuse, Op, Stack, Transpose
from .plan import Entry
from .registry import FUSED, Form, bias_name

if TYPE_CHECKING:
    import torch

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


def canonical_stack(ts: dict[str, "torch.Tensor"], form: Form, layout: GateUpLayout, d_model: int,
                    d_ffn: int) -> dict[str, "torch.Tensor"]:
    """The canonical (E, ...) weights and biases of a layer from its stored tensors (role -> tensor)."""
    def stack(role: str) -> "torch.Tensor":
        t = ts[role]
        if form.flat:  # (E * n, ...): expert e is rows e * n : (e + 1) * n
            n = form.rows(role, d_model, d_ffn)
            t = t.unflatten(0, (t.shape[0] // n, n))
        return t

    out: dict[str, torch.Tensor] = {}
    if FUSED in ts:
        out["gate"], out["up"] = split(stack(FUSED), layout.oriented(form.turns(FUSED)), name="gate_up")
        if f"{FUSED}_bias" in ts:
            out["gate_bias"], out["up_bias"] = split(stack(f"{FUSED}_bias"), layout, is_bias=True, name="bias")
    for role in (*WEIGHTS, *(f"{r}_bias" for r in WEIGHTS)):
        if role in ts:
            out[role] = stack(role)
    for r in WEIGHTS:
        if form.turns(r):  # (E, in, out) -> (E, out, in)
            out[r] = out[r].transpose(1, 2)
    return out


def stored(c: dict[str, "torch.Tensor"], form: Form, role: str, layout: GateUpLayout) -> "torch.Tensor":
    """Tensor ``role`` of ``form`` from a layer's canonical stack ``c`` (``canonical_stack``'s inverse)."""
    bias = role.endswith("_bias")
    base = role.removesuffix("_bias")
    suffix = "_bias" if bias else ""
    turn = not bias and form.turns(base)
    if base == FUSED:
        g, u = (c[f"{r}{suffix}"].transpose(1, 2) if turn else c[f"{r}{suffix}"] for r in ("gate", "up"))
        t = fuse(g, u, layout.oriented(turn), is_bias=bias, name=role)  # the axis of the target's tensor
    else:
        t = c[role].transpose(1, 2) if turn else c[role]
    return (t.flatten(0, 1) if form.flat else t).contiguous()


def restack_entries(ckpt, experts: list[FFN], target: Form, names: dict[str, str]) -> list[Entry]:
    """The entries writing one layer's ``experts`` (every expert of one stack, in order) as ``target``, whose
    weight tensors are ``names`` (role -> name; biases are named after their weights)."""
    f0 = experts[0]
    src = {r: n for r, n in f0.names.items()}
    inputs = tuple(dict.fromkeys(src.values()))
    dtype = ckpt.info(f0.names["down"]).st_dtype
    roles = [r for r in target.templates()]
    roles += [f"{r}_bias" for r in roles if any(f"{p}_bias" in src for p in _parts(r))]
    out = []
    for role in roles:
        base = role.removesuffix("_bias")
        name = bias_name(names[base]) if role.endswith("_bias") else names[base]

        def compute(ts, role=role):
            c = canonical_stack(dict(zip(src, (ts[inputs.index(n)] for n in src.values()))), f0.form, f0.layout,
                                f0.d_model, f0.d_ffn)
            return stored(c, target, role, f0.layout)

        shape = stack_shape(target, role, len(experts), f0.d_model, f0.d_ffn)
        how = "flattened" if target.flat else "stacked"
        out.append(Entry(name, dtype, shape, inputs, compute, None,
                         f"{role} of layer {f0.ref.layer}'s {len(experts)} experts from {', '.join(inputs)}, {how}"
                         + (", stored (in, out)" if not role.endswith("_bias") and target.turns(base) else "")))
    return out


def _parts(role: str) -> tuple[str, ...]:
    """The stored roles whose bias makes ``role``'s: gate_up's from gate's and up's (or its own), and back."""
    return {FUSED: (FUSED, "gate", "up"), "gate": ("gate", FUSED), "up": ("up", FUSED)}.get(role, (role,))
