"""Run ``ffn-tools ARGS`` and SIGKILL it at its Nth write (``KILL_AT=N``), as a user's ``kill -9`` or the OOM killer
would: nothing of the process runs after it (no handler, no cleanup). The writes counted are the writer's two
primitives (a buffer written, a byte range copied), so N falls anywhere: inside a shard, between shards, before a
shard's manifest. ``KILL_AT=0`` kills nothing and prints the number of writes last (for choosing N).
``KILL_AFTER_MANIFESTS=K`` kills it instead right after the resume ledger's Kth shard manifest; the manifests are
then written as each shard ends, not by the ledger's thread (whose pace, against the writes, is a matter of timing).

Used by tests/test_resume.py and benchmarks/bench_resume.py, in a child process: ``python tests/kill_at.py ARGS``.
"""

import os
import signal
import sys

import ffn_tools.io.resume as resume
import ffn_tools.io.writer as writer

N = int(os.environ.get("KILL_AT", "0"))
MANIFESTS = int(os.environ.get("KILL_AFTER_MANIFESTS", "0"))
calls = [0]
manifests = [0]


def _counted(orig):
    def f(*a, **k):
        calls[0] += 1
        if calls[0] == N:
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(*a, **k)

    return f


def _manifest(orig):
    def f(path, obj):
        orig(path, obj)
        if path.name != "plan.json":
            manifests[0] += 1
            if manifests[0] == MANIFESTS:
                os.kill(os.getpid(), signal.SIGKILL)

    return staticmethod(f)


writer.write_all = _counted(writer.write_all)
writer._copy_range = _counted(writer._copy_range)
resume.Ledger._write = _manifest(resume.Ledger._write)
if MANIFESTS:
    resume.Ledger.finished = lambda self, name, last=False: self.manifest(name)  # at once, in the writer's thread

if __name__ == "__main__":
    from ffn_tools.cli import cli

    try:
        cli.main([*sys.argv[1:]], prog_name="ffn-tools", standalone_mode=True)
    finally:
        if not N and not MANIFESTS:
            print(f"writes: {calls[0]}", file=sys.stderr)
