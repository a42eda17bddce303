"""Reading the tensors the next FFN checks need while the current ones run, within a byte budget.

``TensorStream(sources, steps, budget)`` is told, per step of ``verify`` (one FFN pair, or a batch of routed
experts), which tensors it reads: ``(side, name)``, side 0 for A and 1 for B. A background thread reads them
in that order, ``READERS`` at a time (``ckpt[name]``: ``pread`` into memory of its own, which releases the
GIL, so reading step k+1 overlaps the bit-exact comparisons and GEMMs of step k, which release it too). ``stream.side(0)`` and
``stream.side(1)`` are the mappings the checks read through; ``stream.done(k)`` ends step k.

Memory: a tensor is held from its read until the last step that uses it is done (a stacked experts tensor
serves every expert of its layer) and then dropped; the thread always reads what the current step needs, and
reads ahead of it only while what the stream holds stays within ``budget`` bytes (at most twice the largest
step's). So verify holds at most the larger of the current step's tensors and that budget, whatever the size
of the model.

``Streamed(ckpt, stream.side(k))`` is ``ckpt`` read through a stream, for a reader that reads in its own order
(the outside comparison): asking for a later step's tensor ends the earlier steps (``advance``).

Only readers that read with ``pread`` (``Checkpoint.preads``: safetensors, pickles) are read in the background;
any other checkpoint (MLX, Flax, native: views over other frameworks' arrays) is read when a check asks, in its
thread, with the same hold-and-drop.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from ..io.raw import RawTensor
from ..io.store import Checkpoint, TensorInfo

if TYPE_CHECKING:
    import torch

READ_AHEAD_BYTES = 256 << 20  # held while reading ahead (the current step is read whatever its size); more saved no time
PENDING, READING, HELD, FAILED, DONE = "pending", "reading", "held", "failed", "done"
READERS = 2  # reading threads: a pread into fresh memory is CPU work too (page faults, copying)

Key = tuple[int, str]


class TensorStream:
    """The tensors of ``steps`` (per step, the (side, name) keys it reads) from ``sources`` (A, B), read ahead.

    Each planned tensor is in one state (``_state``): PENDING (no reader has taken it), READING, HELD, FAILED
    (its read raised; the error goes to the check that asks) or DONE (dropped after its last step, or skipped).
    A check waits only for a tensor of the current step that is READING, or PENDING while a reader is alive:
    the readers take tensors in the order of their first step, so one of this step's is never behind a reader
    waiting for budget. Anything else (a later step's tensor, one asked for again after its last step, any
    tensor once the readers have ended) is read at once in the asking thread, so no ask waits on a tensor
    no thread will bring. A reader that ends, by an error or by the end of the plan, says so (``_alive``).
    """

    def __init__(self, sources: Sequence[Checkpoint], steps: Sequence[Sequence[Key]], budget: int = READ_AHEAD_BYTES,
                 advance: bool = False):
        self.sources, self.advance = list(sources), advance
        self._first: dict[Key, int] = {}
        self._last: dict[Key, int] = {}
        for k, keys in enumerate(steps):
            for key in keys:
                self._first.setdefault(key, k)
                self._last[key] = k
        self._ending: dict[int, list[Key]] = defaultdict(list)
        for key, k in self._last.items():
            self._ending[k].append(key)
        self._size = {key: self.sources[key[0]].info(key[1]).nbytes for key in self._first}
        largest = max((sum(self._size[key] for key in set(keys)) for keys in steps), default=0)
        self.budget = min(budget, 2 * largest)  # two steps are ahead enough: flat memory for any model size
        self._order = [key for key in self._first if self.sources[key[0]].preads]
        self._state: dict[Key, str] = dict.fromkeys(self._order, PENDING)
        self._held: dict[Key, torch.Tensor] = {}
        self._failed: dict[Key, BaseException] = {}
        self._bytes = 0
        self._step = 0  # steps done
        self._stopped = False
        self._cond = threading.Condition()
        self._next = 0  # the index in _order of the next key a reader takes
        self._threads = [threading.Thread(target=self._run, name=f"ffn-tools-read-ahead-{k}", daemon=True)
                         for k in range(READERS if self._order else 0)]
        self._alive = 0

    def __enter__(self) -> "TensorStream":
        for t in self._threads:
            with self._cond:
                self._alive += 1
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stop the readers and wait for them (each is at most one ``pread`` from seeing it), drop all."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join()
        self._held.clear()
        self._bytes = 0

    def side(self, side: int) -> "StreamSide":
        """The mapping the checks read side ``side`` (0: A, 1: B) through."""
        return StreamSide(self, side)

    def _run(self) -> None:
        try:
            while (key := self._take()) is not None:
                try:
                    t = self.sources[key[0]][key[1]]
                except BaseException as e:  # raised where a check asks for it, as its own read would have
                    with self._cond:
                        self._bytes -= self._size[key]
                        self._failed[key] = e
                        self._state[key] = FAILED
                        self._stopped = True  # what follows is read by the checks themselves
                    return
                with self._cond:
                    if self._state[key] == READING and self._last[key] >= self._step:
                        self._state[key] = HELD
                        self._held[key] = t
                    else:  # read on demand meanwhile (HELD), or its last step is done (DONE)
                        self._bytes -= self._size[key]
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._alive -= 1
                self._cond.notify_all()

    def _take(self) -> Key | None:
        """The next key to read, its bytes reserved (READING), waiting while it would pass the budget; None
        at the end of the plan or when stopped."""
        with self._cond:
            while True:
                if self._stopped or self._next >= len(self._order):
                    return None
                key = self._order[self._next]
                if self._state[key] == PENDING and self._last[key] < self._step:
                    self._state[key] = DONE  # every step that reads it is done
                if self._state[key] != PENDING:  # read on demand already, or done
                    self._next += 1
                    continue
                if (self._bytes and self._first[key] > self._step
                        and self._bytes + self._size[key] > self.budget):
                    self._cond.wait()  # read ahead only within the budget
                    continue
                self._next += 1
                self._state[key] = READING
                self._bytes += self._size[key]  # reserved: the other reader sees it
                return key

    def _coming(self, key: Key) -> bool:
        """A reader is bringing ``key`` for the current step: wait for it (called with the lock held)."""
        state = self._state.get(key)
        if state == READING:
            return True
        return state == PENDING and self._alive > 0 and not self._stopped and self._first[key] <= self._step

    def get(self, side: int, name: str) -> "torch.Tensor":
        """Tensor ``name`` of side ``side``: as read ahead (waiting for a reader only while one is bringing
        it for this step), else read now, and held until its last step when the plan has it. With
        ``advance``, asking for a later step's tensor ends the steps before it (for a reader that does not
        call ``done``)."""
        key = (side, name)
        if self.advance and self._first.get(key, -1) > self._step:  # a later step's: the earlier ones are done
            for k in range(self._step, self._first[key]):
                self.done(k)
        with self._cond:
            while self._coming(key):
                self._cond.wait()
            if key in self._held:
                return self._held[key]
            if key in self._failed:
                self._state[key] = DONE  # raised once; asked again, it is read again
                raise self._failed.pop(key)
        t = self.sources[side][name]
        if key in self._first:
            with self._cond:
                if key in self._held:  # a reader brought it meanwhile
                    return self._held[key]
                if self._last[key] >= self._step:
                    self._held[key] = t
                    self._bytes += self._size[key]
                    self._state[key] = HELD
                self._cond.notify_all()
        return t

    @property
    def held_bytes(self) -> int:
        """Bytes of the tensors held now (read ahead, being read, or used by the current step)."""
        return self._bytes

    def done(self, step: int) -> None:
        """Step ``step`` is checked: drop what no later step reads, and let the readers read further ahead."""
        with self._cond:
            for key in self._ending.pop(step, ()):
                if self._held.pop(key, None) is not None:
                    self._bytes -= self._size[key]
                if self._state.get(key) in (HELD, PENDING):
                    self._state[key] = DONE  # a READING one is dropped by its reader
            self._step = step + 1
            self._cond.notify_all()


class StreamSide(Mapping[str, "torch.Tensor"]):
    """One side of a ``TensorStream``: the read-only mapping ``canonical_weights`` and the checks read."""

    def __init__(self, stream: TensorStream, side: int):
        self.stream, self.index = stream, side

    def __getitem__(self, name: str) -> "torch.Tensor":
        return self.stream.get(self.index, name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.stream.sources[self.index]

    def __iter__(self) -> Iterator[str]:
        return iter(self.stream.sources[self.index])

    def __len__(self) -> int:
        return len(self.stream.sources[self.index])


class Streamed(Checkpoint):
    """``ckpt`` with its tensors read through one side of a ``TensorStream`` (``advance``): what ``verify``
    hands the comparison of the tensors outside the FFNs, which reads them in its own order. Everything
    else is ``ckpt``'s. Only for checkpoints read in the background (``Checkpoint.preads``)."""

    def __init__(self, ckpt: Checkpoint, side: StreamSide):
        super().__init__(ckpt.path, ckpt.root, ckpt.files, {n: ckpt.info(n) for n in ckpt}, ckpt.metadata,
                         ckpt.config)
        self.raw, self.through = ckpt, side
        self.view_of(ckpt)
        self.resolves_quantization = ckpt.resolves_quantization

    def _read(self, info: TensorInfo) -> "torch.Tensor":
        return self.through[info.name]

    def read_raw(self, name: str) -> RawTensor:
        return self.raw.read_raw(name)

    def quantized(self, name: str):
        return self.raw.quantized(name)

    def quantized_parts(self, name: str):
        return self.raw.quantized_parts(name)

    @property
    def stored(self) -> Checkpoint:
        return self.raw.stored

    @property
    def label(self) -> str:
        return self.raw.label

    def decoded(self) -> list[dict]:
        return self.raw.decoded()
