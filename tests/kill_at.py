"""Run ``ffn-tools ARGS`` and SIGKILL it at its Nth write (``KILL_AT=N``), as a user's ``kill -9`` or the OOM killer
would: nothing of the process runs after it (no handler, no cleanup). The writes counted are the writer's two
primitives (a buffer written, a byte range copied), so N falls anywhere: inside a shard, between shards, before a
shard's manifest. ``KILL_AT=0`` kills nothing and prints the number of writes last (for choosing N).
``KILL_AFTER_MANIFESTS=K`` kills it instead right after the resume ledger's Kth shard manifest; the manifests are
then written as each shard ends, not by the ledger's thread (whose pace, against the writes, is a matter of timing).
``KILL_IN_RECEIPT=1`` kills it as its output's receipt is made: the end phase, every shard written and hashed.
``KILL_AFTER_POOLED=K`` (with ``QUANT_WORKERS=W``: an MLX export quantizes in W worker processes, whatever the size
and the machine's load) kills it right after the Kth weight the workers quantized is taken, the next ones in flight.

``KILL_WITH=SIGNAL`` sends another signal than SIGKILL: SIGINT (Ctrl-C), SIGTERM, SIGHUP (a lost session), which the
process handles as the console script does; or SIGSTOP, to stop it there for the caller to look at (its children)
and kill.

Used by tests/test_resume.py and benchmarks/bench_resume.py, in a child process: ``python tests/kill_at.py ARGS``
(test_resume.py imports it for ``COUNTED``, to count an uninterrupted run's writes in its own process).
"""

import os
import signal
import sys

import ffn_tools.io.receipt as receipt
import ffn_tools.io.resume as resume
import ffn_tools.io.writer as writer

N = int(os.environ.get("KILL_AT", "0"))
MANIFESTS = int(os.environ.get("KILL_AFTER_MANIFESTS", "0"))
IN_RECEIPT = os.environ.get("KILL_IN_RECEIPT") == "1"
POOLED = int(os.environ.get("KILL_AFTER_POOLED", "0"))
WORKERS = int(os.environ.get("QUANT_WORKERS", "0"))
SIGNAL = signal.Signals[os.environ.get("KILL_WITH", "SIGKILL")]
calls = [0]
manifests = [0]
pooled = [0]


def _kill() -> None:
    os.kill(os.getpid(), SIGNAL)


def _counted(orig):
    def f(*a, **k):
        calls[0] += 1
        if calls[0] == N:
            _kill()
        return orig(*a, **k)

    return f


def _manifest(orig):
    def f(path, obj):
        orig(path, obj)
        if path.name != "plan.json":
            manifests[0] += 1
            if manifests[0] == MANIFESTS:
                _kill()

    return staticmethod(f)


def _in_receipt(orig):
    def f(*a, **k):
        _kill()
        return orig(*a, **k)

    return f


def _pooled(orig):
    def f(self, k):
        part = orig(self, k)
        if self.pool is not None and k == 0:
            pooled[0] += 1
            if pooled[0] == POOLED:
                _kill()
        return part

    return f


COUNTED = ("write_all", "_copy_range")  # the writes counted: ffn_tools.io.writer's two primitives


def install() -> None:
    """The settings above, patched into this process (only this script's: importing it patches nothing)."""
    for name in COUNTED:
        setattr(writer, name, _counted(getattr(writer, name)))
    resume.Ledger._write = _manifest(resume.Ledger._write)
    if MANIFESTS:
        resume.Ledger.finished = lambda self, name, last=False: self.manifest(name)  # at once, in the writer's thread
    if IN_RECEIPT:
        receipt.make = _in_receipt(receipt.make)
    if WORKERS:
        import ffn_tools.converters.mlx.quantize as quantize
        import ffn_tools.converters.mlx.workers as workers

        workers.PARALLEL_MIN_BYTES = 0
        workers.idle_cores = lambda: WORKERS
        quantize.QuantJob.part = _pooled(quantize.QuantJob.part)


if __name__ == "__main__":
    install()
    from ffn_tools.cli import main

    try:
        main()  # the console script's: SIGTERM and SIGHUP handled as it handles them
    finally:
        if not N and not MANIFESTS:
            print(f"writes: {calls[0]}", file=sys.stderr)
