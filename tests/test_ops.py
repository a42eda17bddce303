"""ffn_tools.ops: every reversible op undone bit for bit by its reverse, over layouts, dtypes and shapes; the byte
runs (``Entry.pieces``) give the same bytes as ``apply``; ``take`` moves a Take ahead without changing the result;
every op survives plain pickle; split-gateup's ops are fuse-gateup's reversed."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ffn_tools import ops
from ffn_tools.layouts import ARRANGEMENTS, ORDERS, GateUpLayout
from ffn_tools.ops import (AddLowRank, Affine, Cast, Chunk, Concat, Const, Copy, Fuse, Permute, Reshape, Rows, Select,
                           Split, Stack, Take, Transpose, Unstack)
from ffn_tools.plan import Entry
from ffn_tools.registry import Form
from ffn_tools.stacks import canonical_ops, fuse_ops, split_ops, stack_ops, stack_shape, stored_ops, unstack_ops

FAST = settings(max_examples=25, deadline=None)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int32,
          torch.float8_e4m3fn]
ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8",
      torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.float64: "F64"}


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, C order: bit-for-bit comparison for every dtype (NaN payloads included)."""
    fresh = torch.empty(t.shape, dtype=t.dtype)  # fresh strides: a size-1 dim's odd stride counts as contiguous
    return fresh.copy_(t).reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and raw(x) == raw(y)
                                    for x, y in zip(a, b))


def tensor(draw, shape: tuple[int, ...], dtype) -> torch.Tensor:
    """Random bits of ``dtype`` (every pattern: NaNs, infinities, subnormals) in ``shape``."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    seed = draw(st.integers(0, 2**31 - 1))
    bits = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return bits.view(dtype).reshape(shape)


@st.composite
def layouts(draw) -> GateUpLayout:
    arrangement = draw(st.sampled_from(ARRANGEMENTS))
    tp = draw(st.sampled_from([1, 2, 3])) if arrangement == "tp" else 1
    return GateUpLayout(draw(st.sampled_from(ORDERS)), arrangement, tp, draw(st.sampled_from(["rows", "columns"])))


@st.composite
def gate_up(draw, experts: bool = False):
    """(layout, is_bias, [gate, up] pairs as a flat list, n experts or None)."""
    layout, is_bias = draw(layouts()), draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    half = layout.tp * draw(st.integers(1, 3))
    other = draw(st.integers(1, 4))
    shape = (half,) if is_bias else ((half, other) if layout.axis == "rows" else (other, half))
    n = draw(st.integers(1, 3)) if experts else None
    ts = [tensor(draw, shape, dtype) for _ in range(2 * (n or 1))]
    return layout, is_bias, ts, n


@given(gate_up())
@FAST
def test_split_undoes_fuse_and_fuse_undoes_split_bit_for_bit(case):
    layout, is_bias, ts, _ = case
    fuse = Fuse(layout, is_bias)
    fused = fuse.apply(ts)
    split = fuse.reverse()
    assert split == Split(layout, is_bias) and split.reverse() == fuse
    assert same(split.apply(fused), ts)
    assert same(fuse.apply(split.apply(fused)), fused)


@given(gate_up(experts=True), st.booleans())
@FAST
def test_every_expert_part_is_fuse_ops_reversed_and_taken(case, transpose):
    """split-gateup's definition: ``split_ops`` (fuse_ops reversed, one part taken) gives back each input."""
    layout, is_bias, ts, n = case
    transpose = transpose and not is_bias and layout.axis == "rows"  # parts stored (out, in), turned to fuse
    if transpose:  # the parts are turned before fusing: the layout is on the fused tensor's axis
        layout = layout.oriented(True)
    fused = ops.run(fuse_ops(layout, is_bias, transpose, n), ts)
    assert len(fused) == 1
    for e in range(n or 1):
        for k in (0, 1):
            made = ops.run(split_ops(layout, k, is_bias, transpose, e, n), fused)
            assert same(made, [ts[2 * e + k]])


@st.composite
def stacks(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    n = draw(st.integers(1, 4))
    return [tensor(draw, shape, dtype) for _ in range(n)]


@given(stacks(), st.booleans())
@FAST
def test_unstack_undoes_stack_and_each_expert_is_taken_alone(ts, transpose):
    transpose = transpose and ts[0].ndim >= 2
    stacked = ops.run(stack_ops(len(ts), transpose), ts)
    back = ops.reverse(stack_ops(len(ts), transpose))
    assert back is not None and same(ops.run(back, stacked), ts)
    for e, t in enumerate(ts):
        assert same(ops.run(unstack_ops(len(ts), e, transpose), stacked), [t])


@st.composite
def one_op(draw):
    """A reversible op and a list of tensors it takes."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=2, max_size=3)))
    kind = draw(st.sampled_from(["transpose", "permute", "concat", "chunk", "reshape", "copy", "stack"]))
    t = tensor(draw, shape, dtype)
    if kind == "transpose":
        return Transpose(), [t]
    if kind == "permute":
        dim, block = draw(st.integers(0, len(shape) - 1)), draw(st.integers(1, 3))
        order = tuple(draw(st.permutations(range(shape[dim]))))
        return Permute(order, dim, block), [torch.cat([t] * block, dim)]  # len(order) blocks of ``block``
    if kind == "concat":
        sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
        parts = [tensor(draw, (s, *shape[1:]), dtype) for s in sizes]
        return Concat(sizes, 0), parts
    if kind == "chunk":
        cut = draw(st.integers(0, shape[-1]))
        return Chunk((cut, shape[-1] - cut), -1), [t]
    if kind == "reshape":
        return Reshape((shape[0], -1 if len(shape) > 1 else 1), shape), [t]
    if kind == "stack":
        return Stack(2), [t, tensor(draw, shape, dtype)]
    return Copy(), [t]


@given(one_op())
@FAST
def test_every_reversible_op_is_undone_by_its_reverse_bit_for_bit(case):
    op, ts = case
    back = op.reverse()
    assert back is not None
    assert same(back.apply(op.apply(ts)), ts)


@given(st.integers(3, 8).flatmap(lambda n: st.permutations(range(n))), st.integers(1, 3), st.sampled_from(DTYPES),
       st.data())
@FAST
def test_a_row_order_is_undone_by_its_inverse_order(order, block, dtype, data):
    """Permute (rotary q/k rows reordered per head): its reverse is the inverse order, not the order again."""
    t = tensor(data.draw, (len(order) * block, 2), dtype)
    op = Permute(tuple(order), 0, block)
    moved = op.apply([t])
    assert same(op.reverse().apply(moved), [t])
    assert same(moved, [torch.cat([t[i * block:(i + 1) * block] for i in order])])


@pytest.mark.parametrize("src,dst", [("BF16", "F32"), ("F16", "F32"), ("F32", "F64"), ("I8", "I16"), ("U8", "I32"),
                                     ("F8_E4M3", "BF16"), ("BF16", "BF16")])
@given(seed=st.integers(0, 2**31 - 1))
@FAST
def test_an_exact_widening_cast_is_undone_by_its_reverse(src, dst, seed):
    dtype = next(d for d, s in ST.items() if s == src)
    bits = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    t = bits.view(dtype)
    if t.is_floating_point():  # a NaN's payload is the one thing a float cast does not keep: NaNs made 0
        word = bits.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).clone()
        word[torch.isnan(t.float())] = 0
        t = word.view(dtype)
    cast = Cast(dst, src)
    back = cast.reverse()
    assert back == Cast(src, dst) and (back.reverse() is None) == (src != dst)  # narrowing: no reverse in general
    assert same(back.apply(cast.apply([t])), [t])


def test_a_narrowing_or_unknown_cast_and_the_lossy_ops_have_no_reverse():
    assert Cast("BF16", "F32").reverse() is None and Cast("BF16").reverse() is None
    for op in (Affine(1.0, 1.0), Rows(0, 1), Select(0), Take((0,)), AddLowRank(torch.ones(1, 2), torch.ones(2, 1))):
        assert op.reverse() is None
    assert ops.reverse((Transpose(), Rows(0, 1))) is None


@st.composite
def move_pipelines(draw):
    """A pipeline of pure moves with a single output, its inputs, and its inputs' (dtype, shape)."""
    layout, is_bias, ts, n = draw(gate_up(experts=True))
    kind = draw(st.sampled_from(["fuse", "split", "stack-split", "rows", "permute", "chunk"]))
    if kind == "fuse":
        made = fuse_ops(layout, is_bias, False, n)
    elif kind in ("split", "stack-split"):
        ts = ops.run(fuse_ops(layout, is_bias, False, n), ts)
        made = split_ops(layout, draw(st.integers(0, 1)), is_bias, False, draw(st.integers(0, (n or 1) - 1)), n)
    else:
        t = ts[0]
        ts = [t]
        dim = draw(st.integers(0, t.ndim - 1))
        if kind == "rows":
            start = draw(st.integers(0, t.shape[dim] - 1))
            made = (Rows(start, draw(st.integers(0, t.shape[dim] - start)), dim),)
        elif kind == "permute":
            made = (Permute(tuple(draw(st.permutations(range(t.shape[dim])))), dim),)
        else:
            cut = draw(st.integers(0, t.shape[dim]))
            made = (Chunk((cut, t.shape[dim] - cut), dim), Take((draw(st.integers(0, 1)),)))
    return made, ts


@given(move_pipelines())
@FAST
def test_the_byte_runs_give_the_bytes_apply_makes(case):
    """The two recipes of an entry agree: its ``pieces`` (byte runs of the inputs) are ``apply``'s bytes."""
    made, ts = case
    out = ops.run(made, ts)[0]
    e = Entry("out", ST[out.dtype], tuple(out.shape), tuple(f"in{k}" for k in range(len(ts))), made,
              sources=tuple((ST[t.dtype], tuple(t.shape)) for t in ts))
    assert e.pieces is not None  # a pure move of few runs
    bufs = [raw(t) for t in ts]
    assert b"".join(bufs[k][off:off + n] for k, off, n in e.pieces) == raw(out)
    assert same([e.apply(ts)], [out])


def test_a_transpose_or_a_cast_has_no_byte_runs_and_a_cast_streams():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    turned = Entry("x", "F32", (3, 2), ("t",), (Transpose(),), sources=(("F32", (2, 3)),))
    assert turned.pieces is None and turned.into is None
    cast = Entry("x", "BF16", (2, 3), ("t",), (Cast("BF16", "F32"),), sources=(("F32", (2, 3)),))
    assert cast.pieces is None and cast.into is not None
    out = torch.empty(6, dtype=torch.bfloat16)
    cast.into(t.reshape(-1), out)
    assert torch.equal(out, t.reshape(-1).to(torch.bfloat16))


@given(gate_up(experts=True), st.data())
@FAST
def test_take_moved_ahead_makes_what_taking_last_makes(case, data):
    layout, is_bias, ts, n = case
    fused = ops.run(fuse_ops(layout, is_bias, False, n), ts)
    back = ops.reverse(fuse_ops(layout, is_bias, False, n))
    assert back is not None
    index = (data.draw(st.integers(0, 2 * (n or 1) - 1)),)
    narrowed = ops.take(back, index, 1)
    assert same(ops.run(narrowed, fused), Take(index).apply(ops.run(back, fused)))
    if n is not None:  # one expert's slice split, not the whole stack
        assert narrowed[0] == Select(index[0] // 2) and not any(isinstance(o, Unstack) for o in narrowed)


EVERY_OP = [Copy(), Take((1, 0)), Select(2, 1), Rows(1, 2, -1), Split(GateUpLayout("up-gate", "tp", 2), True, "x"),
            Fuse(GateUpLayout(arrangement="interleaved", axis="columns")), Stack(3), Unstack(3), Concat((1, 2), 1),
            Chunk((1, 2), 1), Transpose(0, 2), Reshape((2, -1), (2, 3)), Permute((2, 0, 1), 0, 4),
            Cast("BF16", "F32"), Affine(2.0, 1.0), Const((3, 4))]


@pytest.mark.parametrize("op", EVERY_OP, ids=lambda o: type(o).__name__)
def test_every_op_survives_plain_pickle(op):
    back = pickle.loads(pickle.dumps(op))
    assert back == op and type(back) is type(op) and back.describe() == op.describe()
    assert (back.reverse() is None) == (op.reverse() is None)


def test_an_entry_of_ops_pickles_and_applies_the_same_after():
    layout = GateUpLayout("gate-up", "interleaved")
    e = Entry("g", "F32", (2, 3), ("gu",), split_ops(layout, 0), sources=(("F32", (4, 3)),), text="gate rows")
    back = pickle.loads(pickle.dumps(e))
    t = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    assert back == e and back.pieces == e.pieces and same([back.apply([t])], [e.apply([t])])
    assert torch.equal(e.apply([t]), t[0::2])


def test_lora_sum_op_pickles_with_its_factors():
    a, b = torch.randn(2, 5), torch.randn(4, 2)
    op = AddLowRank(a, b, 0.5)
    back = pickle.loads(pickle.dumps(op))
    w = torch.randn(4, 5)
    assert torch.equal(back.apply([w])[0], op.apply([w])[0])
    assert torch.allclose(op.apply([w])[0], w + 0.5 * b @ a)


@dataclass
class _Job:
    wanted: bool = True


@dataclass(frozen=True)
class _Placed(Copy):
    """A format's own op writing its output itself: it declares where, and the work it shares."""

    job: _Job = field(default_factory=_Job)

    @property
    def placement(self):
        return self.place

    def place(self, path, offset):
        return (path, offset)

    @property
    def shares(self):
        return self.job


def test_placement_and_shared_work_are_declared_by_an_op_not_probed():
    op = _Placed()
    e = Entry("q", "U32", (1,), ("w",), (Transpose(), op))
    assert e.place is not None and e.place("f", 8) == ("f", 8) and e.shared is op.job
    plain = Entry("w", "F32", (1,), ("w",), (Copy(),))
    assert plain.place is None and plain.shared is None


def test_an_entry_is_made_of_ops_only():
    """The closure shape entries had before ops (a callable, then pieces and a note) is refused, not wrapped; one op
    is a tuple of one."""
    with pytest.raises(TypeError):
        Entry("w", "F32", (2,), ("a",), lambda ts: ts[0] * 2, ((0, 0, 8),), "doubled")  # type: ignore
    with pytest.raises(TypeError, match="tuple of ffn_tools.ops"):
        Entry("w", "F32", (2,), ("a",), lambda ts: ts[0] * 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tuple of ffn_tools.ops"):
        Entry("w", "F32", (2,), ("a",), (Copy(), lambda ts: ts))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Entry("w", "F32", (2,), ("a",), (Copy(),), ((0, 0, 8),))  # type: ignore[misc]
    one = Entry("w", "F32", [2], ["a"], Copy(), sources=(("F32", (2,)),))  # type: ignore[arg-type]
    assert one.ops == (Copy(),) and one.shape == (2,) and one.inputs == ("a",) and one.pieces == ((0, 0, 8),)


@st.composite
def stacked_forms(draw):
    """A stacked or flat form of a layer's experts (fused or not, turned or not), its layout, and a canonical stack."""
    fused, flat = draw(st.booleans()), draw(st.booleans())
    transposed = draw(st.booleans())
    turned = () if transposed else tuple(draw(st.sets(st.sampled_from(["gate_up" if fused else "gate", "down"]))))
    if not fused and "gate" in turned:
        turned += ("up",)
    form = Form(gate=None if fused else "g", up=None if fused else "u", down="d", gate_up="gu" if fused else None,
                stacked=not flat, transposed=transposed, turned=turned, flat=flat, experts="n" if flat else None)
    layout = draw(layouts())
    e, h, i = draw(st.integers(1, 3)), draw(st.integers(1, 3)), layout.tp * draw(st.integers(1, 2))
    dtype = draw(st.sampled_from(DTYPES))
    canonical = {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i), "gate_bias": (e, i), "up_bias": (e, i),
                 "down_bias": (e, h)}
    return form, layout, (e, h, i), {r: tensor(draw, s, dtype) for r, s in canonical.items()}


@given(stacked_forms())
@FAST
def test_every_stacked_form_reads_back_the_canonical_stack_it_was_written_from(case):
    """``stacks.stored_ops`` is each form's one definition; ``canonical_ops`` (its reverse) gives the stack back."""
    form, layout, size, c = case
    for role in [*form.templates(), *(f"{r}_bias" for r in form.templates())]:
        base = role.removesuffix("_bias")
        suffix = role[len(base):]
        parts = (f"gate{suffix}", f"up{suffix}") if base == "gate_up" else (role,)
        stored = ops.run(stored_ops(form, role, layout, *size), [c[p] for p in parts])
        assert len(stored) == 1 and tuple(stored[0].shape) == stack_shape(form, role, *size)
        assert same(ops.run(canonical_ops(form, role, parts, layout, *size), stored), [c[p] for p in parts])
        for p in parts:
            assert same(ops.run(canonical_ops(form, role, (p,), layout, *size), stored), [c[p]])
