"""How a directory output is cut into shards, named, indexed and, under ``--resume``, which shards are kept: what
``io.writer.write_sharded`` and ``--ray``'s driver (``cluster.write_sharded``) share."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..sizes import human
from .safetensors_format import PAGE, build_header, header_entry_size

if TYPE_CHECKING:
    from ..progress import Progress
    from .resume import Ledger
    from .outtensor import OutTensor


def plan_shards(items: Sequence[OutTensor], max_shard_size: int | None, metadata: dict | None) -> list[list[OutTensor]]:
    """Split ``items`` into consecutive shards whose files are each at most ``max_shard_size`` bytes."""
    if not max_shard_size:
        return [list(items)] if items else [[]]
    meta_len = len(build_header([], metadata)) - 8
    shards: list[list[OutTensor]] = []
    cur: list[OutTensor] = []
    data = 0
    head = meta_len
    aligned = False  # does the current shard copy bytes (then its header may be padded up to a page)?
    for t in items:
        add = header_entry_size(t.name, t.dtype, t.shape, data, t.nbytes)
        pad = 8 + (PAGE if aligned or t.source_start is not None else 0)  # worst-case header padding
        if cur and 8 + head + add + pad + data + t.nbytes > max_shard_size:
            shards.append(cur)
            cur, data, head, aligned = [], 0, meta_len, False
            add = header_entry_size(t.name, t.dtype, t.shape, 0, t.nbytes)
        aligned = aligned or t.source_start is not None
        cur.append(t)
        data += t.nbytes
        head += add
    shards.append(cur)
    return shards


def like_input(files: Sequence[Path], out: Path, max_shard_size: int | None) -> tuple[int | None, str | None]:
    """The shard size of a directory output of a sharded input when none was given: the input's largest file (a
    16 GB checkpoint of 2 GB shards pruned into one 12 GB file loads as slowly as a file that size, and its digest
    can be made only once it is whole). (size, the change that says so), or as given (and no change)."""
    if max_shard_size is not None or len(files) < 2 or out.suffix == ".safetensors":
        return max_shard_size, None
    size = max(f.stat().st_size for f in files)
    return size, f"shards of at most {human(size)}, like the input's largest (--max-shard-size to change)"


def shard_names(n: int, prefix: str = "model") -> list[str]:
    """Hugging Face shard names: model.safetensors alone, else model-00001-of-0000N.safetensors."""
    if n == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def kept(ledger: Ledger | None, name: str, shard: Sequence[OutTensor], progress: Progress | None) -> bool:
    """Whether the resume ledger says shard ``name`` is finished (then it is counted done); else it is about to be
    written (again), and its manifest no longer holds."""
    if ledger is not None and ledger.reusable(name):
        if progress:
            progress.update(sum(t.progress_bytes for t in shard))
        return True
    if ledger is not None:
        ledger.forget(name)
    return False


def write_index(out_dir: Path, items: Sequence[OutTensor], shards: list[list[OutTensor]], names: list[str],
                prefix: str = "model") -> None:
    """The Hugging Face index of a sharded output (none for one shard)."""
    if (text := index_text(items, shards, names)) is not None:
        (out_dir / f"{prefix}.safetensors.index.json").write_text(text)


def index_text(items: Sequence[OutTensor], shards: list[list[OutTensor]], names: list[str]) -> str | None:
    """The text of a sharded output's Hugging Face index; None for one shard (it has none)."""
    if len(shards) <= 1:
        return None
    weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
    index = {"metadata": {"total_size": sum(t.nbytes for t in items)}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2) + "\n"
