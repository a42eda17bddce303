"""What the writer is given: an output tensor (``OutTensor``) and what its producer may hand back for its bytes (a
tensor, an array, bytes, ``ByteRange``s of input files, or ``Placed``: written in place already). ``io.writer`` and
``io.shards`` both take these; neither is above the other."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO


@dataclass(frozen=True)
class ByteRange:
    """``nbytes`` bytes of ``file`` starting at absolute offset ``start``."""

    file: Path
    start: int
    nbytes: int


@dataclass(frozen=True)
class Placed:
    """A payload already in the file: its producer wrote its ``nbytes`` bytes at the offset ``OutTensor.place``
    gave it (a worker process, whose bytes then never pass through this one)."""

    nbytes: int


Payload = Any  # torch.Tensor | numpy.ndarray | bytes | memoryview | list[ByteRange] | Placed
Sources = dict[Path, BinaryIO]  # the input files byte ranges are copied from, opened once each


@dataclass(frozen=True)
class OutTensor:
    """A tensor to write: its header entry, and how to get its bytes when its turn comes."""

    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    nbytes: int
    produce: Callable[[], Payload]
    source_start: int | None = None  # where its bytes begin in their input file, when they are a copy
    reads: int | None = None  # input bytes it consumes, for progress (None: its own size, as for a copy)
    place: Callable[[Path, int], None] | None = None  # told the file and absolute offset its bytes go to, once the
    # file is open and at its full size: a producer may write them there itself and then produce ``Placed``
    stream: Callable[[], Iterable[Payload]] | None = None  # the same bytes as produce()'s, in chunks, each written
    # before the next is asked for (its buffer may be reused: io.chunked); writers that take whole tensors ignore it

    @property
    def progress_bytes(self) -> int:
        return self.nbytes if self.reads is None else self.reads
