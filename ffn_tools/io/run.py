"""A run's options, as one plain value: what the one executor (``executor.execute``) and the output's writer
(``io.output.atomic_output``) are told, explicitly, instead of reading ambient state.

The command (``api``) makes the part it knows (``command``, ``resume``, ``ray``; ``hash_limit`` for ``--dry-run``'s
sample run) and hands it down; whoever builds the plan adds the output's part (``out``, ``force``,
``max_shard_size``, ``metadata``, ``desc``, ``carry``, ``extra_files``, ``writer``) with ``but``. It is frozen and
holds only data (a ``Writer`` is a small object of plain fields), so it travels to a Ray task as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True, eq=False)
class Run:
    """How one run writes its output.

    Attributes:
        out: the output path (a weight file ending in the writer's suffix, or a directory of shards).
        force: replace an existing output (one that looks like an earlier output).
        max_shard_size: the largest shard of a directory output, in bytes (None: the writer's default).
        resume: continue the unfinished output a killed run of the same command left (``io.resume``).
        command: the receipt's record of the command, ``(name, options)`` (``io.receipt.record``); None: a
            library call below the ``api`` (the receipt says none).
        ray: ``--ray``'s address (``cluster.LOCAL``: a Ray started here); None: one process writes.
        hash_limit: the bytes of input the receipt hashes (None: all; ``--dry-run``'s sample run hashes its
            share).
        metadata: the weight files' metadata (None: the input's).
        desc: what the progress bar says (and part of the resume key: the command).
        carry: copy the input's non-weight files into a directory output.
        extra_files: more files (name -> text, or bytes) to write into a directory output.
        writer: the weight files' format (an ``io.writer.Writer``; None: safetensors).
        estimate: under ``--dry-run``, the estimate of the run is asked for (``ffn_tools.estimate``): the time
            (``time.time()``) the command began, its start-up measured from it; None: none. The command's dry run
            then hands its plan and this run to ``estimate.priced`` instead of ``executor.execute``.
    """

    out: Path | None = None
    force: bool = False
    max_shard_size: int | None = None
    resume: bool = False
    command: tuple[str, dict] | None = None
    ray: str | None = None
    hash_limit: int | None = None
    metadata: Mapping[str, str] | None = None
    desc: str = "writing"
    carry: bool = True
    extra_files: Mapping[str, str | bytes] | None = None
    writer: Any = None  # an io.writer.Writer (typed loosely: writer imports this module's users)
    estimate: float | None = None

    def but(self, **changes) -> Run:
        """This run with ``changes`` (an ``out`` given as a string becomes a ``Path``)."""
        if isinstance(changes.get("out"), str):
            changes["out"] = Path(changes["out"])
        return replace(self, **changes)


NO_RUN = Run()  # a library call below the api: no receipt command, no --resume, no --ray
