"""The sample behind ``--dry-run``'s estimate (``ffn_tools.estimate``): which of a plan's entries it streams.

``narrow`` keeps every k-th output tensor, and the one that reads the most with its neighbours, which set the peak
memory: about 3% of the bytes read, at least 48 MB and twice the largest tensor's, at most 1 GB; ``keep_shared``
adds the entries that share work with a kept one (a quantized weight's parts) and marks the shared work no kept
entry needs as not wanted. The estimate streams the narrowed plan through the one executor in the dry run's own
process, into a temporary directory, its receipt hashing the sample's share of the input (``Run.hash_limit``) and its
shards made smaller in the same proportion, so that it writes as many as the run and hashes each as the run does.

``peak`` is a process's peak RSS, as the estimate and the benchmarks measure it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

SHARE = 0.03  # of the bytes read: the sample
SMALLEST = 48 << 20  # a sample reads at least this much (or everything, for a smaller output)
LARGEST = 1 << 30  # and at most this much


def reads(e) -> int:
    return e.nbytes if e.reads is None else e.reads


def narrow(plan):
    """The plan with only its sample's entries, and what the estimate scales by (totals, the sample's share)."""
    entries = plan.entries
    total = sum(reads(e) for e in entries)
    largest = max(range(len(entries)), key=lambda i: reads(entries[i])) if entries else 0
    # the largest at most half the sample, where the cap allows: its weight in the time scaled up stays small
    want = min(max(total * SHARE, SMALLEST, 2 * reads(entries[largest]) if entries else 0), LARGEST)
    if total <= want or not entries:
        chosen = list(range(len(entries)))
    else:
        step = max(1, math.floor(total / want))  # entries of about equal reads: every step-th reads `want`
        # one tensor of the largest size (an embedding and its untied head): two of them next to each other in the
        # sample would hold more memory at once than the stream, where they lie far apart
        top = 0.9 * reads(entries[largest])
        reading = [i for i, e in enumerate(entries) if reads(e) > 0]  # parts read with another (scales) come with it
        near = {i for i in (largest - 1, largest + 1) if 0 <= i < len(entries)}  # as the stream meets it
        chosen = sorted({i for i in reading[::step] if reads(entries[i]) < top} | {largest} | near)
        while sum(reads(entries[i]) for i in chosen) > 2 * want:  # a few huge entries: fewer of them
            thinner = sorted(set(chosen[::2]) | {largest})
            if len(thinner) == len(chosen):
                break
            chosen = thinner
    chosen = keep_shared(entries, chosen)
    sample = [entries[i] for i in chosen]
    facts = {"entries": len(entries), "sampled": len(sample), "reads": total,
             "sample_reads": sum(reads(e) for e in sample), "bytes": plan.total_bytes,
             "sample_bytes": sum(e.nbytes for e in sample)}
    return replace(plan, entries=sample), facts


def keep_shared(entries, chosen) -> list[int]:
    """``chosen`` (entry positions) with every entry that shares work with one of them (a quantized weight's parts:
    ``Entry.shared``, done and its bytes read once for all); the shared work no chosen entry needs is never done
    (``wanted`` False: a quantization pool skips it). For a sample run, and for a ``--ray`` task's one shard."""
    shared = [e.shared for e in entries]
    kept = {id(shared[i]) for i in chosen if shared[i] is not None}
    for w in shared:
        if w is not None:
            w.wanted = id(w) in kept
    return sorted(set(chosen) | {i for i, w in enumerate(shared) if w is not None and id(w) in kept})


def peak() -> int:
    """This process's peak RSS (VmHWM: of its own memory since it started; ``wait4``'s ru_maxrss would also hold the
    RSS of the process that started it, which Linux carries into a child's), or its workers' where larger."""
    import resource

    hwm = 0
    try:
        for row in Path("/proc/self/status").read_text().splitlines():
            if row.startswith("VmHWM:"):
                hwm = int(row.split()[1]) * 1024
    except OSError:
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
