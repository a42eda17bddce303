"""One plan entry (or a quantized weight's two or three) per parameter of the MLX model.

An output's data is one of three things (``names.Output``): input tensors as they are (one, or experts
stacked: rows in order, so byte copies and row-chunked streaming both work), a view entry the plan computes
(a split piece of a fused ``gate_up_proj``), or an array ``sanitize`` computes (``names.SanitizeRun``).
Untouched data are byte copies; casts and quantization stream input rows through MLX (``quant``) where
the data are input tensors, and take the whole array otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ffn_tools.io.dtypes import nbytes, short_name
from ffn_tools.io.raw import RawTensor
from ffn_tools.io.writer import Placed
from ffn_tools.plan import Entry, copy_entry

from .names import Output, SanitizeRun
from .quant import MX_DTYPES, cast_fn, from_mx, part_specs, stream, to_mx, torch_bytes, torch_to_mx
from .quantize import QuantJob

_FLOATS = ("F32", "F16", "BF16", "F64")


def _plain(ckpt, e: Entry) -> str | None:
    """The input's name when a view entry is one whole input tensor (renamed or not), else None."""
    if len(e.inputs) == 1 and e.pieces == ((0, 0, e.nbytes),):
        info = ckpt.info(e.inputs[0])
        if tuple(info.shape) == tuple(e.shape) and info.st_dtype == e.st_dtype:
            return e.inputs[0]
    return None


def _torch_stack(ts):
    import torch

    return torch.stack(ts)


def _combined(name: str, members: list[Entry], dtype: str, shape: tuple[int, ...], note: str) -> Entry:
    """Entries stacked on a new first axis: their inputs concatenated, their pieces too where all have them."""
    inputs: list[str] = []
    pieces: list[tuple[int, int, int]] | None = []
    spans: list[tuple[int, int]] = []
    for e in members:
        spans.append((len(inputs), len(e.inputs)))
        base = len(inputs)
        inputs += e.inputs
        pieces = None if pieces is None or e.pieces is None else pieces + [(base + k, o, n) for k, o, n in e.pieces]

    def compute(ts):
        return _torch_stack([e.compute(ts[a:a + n]) for e, (a, n) in zip(members, spans)])

    return Entry(name, dtype, shape, tuple(inputs), compute, tuple(pieces) if pieces is not None else None, note)


class _Source:
    """Where one output's data come from, with a way to get it whole as an mx array."""

    def __init__(self, ckpt, o: Output, view: dict[str, Entry], run: Callable[[], SanitizeRun]):
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

    def array(self) -> mx.array:
        if self.o.computed:
            return self.run().get(self.o.name)
        parts = []
        for e in self.members:
            t = e.compute([self.ckpt[n] for n in e.inputs])
            parts.append(torch_to_mx(t))
        return parts[0] if len(parts) == 1 else mx.stack(parts)

    def entry(self) -> Entry:
        """The output unchanged: byte copies where it can."""
        o = self.o
        if o.computed:
            return Entry(o.name, o.dtype, o.shape, (), lambda _: from_mx(self.array()), None, self.note())
        if len(self.members) == 1:
            e = self.members[0]
            if self.inputs:
                return copy_entry(self.ckpt, self.inputs[0], o.name)
            return Entry(o.name, e.dtype, e.shape, e.inputs, e.compute, e.pieces, e.note)
        return _combined(o.name, self.members, o.dtype, o.shape, self.note())

    def cast_entry(self, to: str) -> Entry:
        """The output cast to ``to``: input rows streamed through MLX where it has them, else the whole array."""
        o, inputs, note = self.o, self.inputs, f"cast to {short_name(to)} {self.note()}"
        if inputs:
            return Entry(o.name, to, o.shape, (), lambda _: stream(self.ckpt, inputs, [(to, o.shape)], cast_fn(to))[0],
                         None, note, reads=self.nbytes)
        return Entry(o.name, to, o.shape, (), lambda _: from_mx(self.array().astype(MX_DTYPES[to])), None, note,
                     reads=self.nbytes)


class _Part:
    """The compute of a quantized weight's part ``k``: taken from its job (the entry reads no inputs itself).
    ``shared``: the work it is part of, which a sample run keeps only for its sampled entries (``io.sample``)."""

    def __init__(self, job: QuantJob, k: int):
        self.shared, self.k = job, k

    def __call__(self, _) -> RawTensor | Placed:
        return self.shared.part(self.k)

    def place(self, path, offset: int) -> None:
        """Where the part's bytes go (``OutTensor.place``): the job's worker may write them there."""
        self.shared.place(self.k, path, offset)


def _part(job: QuantJob, k: int) -> Callable[[list], RawTensor | Placed]:
    return _Part(job, k)


def plan_outputs(ckpt, tg, view: list[Entry], outputs: list[Output], cast: str | None, chosen: dict[str, dict],
                 qshapes: dict[str, tuple[int, ...]]) -> tuple[list[Entry], list[QuantJob]]:
    """The entries writing ``outputs``, cast (where the model's ``cast_predicate`` allows) and quantized as
    ``chosen`` (module path -> parameters; ``qshapes``: the quantized model's parameter shapes).

    Returns:
        (entries, quantization jobs).
    """
    by_name = {e.name: e for e in view}
    state: dict = {}

    def run() -> SanitizeRun:
        if "run" not in state:
            state["run"] = SanitizeRun(tg.fresh, lambda: load_inputs(ckpt, view))
        return state["run"]

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
                           None if src.inputs else src.array)
            jobs.append(job)
            how = f"mx.quantize {b}-bit group {g} {mode}{' after cast to ' + to if to else ''} {src.note()}".rstrip()
            parts = ("weight", "scales", "biases")
            for k, (st, shape) in enumerate(part_specs(o.shape, to or o.dtype, g, b, mode)):
                name = f"{module}.{parts[k]}"
                if name in qshapes and tuple(qshapes[name]) != tuple(shape):
                    raise RuntimeError(f"internal error: {name} planned {list(shape)}, MLX's model {list(qshapes[name])}")
                entries.append(Entry(name, st, shape, (), _part(job, k), None, f"{parts[k]} of {how}",
                                     reads=src.nbytes if k == 0 else 0))
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
            t = e.compute([ckpt[n] for n in e.inputs])
            out[e.name] = to_mx(torch_bytes(t), e.st_dtype, tuple(t.shape))
    return out
