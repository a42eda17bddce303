"""``verify --ray [ADDRESS]``: the FFN pairs verified by Ray tasks (``cluster``), the report the one-node run's.

The driver plans the steps once (``steps.plan_steps``: in order, the first FFN of each kind alone). It keeps the first
FFN of each kind itself (their float64 reference and inputs are what the kernel backends run afterwards, here) and
everything that is not an FFN pair (config, tokenizer, load check, tensors outside the FFNs, logits); the other steps
go to Ray tasks in contiguous ranges (as many as the cluster has cores), each placed where its tensors' files
are. A task runs verify again (the same command line or call, with what only the driver does turned off), plans the
same steps, checks that they are the driver's, runs its range and returns each step's results; the driver puts them
in step order, so the report is the one-node run's (but for the wall times of its backend calls).
"""

from __future__ import annotations

from .. import cluster

# what only the driver does: a task runs the FFN pairs alone
DRIVER_ONLY = ("--logits", "--generate")
TASK_FLAGS = ["--no-load-check", "--ffn-only", "--no-side-files"]
TASK_OPTIONS = {"load_check": False, "ffn_only": True, "side_files": False, "logits": False, "generate": False}


# A task costs its worker's start, its imports (torch), opening both sides and planning again: ~2.5 CPU-s on the
# 2-core machine, what ~15 GB of FFN pairs (both sides) compared as stored bytes cost there (5.8 GB/s,
# docs/performance.md). A task's range holds at least TASK_BYTES of that work, where there is less than the cluster's
# cores can take; a pair run through the float64 reference counts COMPUTED times its bytes (0.33-0.43 GB/s measured).
TASK_BYTES = 16 << 30
COMPUTED = 16


def task_call(call: dict | None) -> dict | None:
    """``rerun.replay``'s call of verify, as a task runs it: the FFN pairs alone, on the reference backend where no
    backend was named (the steps a task runs are on the reference only: the other backends run the first FFN of
    each kind, in the driver; resolving them imports their frameworks, seconds a task need not spend)."""
    if call is None:
        return None
    if "argv" in call:
        named = "--backend" in call["argv"] or any(a.startswith("--backend=") for a in call["argv"])
        return {**call, "argv": [a for a in call["argv"] if a not in DRIVER_ONLY] + TASK_FLAGS
                + ([] if named else ["--backend", "reference"])}
    options = {**call["options"], **TASK_OPTIONS}
    if not options.get("backends"):
        options["backends"] = ["reference"]
    return {**call, "options": options}


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


def start(ray, ca, cb, steps, away: list[int], work: int) -> tuple[dict, list[list[int]]]:
    """The tasks of the steps ``away`` (``work``: their FFN pairs' bytes, both sides, weighed as ``TASK_BYTES``
    says), submitted: ({ref: chunk index}, the chunks)."""
    _, call = cluster.ADDRESS.get() or (cluster.LOCAL, {})
    cores = int(ray.cluster_resources().get("CPU", 1))
    parts = ranges(away, cores, work)
    jobs = [{"kind": "steps", "indices": c, "count": len(steps)} for c in parts]
    return cluster.submit(ray, call, jobs, [files(ca, cb, steps, c) for c in parts]), parts
