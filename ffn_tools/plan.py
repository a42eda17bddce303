"""Every command is a plan, then a stream (``ffn_tools.executor``).

A ``Plan`` has one ``Entry`` per output tensor saying how it is made from input tensors. ``--dry-run``
prints it; ``executor.execute`` streams it into its output.

An entry has two equivalent recipes: ``compute`` (a pure function of the input tensors, always present)
and, when the output is a pure rearrangement of contiguous byte runs of its inputs, ``pieces`` (byte
ranges the writer copies with ``copy_file_range``, the data never entering Python). The executor uses
``pieces`` whenever every input's bytes sit in a safetensors file; tests check both recipes agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .io.dtypes import as_st, nbytes, short_name
from .io.store import Checkpoint

DEQUANTIZED = "ffn_tools_dequantized_from"  # safetensors metadata: the quantization weights were read from


@dataclass(frozen=True)
class Entry:
    """One output tensor and how to make it.

    Attributes:
        name, dtype, shape: the output tensor.
        inputs: input tensor names ``compute`` receives, in order.
        compute: pure function from the input tensors to the output tensor. One with a ``place(path, offset)``
            method is told where the output's bytes go in its file, and may write them there itself and return
            ``io.writer.Placed`` (a quantizing worker's bytes never pass through the writer).
        pieces: (input position, byte offset in that input, nbytes) runs whose concatenation is the
            output's bytes, or None when the output is not such a rearrangement.
        note: how it is made, for --dry-run ("rows 0:96 of X").
        reads: input bytes it consumes, for progress (None: its own size; a quantized weight reads more
            than it writes, its scales nothing).
        into: ``compute`` again, for an elementwise output of one input (a cast): ``into(src, out)`` writes into
            the flat tensor ``out`` the outputs of the flat input elements ``src``. Where the input's bytes lie in
            a file, the executor then makes the output a chunk at a time in reused buffers (``io.chunked``).
    """

    name: str
    dtype: Any  # torch dtype or safetensors dtype string
    shape: tuple[int, ...]
    inputs: tuple[str, ...]
    compute: Callable[[list], Any]  # list[torch.Tensor] -> torch.Tensor
    pieces: tuple[tuple[int, int, int], ...] | None
    note: str
    reads: int | None = None
    into: Callable[[Any, Any], object] | None = None

    @property
    def st_dtype(self) -> str:
        return as_st(self.dtype)

    # What the executor reads of an entry (and nothing else): ``apply``, ``pieces``, ``into``, ``place``, ``shared``.
    def apply(self, tensors: list):
        """The output tensor made from the input tensors (or ``io.writer.Placed``: written in place by ``place``)."""
        return self.compute(tensors)

    @property
    def place(self):
        """Where the output is written by its own maker, told its path and offset (a quantizing worker), or None."""
        return getattr(self.compute, "place", None)

    @property
    def shared(self):
        """The work this entry shares with others (a quantized weight's parts, made once for all), or None: an
        object with a settable ``wanted`` (False: no entry that needs it is written, and it is not done)."""
        return getattr(self.compute, "shared", None)

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def copy_entry(ckpt: Checkpoint, name: str, new_name: str | None = None) -> Entry:
    """An entry copying (and optionally renaming) one tensor byte for byte."""
    info = ckpt.info(name)
    note = "unchanged" if new_name in (None, name) else f"renamed from {name}"
    return Entry(new_name or name, info.st_dtype, info.shape, (name,), lambda ts: ts[0], ((0, 0, info.nbytes),), note)


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
    return Entry(name, dtype, info.shape, (name,), lambda ts: ts[0].to(dtype), None,
                 f"cast {short_name(info.dtype)} -> {short_name(dtype)}", into=lambda src, out: out.copy_(src))


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
