"""``verify --ray [ADDRESS]``: the FFN pairs verified by Ray tasks (``cluster``), the report the one-node run's.

The driver plans the steps once (``steps.plan_steps``: in order, the first FFN of each kind alone). It keeps the first
FFN of each kind itself (their float64 reference and inputs are what the kernel backends run afterwards, here) and
everything that is not an FFN pair (config, tokenizer, load check, tensors outside the FFNs, logits); the other steps
go to Ray tasks in contiguous ranges (as many as the cluster has cores), each placed where its tensors' files
are. A task is given the driver's pair run (``pairrun.PairRun``: its checks and planned steps, both sides pickled as
how to open them again, ``io.store.Checkpoint.__reduce__``) and its range of step indices; it runs that range
(``PairRun.in_task``) and returns each step's results, never verify again. The driver puts them in step order, so
the report is the one-node run's (but for the wall times of its backend calls).
"""

from __future__ import annotations

from .. import cluster

# A task costs its worker's start, its imports (torch) and opening both sides: ~2.5 CPU-s on the
# 2-core machine, what ~15 GB of FFN pairs (both sides) compared as stored bytes cost there (5.8 GB/s,
# docs/performance.md). A task's range holds at least TASK_BYTES of that work, where there is less than the cluster's
# cores can take; a pair run through the float64 reference counts COMPUTED times its bytes (0.33-0.43 GB/s measured).
TASK_BYTES = 16 << 30
COMPUTED = 16


def chunks(indices: list[int], n: int) -> list[list[int]]:
    """``indices`` in at most ``n`` contiguous ranges of about equal length."""
    n = max(1, min(n, len(indices)))
    size, extra = divmod(len(indices), n)
    out, at = [], 0
    for k in range(n):
        step = size + (k < extra)
        out.append(indices[at: at + step])
        at += step
    return [c for c in out if c]


def ranges(away: list[int], cores: int, work: int) -> list[list[int]]:
    """The steps ``away`` in as many ranges as keep every core busy, each holding at least ``TASK_BYTES`` of the
    ``work`` where there is less (at least one range)."""
    return chunks(away, min(cores, max(1, -(-work // TASK_BYTES))))


def files(ca, cb, steps, chunk: list[int]) -> set[str]:
    """The files the tensors of a range of steps lie in, A's and B's."""
    out = set()
    for k in chunk:
        for _, x, y in steps[k].items:
            for ckpt, ffn in ((ca, x), (cb, y)):
                for name in ffn.names.values():
                    if (f := getattr(ckpt.stored.info(name), "file", None)) is not None:
                        out.add(str(f))
    return out


def _steps(run, indices: list[int]) -> dict[int, list]:
    """A Ray task: the steps ``indices`` of the driver's pair run ``run``; {step: results}."""
    return run.in_task(indices)


def start(ray, run, away: list[int], work: int) -> tuple[dict, list[list[int]]]:
    """The tasks of the steps ``away`` of the pair run ``run`` (``work``: their FFN pairs' bytes, both sides,
    weighed as ``TASK_BYTES`` says), submitted: ({ref: chunk index}, the chunks)."""
    cores = int(ray.cluster_resources().get("CPU", 1))
    parts = ranges(away, cores, work)
    jobs = [(_steps, (run, c)) for c in parts]
    return cluster.submit(ray, jobs, [files(run.ca, run.cb, run.steps, c) for c in parts]), parts
