"""One plan entry (or a quantized weight's two or three) per parameter of the MLX model.

An output's data is one of three things (``names.Output``): input tensors as they are (one, or experts
stacked: rows in order, so byte copies and row-chunked streaming both work), a view entry the plan computes
(a split piece of a fused ``gate_up_proj``), or an array ``sanitize`` computes (``names.SanitizeRun``).
Untouched data are byte copies; casts and quantization stream input rows through MLX (``quant``) where
the data are input tensors, and take the whole array otherwise (``Whole``).

Every entry is data (plain ``pickle`` sends it to a ``--ray`` task): what ``sanitize`` computes is named by
mlx_lm's module and the config (``models.Builder``) and the inputs it reads (``Inputs``), not by a closure.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from ffn_tools.io.dtypes import nbytes, short_name
from ffn_tools.ops import Stack
from ffn_tools.plan import Entry, copy_entry

from .names import Output, SanitizeRun
from .ops import Members, MxCast, Quantize, Sanitized, StreamCast
from .quant import part_specs, to_mx, torch_bytes, torch_to_mx
from .quantize import PARTS, QuantJob

_FLOATS = ("F32", "F16", "BF16", "F64")


def _plain(ckpt, e: Entry) -> str | None:
    """The input's name when a view entry is one whole input tensor (renamed or not), else None."""
    if len(e.inputs) == 1 and e.pieces == ((0, 0, e.nbytes),):
        info = ckpt.info(e.inputs[0])
        if tuple(info.shape) == tuple(e.shape) and info.st_dtype == e.st_dtype:
            return e.inputs[0]
    return None


def _combined(ckpt, name: str, members: list[Entry], dtype: str, shape: tuple[int, ...], note: str) -> Entry:
    """Entries stacked on a new first axis: each made by its own ops from its inputs (concatenated), then stacked;
    byte runs where every member has them."""
    groups: list[tuple[int, Entry]] = []
    inputs: list[str] = []
    for e in members:
        groups.append((len(inputs), e))
        inputs += e.inputs
    sources = tuple((ckpt.info(n).st_dtype, tuple(ckpt.info(n).shape)) for n in inputs)
    return Entry(name, dtype, shape, tuple(inputs), (Members(tuple(groups)), Stack()), sources=sources, text=note)


@dataclass(frozen=True)
class Inputs:
    """Every view tensor as an mx array for ``sanitize`` (``load_inputs``), named by data: the checkpoint and
    the view (a ``names.SanitizeRun``'s ``load``)."""

    ckpt: Any = field(compare=False)
    view: tuple[Entry, ...] = field(compare=False)

    def __call__(self) -> dict[str, mx.array]:
        return load_inputs(self.ckpt, list(self.view))


@dataclass(frozen=True)
class Whole:
    """Output ``name``'s data as one mx array, where a quantized weight is not input rows (``QuantJob.whole``):
    computed by ``sanitize`` (``run``), else its view entries' tensors read from ``ckpt`` (a split piece of an
    input), stacked on a new first axis when several."""

    name: str
    run: SanitizeRun | None = field(default=None, compare=False)
    ckpt: Any = field(default=None, compare=False)
    members: tuple[Entry, ...] = field(default=(), compare=False)

    def array(self) -> mx.array:
        if self.run is not None:
            return self.run.get(self.name)
        parts = [torch_to_mx(e.apply([self.ckpt[n] for n in e.inputs])) for e in self.members]
        return parts[0] if len(parts) == 1 else mx.stack(parts)


class _Source:
    """Where one output's data come from, with a way to get it whole as an mx array."""

    def __init__(self, ckpt, o: Output, view: dict[str, Entry], run: SanitizeRun):
        self.ckpt, self.o, self.run = ckpt, o, run
        self.members = [view[n] for n in o.sources]
        plain = [p for e in self.members if (p := _plain(ckpt, e))]
        self.inputs: tuple[str, ...] | None = (tuple(plain) if self.members and len(plain) == len(self.members)
                                               else None)  # streamable input rows

    @property
    def nbytes(self) -> int:
        """The output's size before any cast: the input bytes it reads."""
        return nbytes(self.o.dtype, self.o.shape)

    def note(self) -> str:
        if self.o.computed:
            return "computed by mlx_lm's sanitize"
        if len(self.members) > 1:
            return f"stacked from {self.o.sources[0]} .. {self.o.sources[-1]}"
        src = self.o.sources[0]
        return "" if src == self.o.name else f"from {src}"

    def whole(self) -> Whole:
        if self.o.computed:
            return Whole(self.o.name, self.run)
        return Whole(self.o.name, None, self.ckpt, tuple(self.members))

    def entry(self) -> Entry:
        """The output unchanged: byte copies where it can."""
        o = self.o
        if o.computed:
            return Entry(o.name, o.dtype, o.shape, (), (Sanitized(o.name, self.run),), text=self.note())
        if len(self.members) == 1:
            if self.inputs:
                return copy_entry(self.ckpt, self.inputs[0], o.name)
            return replace(self.members[0], name=o.name)
        return _combined(self.ckpt, o.name, self.members, o.dtype, o.shape, self.note())

    def cast_entry(self, to: str) -> Entry:
        """The output cast to ``to`` with MLX: input rows streamed where it has them, else the whole tensor."""
        o, inputs, note = self.o, self.inputs, f"cast to {short_name(to)} {self.note()}"
        if inputs:
            return Entry(o.name, to, o.shape, (), (StreamCast(self.ckpt, inputs, to, tuple(o.shape)),),
                         reads=self.nbytes, text=note)
        if o.computed:
            return Entry(o.name, to, o.shape, (), (Sanitized(o.name, self.run, to),), reads=self.nbytes, text=note)
        made = self.entry()
        return Entry(o.name, to, o.shape, made.inputs, (*made.ops, MxCast(to)), reads=self.nbytes, text=note)


def plan_outputs(ckpt, tg, view: list[Entry], outputs: list[Output], cast: str | None, chosen: dict[str, dict],
                 qshapes: dict[str, tuple[int, ...]]) -> tuple[list[Entry], list[QuantJob]]:
    """The entries writing ``outputs``, cast (where the model's ``cast_predicate`` allows) and quantized as
    ``chosen`` (module path -> parameters; ``qshapes``: the quantized model's parameter shapes).

    Returns:
        (entries, quantization jobs).
    """
    by_name = {e.name: e for e in view}
    run = SanitizeRun(tg.build or tg.fresh, Inputs(ckpt, tuple(view)))  # one for every computed output

    cast_ok = getattr(tg.model, "cast_predicate", lambda _: True)
    entries, jobs = [], []
    for o in outputs:
        src = _Source(ckpt, o, by_name, run)
        to = cast if cast and o.dtype in _FLOATS and cast != o.dtype and cast_ok(o.name) else None
        module = o.name[: -len(".weight")] if o.name.endswith(".weight") else None
        params = chosen.get(module) if module else None
        if params is not None:
            g, b, mode = params["group_size"], params["bits"], params["mode"]
            job = QuantJob(ckpt, src.inputs or (), o.shape, o.dtype, to, g, b, mode,
                           None if src.inputs else src.whole())
            jobs.append(job)
            how = f"{job.describe()} {src.note()}".rstrip()
            for k, (st, shape) in enumerate(part_specs(o.shape, to or o.dtype, g, b, mode)):
                name = f"{module}.{PARTS[k]}"
                if name in qshapes and tuple(qshapes[name]) != tuple(shape):
                    raise RuntimeError(f"internal error: {name} planned {list(shape)}, MLX's model {list(qshapes[name])}")
                entries.append(Entry(name, st, shape, (), (Quantize(job, k),), reads=src.nbytes if k == 0 else 0,
                                     text=f"{PARTS[k]} of {how}"))
            continue
        entries.append(src.entry() if to is None else src.cast_entry(to))
    return entries, jobs


def load_inputs(ckpt, view: list[Entry]) -> dict[str, mx.array]:
    """Every view tensor as an mx array for ``sanitize``: lazily loaded (``mx.load``) where it is an input
    tensor of a safetensors file under its own name, else read now."""
    files: dict = {}
    out = {}
    for e in view:
        name = _plain(ckpt, e)
        info = ckpt.info(name) if name else None
        if info is not None and info.start is not None and str(info.file).endswith(".safetensors"):
            lazy = files.setdefault(info.file, mx.load(str(info.file)))
            if name in lazy:
                out[e.name] = lazy[name]
                continue
        if name is not None:
            raw = ckpt.read_raw(name)
            out[e.name] = to_mx(memoryview(raw), raw.dtype, raw.shape)
        else:
            t = e.apply([ckpt[n] for n in e.inputs])
            out[e.name] = to_mx(torch_bytes(t), e.st_dtype, tuple(t.shape))
    return out
