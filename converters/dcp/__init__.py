"""torch.distributed.checkpoint (DCP) format: the directories PyTorch training runs save (torchtitan, FSDP).

A directory holds ``.metadata`` (a pickle of the keys, shapes, dtypes and where each chunk lies:
``converters.dcp.metadata``) and one ``__R_0.distcp`` per rank (chunks, each a ``torch.save``). Read lazily from
the metadata, without ``torch.distributed`` (``reader``); written as torch's ``FileSystemWriter`` writes, sharded
for ``--dcp-ranks`` ranks (``writer``), from a plan run by the one executor (``export``). Keys are torchtitan's
model names or Hugging Face's (``names``, ``--dcp-naming``). Only torch is needed; bytes are moved, never
converted, so round trips are bit-exact.
"""

from __future__ import annotations

from pathlib import Path

from ffn_tools.errors import FFNToolsError
from ffn_tools.formats import Format, Option
from ffn_tools.io.dtypes import parse_user_dtype
from ffn_tools.io.store import Checkpoint
from ffn_tools.estimate import priced
from ffn_tools.executor import execute
from ffn_tools.io.run import NO_RUN, Run

from .export import build_plan
from .metadata import METADATA
from .names import NAMINGS
from .reader import DcpCheckpoint, root_of
from .writer import DcpWriter

__all__ = ["FORMAT", "NAMINGS"]


class Dcp(Format):
    name = "dcp"
    options = (Option("dcp_naming", "DCP only: torchtitan = the keys of torchtitan's model of the architecture, as its "
                      "state-dict adapter maps Hugging Face names (default; Llama, Qwen3, Qwen3-MoE, DeepSeek-V3); hf = "
                      "the Hugging Face names as they are.", choices=NAMINGS),
               Option("dcp_ranks", "DCP only: the world size the output is sharded for (default 1): each tensor cut "
                      "along dim 0, one __R_0.distcp per rank.", type=int, minimum=1))
    takes = frozenset({"dry_run"})
    detect_order = 30
    owns = ("*.distcp", METADATA)  # every rank's file and the metadata pointing into them

    def can_read(self, path: Path) -> bool:
        """A directory holding ``.metadata`` and ``.distcp`` files, or that ``.metadata``."""
        root = root_of(Path(path))
        return root.is_dir() and (root / METADATA).is_file() and any(root.glob("*.distcp"))

    def read(self, path: Path, absent_shards: bool = False, like: Checkpoint | None = None) -> DcpCheckpoint:
        """A DCP directory opened lazily with Hugging Face names.

        Raises:
            CheckpointError: no or an unreadable ``.metadata``, data files missing, names of no known naming.
        """
        return DcpCheckpoint(Path(path))

    def export(self, ckpt: Checkpoint, out: Path, **options) -> dict:
        return export(ckpt, out, **options)

    def recipe(self, ckpt: Checkpoint, dtype: str | None, quantized: bool) -> dict | None:
        return None if quantized else {"dtype": dtype, "dcp_naming": getattr(ckpt, "naming", "torchtitan")}

    runtimes = ("transformers",)

    def load_runtime(self, name: str):
        from .client import DcpClient

        return DcpClient()


FORMAT = Dcp()


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, dcp_naming: str | None = None, dcp_ranks: int | None = None,
           dry_run: bool = False, run: Run = NO_RUN) -> dict:
    """Write ``ckpt`` as a DCP directory: ``__R_0.distcp`` per rank, ``.metadata``, config.json and the tokenizer.

    Args:
        dcp_naming: "torchtitan" (default: torchtitan's model names, as its state-dict adapter maps them) or "hf".
        dcp_ranks: the world size the tensors are sharded for (default 1), along dim 0.
        dry_run: plan only; ``plan`` in the summary lists every key and how it is made.

    Returns:
        Summary: output, format, naming, ranks, files, tensors, bytes, changes.

    Raises:
        FFNToolsError: --max-shard-size (a DCP has a file per rank), ranks below 1, a naming the model has none of.
    """
    if max_shard_size:
        raise FFNToolsError("--max-shard-size does not apply to --to dcp: it writes one file per rank (--dcp-ranks)")
    ranks = 1 if dcp_ranks is None else int(dcp_ranks)
    if ranks < 1:
        raise FFNToolsError(f"--dcp-ranks {ranks}: a world size is at least 1")
    naming = dcp_naming or "torchtitan"
    plan = build_plan(ckpt, naming, parse_user_dtype(dtype) if dtype else None)
    out = Path(out)
    made = run.but(out=out, force=force, desc=f"converting to dcp ({naming})", writer=DcpWriter(ranks))
    files = [] if dry_run else execute(plan, made)
    summary = {"output": str(out), "format": "dcp", "naming": naming, "ranks": ranks, "files": files,
               "tensors": len(plan.entries), "bytes": plan.total_bytes,
               "changes": [*plan.changes, f"sharded for {ranks} rank(s) along dim 0"]}
    return {**summary, "plan": plan.describe(), **priced(plan, made)} if dry_run else summary
