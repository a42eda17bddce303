"""``--ray [ADDRESS]``: a command's output shards written by Ray tasks, on as many nodes as the cluster has.

The plan is made once, by the command as it runs here (the driver): which tensors go in which shard
(``io.writer.plan_shards``), in the order a one-node run writes them. Each shard to write is then one Ray task: it
runs the same command again (``rerun``: the same command line, or the same library call) in shard mode (``SHARD``),
where the one executor (``plan.execute``) plans the output again, checks that its shards are the driver's, writes
its one shard into the driver's temporary output directory (shared storage) under a name of its own, and renames it
into place; nothing else of the command runs there. The driver keeps everything around the shards as a one-node
run does (the temporary output, the lock, the resume ledger, the index, config and tokenizer files, the receipt, the
move into place), so the output, files and receipt, is byte-identical to a one-node run's.

Each task is scheduled where its input files are: a probe on every node says which of the input files it sees
(with their sizes), and a shard's task prefers (softly) a node that sees every file its tensors are read from,
shards spread over such nodes in turn. A task whose node dies is retried by Ray on another node; its partial file
(under a name of its own) is never renamed into place, and is removed with the others at the end. Without an address
a local Ray is started on every core of this machine, and stopped after.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from .errors import FFNToolsError

LOCAL = "local"  # --ray without an address: a Ray started here
RETRIES = 3  # a task whose node or worker died runs again, this many times at most
PART = ".ffn-tools-part-"  # a task's file before it is renamed into place

# --ray's address in the driver (None: not asked; LOCAL: a Ray started here), and how to run the command again
ADDRESS: ContextVar[tuple[str, dict] | None] = ContextVar("ffn_tools_ray", default=None)
# in a task: the shard to write ({"dir", "index", "names"})
SHARD: ContextVar[dict | None] = ContextVar("ffn_tools_ray_shard", default=None)

NOT_DISTRIBUTED = ("--ray writes the shards of a directory of safetensors shards as Ray tasks (split-gateup, "
                   "fuse-gateup, convert --to torch or mlx, with a directory -o); this output is written whole by one "
                   "writer: run without --ray")


class ShardWritten(BaseException):
    """Raised in a task once its shard is in place: the rest of the command does not run there (not an Exception:
    nothing on the way out mistakes it for a failure)."""

    def __init__(self, name: str, size: int):
        super().__init__(name)
        self.name, self.size = name, size


@contextmanager
def requested(address: str | None, call: dict | None) -> Iterator[None]:
    """Within it, a command's shards are written by Ray tasks (``address``: a cluster's, or ``LOCAL``); ``call`` runs
    the command again (``rerun.replay``; None: it cannot be, and --ray is refused)."""
    if address is not None and call is None:
        raise FFNToolsError("--ray runs the command again in each task: a library call's options must be plain data "
                            "(JSON) for that")
    token = ADDRESS.set(None if address is None else (address, call or {}))
    try:
        yield
    finally:
        ADDRESS.reset(token)


def _connect(address: str) -> bool:
    """Connect to Ray (or start a local one); True if this process started it (and must stop it)."""
    try:
        import ray
    except ImportError:
        raise FFNToolsError("--ray needs Ray: pip install 'ffn-tools[ray]'") from None
    if ray.is_initialized():
        return False
    from .child import python_env

    env = {k: v for k, v in python_env().items() if k in ("PYTHONPATH", "PYTHONSAFEPATH")}
    try:
        if address == LOCAL:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
                     runtime_env={"env_vars": env})
        else:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR, runtime_env={"env_vars": env})
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise FFNToolsError(f"--ray {address}: cannot connect to a Ray cluster there ({e})") from None
    return True


def _probe(files: list[tuple[str, int]]) -> list[str]:
    """The files of ``files`` (path, size) this node sees, with that size."""
    seen = []
    for path, size in files:
        try:
            if os.stat(path).st_size == size:
                seen.append(path)
        except OSError:
            pass
    return seen


def _placement(ray, files_of: list[set[str]]) -> list:
    """A scheduling strategy per shard: softly, a node that sees every input file of the shard (in turn among them);
    the default scheduling where no node does."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    every = sorted(set().union(*files_of)) if files_of else []
    sized = [(f, os.stat(f).st_size) for f in every]
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    probe = ray.remote(num_cpus=0)(_probe)
    seen = dict(zip(nodes, ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
                                    .remote(sized) for n in nodes])))
    out = []
    for k, files in enumerate(files_of):
        holders = [n for n in nodes if files <= set(seen[n])]
        out.append(NodeAffinitySchedulingStrategy(holders[k % len(holders)], soft=True) if holders else "DEFAULT")
    return out


def _task(call: dict, shard: dict) -> tuple[str, int]:
    """A Ray task: the command again, in shard mode; the shard's name and size."""
    from . import rerun
    from .child import clean_path

    clean_path()
    token = SHARD.set(shard)
    try:
        rerun.run(call)
    except ShardWritten as done:
        return done.name, done.size
    finally:
        SHARD.reset(token)
    raise RuntimeError(f"the command run again for shard {shard['names'][shard['index']]} never reached its writer")


def write_sharded(out_dir: Path, items: Sequence, files_of: list[set[str]], *, max_shard_size: int | None,
                  metadata: dict, progress=None, ledger=None) -> list[str]:
    """The driver's ``io.writer.write_sharded``: the shards written by Ray tasks (a shard the resume ledger says is
    finished is kept); the index written here. ``files_of``: each item's input files, for placement."""
    from .io.writer import plan_shards, shard_names, write_index

    address, call = ADDRESS.get() or (LOCAL, {})
    shards = plan_shards(items, max_shard_size, metadata)
    names = shard_names(len(shards))
    started = _connect(address)
    try:
        import ray

        task = ray.remote(num_cpus=1, max_retries=RETRIES, retry_exceptions=False)(_task)
        at, spans = 0, []
        for shard in shards:
            spans.append((at, at + len(shard)))
            at += len(shard)
        places = _placement(ray, [set().union(*files_of[a:b]) if b > a else set() for a, b in spans])
        pending = {}
        for k, name in enumerate(names):
            if ledger is not None and ledger.reusable(name):
                if progress:
                    progress.update(sum(t.progress_bytes for t in shards[k]))
                continue
            if ledger is not None:
                ledger.forget(name)
            ref = task.options(scheduling_strategy=places[k]).remote(
                call, {"dir": str(out_dir), "index": k, "names": names})
            pending[ref] = k
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            k = pending.pop(done[0])
            try:
                ray.get(done[0])
            except Exception as e:  # noqa: BLE001  (a task's own failure, after its retries: said as the command's)
                raise FFNToolsError(f"--ray: shard {names[k]} failed: {_cause(e)}") from None
            if progress:
                progress.update(sum(t.progress_bytes for t in shards[k]))
            if ledger is not None:
                ledger.finished(names[k])
    finally:
        for p in out_dir.glob(f"{PART}*"):  # a dead task's partial file
            p.unlink(missing_ok=True)
        if started:
            import ray

            ray.shutdown()
    write_index(out_dir, items, shards, names)
    return names


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return str(cause or e).strip().splitlines()[-1]


def write_one(shard: dict, items: Sequence, entries: Sequence, *, max_shard_size: int | None, metadata: dict) -> None:
    """In a task: write the shard ``shard`` asks for from this run's own plan (the driver's shards, checked), and
    raise ``ShardWritten``."""
    from .io.sample import keep_shared
    from .io.writer import plan_shards, shard_names, write_file

    shards = plan_shards(items, max_shard_size, metadata)
    if shard_names(len(shards)) != shard["names"]:
        raise FFNToolsError(f"--ray: this node plans {len(shards)} shards, the driver {len(shard['names'])}: the "
                            "nodes must run the same ffn-tools and libraries on the same inputs")
    k = shard["index"]
    start = sum(len(s) for s in shards[:k])
    keep_shared(entries, range(start, start + len(shards[k])))  # a quantization pool works on this shard only
    name = shard["names"][k]
    part = Path(shard["dir"]) / f"{PART}{uuid.uuid4().hex}"
    try:
        write_file(part, shards[k], metadata)
        os.replace(part, Path(shard["dir"]) / name)
    finally:
        part.unlink(missing_ok=True)
    raise ShardWritten(name, (Path(shard["dir"]) / name).stat().st_size)
