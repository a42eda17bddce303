"""Stored tensors as read-only views of their files' pages: what comparing bytes as bytes reads.

``Mapped(ckpt)`` maps each safetensors file of ``ckpt`` once (``mmap``, read-only) and gives a tensor whose bytes
lie in a file (``TensorInfo.start``) as a view of its pages: nothing is copied and no memory of its own is
allocated, so comparing two such tensors (``torch.equal``) reads the page cache once, at memory speed (a ``pread``
into fresh memory costs a page fault and a copy per page: 3.5x slower on a 3.3 GB FP8 pair). Any other tensor
(a pickle's, a computed one) is read from ``ckpt`` as usual.

The pages a view touched stay mapped into this process (and count in its RSS) until ``release()``, which the
caller runs after each unit of work (``madvise(MADV_DONTNEED)``: the mapping forgets them, the page cache keeps
them), so what is held stays one unit's worth whatever the size of the model. The views are never written (the
mapping is read-only: a write would fault); they must not outlive ``close()``.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .store import Checkpoint


class Mapped(Mapping):
    """``ckpt``'s tensors, those stored as plain bytes in a file as views of its mapped pages (see the module
    docstring)."""

    def __init__(self, ckpt: "Checkpoint"):
        self.ckpt = ckpt
        self._maps: dict[Path, mmap.mmap] = {}
        self._touched: list[tuple[mmap.mmap, int, int]] = []

    def _map(self, file: Path) -> mmap.mmap:
        m = self._maps.get(file)
        if m is None:
            with open(file, "rb") as f:
                m = self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return m

    def __getitem__(self, name: str) -> "torch.Tensor":
        import torch

        info = self.ckpt.info(name)
        if info.start is None or info.nbytes == 0:
            return self.ckpt[name]
        m = self._map(info.file)
        with warnings.catch_warnings():  # "not writable": the views are only read (see the module docstring)
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(m, dtype=torch.uint8, count=info.nbytes, offset=info.start)
        self._touched.append((m, info.start, info.nbytes))
        return t.view(info.dtype).reshape(info.shape)

    def release(self, done: bool = True) -> None:
        """Unmap the pages the views handed out so far touched: a view read again after it faults its pages back in
        from the page cache (the mapping is the file's). ``done``: the views are finished with, forget them; False:
        some are still to be read (the next part of an FFN), so release their pages again next time."""
        page = mmap.PAGESIZE
        for m, start, n in self._touched:
            first = start - start % page
            m.madvise(mmap.MADV_DONTNEED, first, start + n - first)
        if done:
            self._touched.clear()

    def close(self) -> None:
        self._touched.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes when it does
                pass
        self._maps.clear()

    def __contains__(self, name: object) -> bool:
        return name in self.ckpt

    def __iter__(self) -> Iterator[str]:
        return iter(self.ckpt)

    def __len__(self) -> int:
        return len(self.ckpt)
