"""``--ray [ADDRESS]``: a command's output shards written by Ray tasks, on as many nodes as the cluster has.

The plan is made once, by the command as it runs here (the driver): which tensors go in which shard
(``io.shards.plan_shards``), in the order a one-node run writes them. Each shard to write is then one Ray task given
the driver's plan slice, the shard's entries (``executor.write_slice``; the input checkpoint travels as how to open
it again by path, ``io.store.Checkpoint.__reduce__``): it writes that shard into the driver's temporary output
directory (shared storage) under a name of its own and renames it into place. A task never parses or runs the
command again. (``verify --ray`` sends its FFN steps the same way: ``verification.distributed``.) The driver keeps everything around the shards as a one-node
run does (the temporary output, the lock, the resume ledger, the index, config and tokenizer files, the receipt, the
move into place), so the output, files and receipt, is byte-identical to a one-node run's.

Each task is scheduled where its input files are: a probe on every node says which of the input files it sees
(with their sizes), and a shard's task prefers (softly) a node that sees every file its tensors are read from,
shards spread over such nodes in turn. A task whose node dies is retried by Ray on another node; its partial file
(under a name of its own) is never renamed into place, and is removed with the others at the end (a task that died
after its rename is run again all the same: the same bytes, renamed over them atomically). Without an address
a local Ray is started on every core of this machine, and stopped after.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import FFNToolsError, pip_install

LOCAL = "local"  # --ray without an address: a Ray started here
RETRIES = 3  # a task whose node or worker died runs again, this many times at most
PART = ".ffn-tools-part-"  # a task's file before it is renamed into place



@contextmanager
def linked(address: str | None) -> Iterator[Link | None]:
    """``verify --ray``'s connection, begun now on a thread while the command imports, opens and plans (``Link``),
    let go of as the block ends; None without --ray."""
    link = Link(address) if address is not None else None
    try:
        yield link
    finally:
        if link is not None:
            link.close()


class Link:
    """Ray, connected to on a thread from the command's start, while this process imports torch, opens both sides
    and plans: connecting (or starting a local Ray) is then off the way to the first task (0.6-0.8 s of an 8 GB
    verify's 7 s, measured on the 2-core machine). The thread lives until the command ends and lets go of Ray
    itself: the processes of a Ray started here get their parent-death signal when the thread that started them
    ends (a local Ray started by a thread that returned lost its GCS at once, measured)."""

    def __init__(self, address: str):
        self.started, self.error = False, None  # type: bool, BaseException | None
        self.ready, self.over = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold, args=(address,), name="ffn-tools-ray", daemon=True)
        self.thread.start()

    def _hold(self, address: str) -> None:
        try:
            self.started = _connect(address)
        except BaseException as e:  # noqa: BLE001 (raised where the connection is asked for: ``ray``)
            self.error = e
        finally:
            self.ready.set()
        self.over.wait()
        if self.started:
            import ray

            ray.shutdown()

    def ray(self):
        """The ``ray`` module, connected (raises what connecting raised)."""
        self.ready.wait()
        if self.error is not None:
            raise self.error
        import ray

        return ray

    def close(self) -> None:
        self.over.set()
        self.thread.join()


def _connect(address: str) -> bool:
    """Connect to Ray (or start a local one); True if this process started it (and must stop it)."""
    try:
        import ray
    except ImportError:
        raise FFNToolsError(f"--ray needs Ray: {pip_install('ray')}") from None
    if ray.is_initialized():
        return False
    _reachable(address)
    from .child import python_env

    env = {k: v for k, v in python_env().items() if k in ("PYTHONPATH", "PYTHONSAFEPATH")}
    try:
        if address == LOCAL:
            # "local": a Ray of its own, even where one runs on this machine already (without it Ray connects to that
            # one, and refuses num_cpus: measured beside a running cluster)
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR, runtime_env={"env_vars": env})
        else:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR, runtime_env={"env_vars": env})
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise FFNToolsError(f"--ray {address}: cannot connect to a Ray cluster there ({e})") from None
    return True


def _reachable(address: str, seconds: float = 5.0) -> None:
    """Refuse, within seconds, a ``host:port`` (or ``ray://host:port``) nothing listens at: Ray itself would wait a
    minute or more for it. ``auto`` and ``local`` are Ray's to find."""
    import socket

    where = address.removeprefix("ray://")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=seconds).close()
    except OSError as e:
        raise FFNToolsError(f"--ray {address}: nothing answers there ({e.strerror or e}); give the address of a "
                            "running Ray cluster's head (ray start --head prints it), or --ray alone for a Ray "
                            "started here") from None


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
    alive = [n for n in ray.nodes() if n.get("Alive")]
    nodes = [n["NodeID"] for n in alive]
    here = ray.util.get_node_ip_address()
    # a node at this machine's address sees this machine's files: only the others are asked (a probe starts a worker
    # there, a second of a node's CPU)
    away = [n["NodeID"] for n in alive if n.get("NodeManagerAddress") != here]
    probe = ray.remote(num_cpus=0)(_probe)
    seen = dict.fromkeys(nodes, every)  # ``sized`` stat'ed every file here just now
    seen.update(zip(away, ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
                                   .remote(sized) for n in away])))
    out = []
    for k, files in enumerate(files_of):
        holders = [n for n in nodes if files <= set(seen[n])]
        out.append(NodeAffinitySchedulingStrategy(holders[k % len(holders)], soft=True) if holders else "DEFAULT")
    return out


@contextmanager
def connected(where: str | Link) -> Iterator:
    """Ray, connected to (or started here) for the command, and let go after; yields the ``ray`` module.
    ``where``: an address (``LOCAL``: a Ray started here), or the connection the command began as it started
    (``linked``), let go of as that ends."""
    if isinstance(where, Link):
        yield where.ray()
        return
    started = _connect(where)
    try:
        import ray

        yield ray
    finally:
        if started:
            import ray

            ray.shutdown()


def results(ray, pending: dict, what) -> Iterator[tuple[int, Any]]:
    """(job index, result) as the tasks finish; a task that failed after its retries raises, said by ``what(k)``."""
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        k = pending.pop(done[0])
        try:
            value = ray.get(done[0])
        except Exception as e:  # noqa: BLE001  (a task's own failure, after its retries: said as the command's)
            raise FFNToolsError(f"--ray: {what(k)} failed: {_cause(e)}") from None
        yield k, value


def _job(job: tuple) -> Any:
    """A Ray task: ``job`` is ``(function, args)``, pickled together (a checkpoint its arguments share is opened
    again once: ``io.store.Checkpoint.__reduce__``); what the function returns."""
    from .child import clean_path

    clean_path()
    fn, args = job
    return fn(*args)


def submit(ray, jobs: list[tuple], files_of: list[set[str]]) -> dict:
    """One task per ``(function, args)`` job, each placed (softly) where its files are; ``{ref: job index}``."""
    fn = ray.remote(num_cpus=1, max_retries=RETRIES, retry_exceptions=False)(_job)
    places = _placement(ray, files_of)
    return {fn.options(scheduling_strategy=place).remote(job): k for k, (job, place) in enumerate(zip(jobs, places))}


def write_sharded(out_dir: Path, items: Sequence, entries: Sequence, files_of: list[set[str]], *, write,
                  address: str, max_shard_size: int | None, metadata: dict, progress=None, ledger=None) -> list[str]:
    """The driver's ``io.writer.write_sharded``: each shard to write (the resume ledger's finished ones are kept) is
    one Ray task, ``write(its entries, out_dir, name, metadata)`` (``executor.write_slice``: the plan's slice, never
    the command again); the index written here. ``items``: the entries' output tensors, as the driver shards them;
    ``files_of``: each entry's input files, for placement."""
    from .io.shards import kept, plan_shards, shard_names, write_index

    shards = plan_shards(items, max_shard_size, metadata)
    names = shard_names(len(shards))
    try:
        with connected(address) as ray:
            at, spans = 0, []
            for shard in shards:
                spans.append((at, at + len(shard)))
                at += len(shard)
            todo = [k for k, name in enumerate(names) if not kept(ledger, name, shards[k], progress)]
            jobs = [(write, (list(entries[slice(*spans[k])]), str(out_dir.resolve()), names[k], metadata))
                    for k in todo]
            pending = submit(ray, jobs, [set().union(*files_of[slice(*spans[k])]) for k in todo])
            for done, (j, _) in enumerate(results(ray, pending, lambda j: f"shard {names[todo[j]]}"), 1):
                k = todo[j]
                if progress:
                    progress.update(sum(t.progress_bytes for t in shards[k]))
                if ledger is not None:
                    ledger.finished(names[k], last=done == len(todo))
    finally:
        for p in out_dir.glob(f"{PART}*"):  # a dead task's partial file
            p.unlink(missing_ok=True)
    write_index(out_dir, items, shards, names)
    return names


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return str(cause or e).strip().splitlines()[-1]


def write_part(out_dir: Path, name: str, items: Sequence, metadata: dict) -> tuple[str, int]:
    """In a task: ``items`` written as shard ``name`` of ``out_dir``, under a name of its own until it is whole (a
    task that dies leaves only that, removed by the driver); (name, size)."""
    from .io.writer import write_file

    part = out_dir / f"{PART}{uuid.uuid4().hex}"
    try:
        write_file(part, items, metadata)
        os.replace(part, out_dir / name)
    finally:
        part.unlink(missing_ok=True)
    return name, (out_dir / name).stat().st_size
