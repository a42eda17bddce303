"""Every command is a plan, then a stream (``ffn_tools.executor``).

A ``Plan`` has one ``Entry`` per output tensor saying how it is made from input tensors. ``--dry-run``
prints it; ``executor.execute`` streams it into its output.

An entry's recipe is data: a tuple of ``ffn_tools.ops`` applied to its inputs (``Entry.apply``). Where every op
is a pure move of contiguous byte runs, the same ops give ``pieces`` (byte ranges the writer copies with
``copy_file_range``, the data never entering Python). The executor uses ``pieces`` whenever every input's bytes
sit in a safetensors file; tests check both recipes agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from . import ops as oplib
from .io.dtypes import as_st, itemsize, nbytes, short_name
from .io.store import Checkpoint
from .ops import MAX_RUNS, Cast, Copy, Op

RUN_BYTES = 1 << 12  # runs averaging a page or more are worth copying as runs, however many (a 300-expert stack)

DEQUANTIZED = "ffn_tools_dequantized_from"  # safetensors metadata: the quantization weights were read from


@dataclass(frozen=True)
class Entry:
    """One output tensor and how to make it: ``ops`` (``ffn_tools.ops``) applied to its input tensors.

    Attributes:
        name, dtype, shape: the output tensor.
        inputs: input tensor names the ops receive, in order.
        ops: the steps making the output from the inputs (data: picklable, reversible where they can be); one op
            is taken as a tuple of one.
        reads: input bytes it consumes, for progress (None: its own size; a quantized weight reads more
            than it writes, its scales nothing).
        sources: the inputs' (dtype, shape) as stored, from which ``pieces`` is derived (None: not derived).
        text: the --dry-run note where the plan words it itself (None: the ops' own words).

    Raises:
        TypeError: ``ops`` not ops (a callable: the closure shape entries had before ops is gone).
    """

    name: str
    dtype: Any  # torch dtype or safetensors dtype string
    shape: tuple[int, ...]
    inputs: tuple[str, ...]
    ops: tuple[Op, ...]
    _: KW_ONLY
    reads: int | None = None
    sources: tuple[tuple[str, tuple[int, ...]], ...] | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        ops = (self.ops,) if isinstance(self.ops, Op) else self.ops
        if not isinstance(ops, (tuple, list)) or not all(isinstance(op, Op) for op in ops):
            raise TypeError(f"{self.name}: Entry's ops are a tuple of ffn_tools.ops, not {self.ops!r}")
        object.__setattr__(self, "ops", tuple(ops))
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "inputs", tuple(self.inputs))

    @property
    def st_dtype(self) -> str:
        return as_st(self.dtype)

    @property
    def note(self) -> str:
        """How it is made, for --dry-run ("rows 0:96 of X")."""
        if self.text is not None:
            return self.text
        return f"{oplib.describe(self.ops)} of {', '.join(self.inputs)}"

    # What the executor reads of an entry (and nothing else): ``apply``, ``pieces``, ``into``, ``place``, ``shared``.
    def apply(self, tensors: list):
        """The output tensor made from the input tensors (or ``io.writer.Placed``: written in place by ``place``)."""
        out = oplib.run(self.ops, tensors)
        if len(out) != 1:
            raise RuntimeError(f"internal error: {self.name}'s ops made {len(out)} tensors, not one")
        return out[0]

    @cached_property
    def pieces(self) -> tuple[tuple[int, int, int], ...] | None:
        """(input position, byte offset in that input, nbytes) runs whose concatenation is the output's bytes, or
        None when the output is not such a rearrangement (or of more runs than copying is worth: more than
        ``MAX_RUNS`` per pair of inputs, unless its runs average ``RUN_BYTES`` or more, as the experts of a stack
        of hundreds do)."""
        if self.sources is None:
            return None
        views = [oplib.View(tuple(shape), itemsize(dt), ((k, 0, nbytes(dt, shape)),))
                 for k, (dt, shape) in enumerate(self.sources)]
        cap = max(MAX_RUNS * max(1, len(self.inputs) // 2), self.nbytes // RUN_BYTES)
        out = oplib.runs(self.ops, views, cap)
        if out is None or len(out) != 1 or out[0].nbytes != self.nbytes:
            return None
        return out[0].runs

    @property
    def into(self) -> Callable[[Any, Any], object] | None:
        """For an elementwise output of one input (a cast): ``into(src, out)`` writes into the flat tensor ``out``
        the outputs of the flat input elements ``src``. Where the input's bytes lie in a file, the executor then
        makes the output a chunk at a time in reused buffers (``io.chunked``)."""
        return self.ops[0].into if len(self.ops) == 1 and self.ops[0].elementwise else None

    @property
    def place(self):
        """Where the output is written by its own maker, told its path and offset (a quantizing worker), or None:
        the last op's declared ``placement``."""
        return self.ops[-1].placement if self.ops else None

    @property
    def shared(self):
        """The work this entry shares with others (a quantized weight's parts, made once for all), or None: an
        object with a settable ``wanted`` (False: no entry that needs it is written, and it is not done)."""
        return next((s for op in self.ops if (s := op.shares) is not None), None)

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def source(ckpt: Checkpoint, name: str) -> tuple[str, tuple[int, ...]]:
    """Input ``name``'s (dtype, shape) as ``Entry.sources`` takes it."""
    info = ckpt.info(name)
    return info.st_dtype, tuple(info.shape)


def copy_entry(ckpt: Checkpoint, name: str, new_name: str | None = None) -> Entry:
    """An entry copying (and optionally renaming) one tensor byte for byte."""
    info = ckpt.info(name)
    note = "unchanged" if new_name in (None, name) else f"renamed from {name}"
    return Entry(new_name or name, info.st_dtype, info.shape, (name,), (Copy(),), sources=(source(ckpt, name),),
                 text=note)


@dataclass
class Plan:
    """What a command will write.

    Attributes:
        source: the input checkpoint.
        entries: the output tensors, in write order.
        config: the config.json to write (None: none).
        changes: human-readable lines on what changes beyond tensors (config, names), printed and in JSON.
        summary: machine-readable facts about the plan for --json.
        also_read: files the entries read besides ``source``'s (merge: the adapter): inputs too, so the output
            may not overwrite them and a changed one makes another run for ``--resume``.
    """

    source: Checkpoint
    entries: list[Entry]
    config: dict | None
    changes: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    also_read: list[Path] = field(default_factory=list)

    def describe(self) -> list[str]:
        """One line per output tensor: ``name  dtype[shape]  <- how``."""
        return [f"{e.name}  {short_name(e.dtype)}{list(e.shape)}  \u2190 {e.note}" for e in self.entries]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def read_bytes(self) -> int:
        """Input bytes the plan consumes: what progress counts."""
        return sum(e.nbytes if e.reads is None else e.reads for e in self.entries)


def dequantized_line(plan: Plan, fmt: str) -> list[str]:
    """The changes line of a plan whose source view reads quantized weights dequantized (compressed-tensors,
    GPTQ/AWQ, MXFP4, FP8) into a format that holds no quantized form here: [] where none is."""
    ckpt = plan.source
    quantized = {n for e in plan.entries for n in e.inputs if ckpt.quantized(n)}
    if not quantized:
        return []
    return [f"dequantized {len(quantized)} quantized weights, as read ({ckpt.label}): {fmt} has no quantized form "
            "here"]


def cast_entry(ckpt, name: str, dtype) -> Entry:
    """Copy a tensor, casting it to ``dtype`` if it is floating and differs."""
    info = ckpt.info(name)
    if dtype is None or not info.dtype.is_floating_point or info.dtype == dtype:
        return copy_entry(ckpt, name)
    return Entry(name, dtype, info.shape, (name,), (Cast(as_st(dtype), info.st_dtype),),
                 text=f"cast {short_name(info.dtype)} -> {short_name(dtype)}")


def unquantized_config(config: dict | None, target) -> tuple[dict | None, list[str]]:
    """A copy of ``config`` for unquantized weights in dtype ``target`` (None: unchanged), and what changed."""
    if config is None:
        return None, []
    config, changes = dict(config), []
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    if target is not None:
        config["dtype"] = short_name(target)
        config.pop("torch_dtype", None)
        changes.append(f"config.json: dtype set to {short_name(target)}")
    return config, changes
