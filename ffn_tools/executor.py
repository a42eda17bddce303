"""The one executor: a ``plan.Plan`` streamed into its output.

``execute`` streams a plan into shards in a temporary path renamed into place only when everything succeeded,
then carries config.json and the tokenizer/generation files over. Shards are safetensors unless the caller passes
another ``io.writer.Writer`` (the Flax export's msgpack trees): every format's output goes through this one executor.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from . import cluster
from .errors import FFNToolsError
from .formats import owner_of
from .io import receipt
from .io.dtypes import as_st, torch_dtype
from .io.output import atomic_output
from .io.resume import Ledger, input_stamp, plan_key
from .io.run import Run
from .io.store import SIDE_FILES, WEIGHT_INDEXES, WEIGHT_SUFFIXES, Checkpoint
from .io.writer import SAFETENSORS, ByteRange, OutTensor, Placed
from .plan import Entry, Plan
from .progress import Progress
from .sizes import human

log = logging.getLogger(__name__)

# Carried beside a single .safetensors input (a directory input carries every non-weight file): config.json and the
# side files a client reads (``io.store.SIDE_FILES``, those named alone: a file beside it, not a pattern).
KNOWN_SIDE_FILES = ("config.json", *(n for n in SIDE_FILES if "*" not in n))


def out_tensor(e: Entry, ckpt: Checkpoint, cache: dict) -> OutTensor:
    """``e``'s output tensor as the writer takes it (its bytes made when the writer asks: nothing is read here);
    ``cache`` holds the inputs one entry's neighbours share. The estimate sizes a plan's output with it."""
    infos = [ckpt.info(n) for n in e.inputs]

    def produce():
        if e.pieces is not None and all(i.start is not None for i in infos):
            return [ByteRange(infos[k].file, infos[k].start + off, n) for k, off, n in e.pieces]
        for n in [n for n in cache if n not in e.inputs]:
            del cache[n]  # keep only this entry's inputs alive (a stacked tensor serves E entries)
        tensors = [cache[n] if n in cache else cache.setdefault(n, ckpt[n]) for n in e.inputs]
        out = e.apply(tensors)
        if isinstance(out, Placed):  # written into the output by the compute itself (the writer checks its size)
            return out
        if as_st(out.dtype) != e.st_dtype or tuple(out.shape) != tuple(e.shape):
            raise RuntimeError(f"internal error: {e.name} computed {out.dtype}{list(out.shape)}, "
                               f"planned {e.dtype}{list(e.shape)}")
        return out

    stream = None
    if e.into is not None and e.pieces is None and len(infos) == 1 and infos[0].start is not None:
        from .io import chunked

        stream = partial(chunked.chunks, infos[0], torch_dtype(e.dtype), e.into)
    start = None
    starts = [i.start for i in infos if i.start is not None]
    if e.pieces and len(starts) == len(infos):  # every input's bytes lie in its file: starts[k] is infos[k]'s
        k, off, _ = e.pieces[0]
        start = starts[k] + off
    return OutTensor(e.name, e.st_dtype, tuple(e.shape), e.nbytes, produce, start, e.reads,
                     e.place, stream)


def write_slice(source: Checkpoint, entries: Sequence[Entry], out_dir: str, name: str,
                metadata: dict) -> tuple[str, int]:
    """A ``--ray`` task's work (``cluster.write_sharded``): one shard's ``entries``, the driver's plan slice, read
    from ``source`` (opened again here: ``io.store.Checkpoint.__reduce__``) and written as shard ``name`` of the
    driver's temporary output ``out_dir``; (name, size)."""
    from .io.sample import keep_shared

    keep_shared(entries, range(len(entries)))  # a quantization pool works on this shard's entries only
    cache: dict = {}
    items = [out_tensor(e, source, cache) for e in entries]
    return cluster.write_part(Path(out_dir), name, items, metadata)


def side_files(ckpt: Checkpoint) -> list[Path]:
    """Non-weight files to carry over: all of a directory input's but a format's own (``formats.owner_of``: a
    DCP's rank files, Orbax's metadata), or the known ones beside a file."""
    if ckpt.path.is_dir() or ckpt.path.name.endswith(".index.json"):
        return sorted(p for p in ckpt.root.iterdir() if p.is_file() and not p.name.startswith(".")
                      and p.suffix not in WEIGHT_SUFFIXES and p.name not in (*WEIGHT_INDEXES, receipt.NAME)
                      and owner_of(p.name) is None)
    return [ckpt.root / n for n in KNOWN_SIDE_FILES if (ckpt.root / n).is_file()]


def _files_of(plan: Plan) -> list[set[str]]:
    """Each entry's input files (where its bytes lie in a file): where a --ray task writing it is best placed."""
    ckpt = plan.source
    return [{str(f) for n in e.inputs if (f := getattr(ckpt.info(n), "file", None)) is not None} for e in plan.entries]


def _indexes(ckpt: Checkpoint) -> list[Path]:
    """The weight index a sharded input was read through, if any."""
    if len(ckpt.files) < 2:
        return []
    return [p for p in (ckpt.root / n for n in WEIGHT_INDEXES) if p.is_file()]


def check_shardable(out: Path, max_shard_size: int | None, suffix: str = SAFETENSORS.suffix) -> None:
    """Refuse --max-shard-size for a single-file output (a path ending in ``suffix``, the writer's).

    Raises:
        FFNToolsError: naming the path and the fix.
    """
    if out.suffix == suffix and max_shard_size:
        raise FFNToolsError(f"{out}: --max-shard-size needs a directory output, not a {suffix} file")


def execute(plan: Plan, run: Run) -> list[str]:
    """Stream a plan to ``run.out``: one weight file (a path ending in the writer's suffix), or a directory of shards
    plus side files; as ``run`` says (``io.run.Run``: force, shard size, metadata, what to carry, --resume, --ray,
    the receipt's command and hash limit).

    Returns:
        The weight files written (names relative to ``out`` for a directory).

    Raises:
        OutputExistsError: ``out`` exists without ``force``, or overlaps the input.
    """
    if run.out is None:
        raise FFNToolsError("internal error: execute needs the run's output path (Run.out)")
    out, writer, ckpt = Path(run.out), run.writer or SAFETENSORS, plan.source
    check_shardable(out, run.max_shard_size, writer.suffix)
    meta = dict(ckpt.metadata if run.metadata is None else run.metadata)
    meta.setdefault("format", "pt")
    cache: dict = {}
    items = [out_tensor(e, ckpt, cache) for e in plan.entries]
    inputs = [ckpt.path, *ckpt.files, *plan.also_read]
    key = None
    if out.suffix != writer.suffix and writer.resumable:  # shards a killed run's --resume can reuse
        key = plan_key(command=run.desc, writer=type(writer).__name__, out=out.name, shard=run.max_shard_size,
                       metadata=meta, entries=plan.describe(), config=plan.config, carry=run.carry,
                       extra=sorted(run.extra_files or {}), inputs=input_stamp(inputs))
    read = [*_indexes(ckpt), *ckpt.files, *(side_files(ckpt) if run.carry else []), *plan.also_read]  # the receipt's
    progress = Progress(plan.read_bytes, run.desc)
    try:
        with atomic_output(out, inputs=inputs, force=run.force, nbytes=plan.total_bytes, resume_key=key,
                           sources=read, distributed=run.ray is not None and key is not None, run=run) as tmp:
            if out.suffix == writer.suffix:
                writer.write_file(tmp, items, meta, progress)
                written = [out.name]
            else:
                tmp.mkdir(exist_ok=key is not None)  # --resume: the killed run's directory, its shards in it
                written = _shards(plan, items, tmp, key, meta, progress, run)
                _side_files(plan, tmp, run)
    finally:
        progress.close()
    log.info("wrote %s (%s in %d file(s))", out, human(plan.total_bytes), len(written))
    return written


def _shards(plan: Plan, items: list[OutTensor], tmp: Path, key: str | None, meta: dict, progress: Progress,
            run: Run) -> list[str]:
    """A directory output's shards, written into ``tmp``: by the writer here, or (--ray) by Ray tasks given the
    plan's slices (``cluster``); where ``key`` is given, through the resume ledger (finished shards kept)."""
    writer = run.writer or SAFETENSORS
    if key is None:
        return writer.write_sharded(tmp, items, max_shard_size=run.max_shard_size, metadata=meta, progress=progress)
    ledger = Ledger(tmp, key)
    try:
        if run.ray is not None:
            written = cluster.write_sharded(tmp, items, plan.entries, _files_of(plan),
                                            write=partial(write_slice, plan.source), address=run.ray,
                                            max_shard_size=run.max_shard_size, metadata=meta, progress=progress,
                                            ledger=ledger)
        else:
            written = writer.write_sharded(tmp, items, max_shard_size=run.max_shard_size, metadata=meta,
                                           progress=progress, ledger=ledger)
    except BaseException:
        ledger.close(failed=True)
        raise
    ledger.close()  # the ledger stays until the output moves into place (atomic_output removes it)
    if ledger.reused:
        log.info("--resume: kept %d finished shard(s) of %d", len(ledger.reused), len(written))
    return written


def _side_files(plan: Plan, tmp: Path, run: Run) -> None:
    """A directory output's other files: the input's side files (``run.carry``), config.json, ``run.extra_files``."""
    for p in side_files(plan.source) if run.carry else []:
        if p.name != "config.json":
            shutil.copy2(p, tmp / p.name)
    if plan.config is not None:
        (tmp / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
    for name, content in (run.extra_files or {}).items():
        if isinstance(content, bytes):
            (tmp / name).write_bytes(content)
        else:
            (tmp / name).write_text(content)
