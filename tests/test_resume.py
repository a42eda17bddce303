"""--resume: a run SIGKILLed at random points, then continued, writes the bytes an uninterrupted run writes.

The kills are real (tests/kill_at.py: ``kill -9`` of the process at its Nth write, nothing of it runs after; or
SIGINT, SIGTERM, SIGHUP, which it handles); the outputs are compared file for file, byte for byte, with an
uninterrupted run of the same command.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ffn_tools.child import python_env
from ffn_tools.io.resume import LEDGER

from helpers import run_cli, tree_digest

HERE = Path(__file__).parent
SHARD = "30KB"


def _digest(out: Path) -> dict[str, str]:
    return {str(Path(k).relative_to(out)): v for k, v in tree_digest(out).items()}


def _killed(args, at: int, cwd: Path, manifests: int = 0, **env: str) -> subprocess.CompletedProcess:
    """``ffn-tools ARGS`` SIGKILLed at its ``at``-th write, or right after its ``manifests``-th shard manifest
    (``env``: more of kill_at.py's settings, ``KILL_WITH`` another signal)."""
    return subprocess.run([sys.executable, str(HERE / "kill_at.py"), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={**python_env(), "KILL_AT": str(at), "KILL_AFTER_MANIFESTS": str(manifests),
                                          **env}, timeout=300)


def _resumed(*args):
    """``ffn-tools ARGS --resume``, in this process (the kill before it is what needs a process of its own)."""
    return run_cli(*args, "--resume")


def _writes(args) -> int:
    """``ffn-tools ARGS`` run whole, in this process: the number of writes kill_at.py counts (its ``KILL_AT=N``
    falls among them). In-process: only the kills need a process of their own."""
    import ffn_tools.io.writer as writer
    from kill_at import COUNTED

    calls = [0]

    def counted(orig):
        def f(*a, **k):
            calls[0] += 1
            return orig(*a, **k)

        return f

    with pytest.MonkeyPatch.context() as mp:
        for name in COUNTED:
            mp.setattr(writer, name, counted(getattr(writer, name)))
        run_cli(*args)
    return calls[0]


def _temporaries(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.tmp-*"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    from tiny_models import build

    return build("llama", tmp_path_factory.mktemp("resume") / "llama", torch.bfloat16, max_shard_size="100KB")


COMMANDS = {
    "fuse-gateup": lambda src: ["fuse-gateup", src, "--max-shard-size", SHARD],
    "split-gateup": None,  # of the fused model, below
    "convert-mlx-4bit": lambda src: ["convert", src, "--to", "mlx", "-q", "--q-bits", "4", "--max-shard-size", "12KB"],
}
# kills per command: a first run killed, then its --resume killed again (and again), each in a process of its own;
# two are the property (killed, killed while resuming, resumed) where each process costs the MLX export's imports
KILLS = {"fuse-gateup": 3, "split-gateup": 3, "convert-mlx-4bit": 2}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_killed_at_random_points_then_resumed_is_byte_identical(sharded, tmp_path, command):
    src = sharded
    if command == "split-gateup":
        src = tmp_path / "fused"
        run_cli("fuse-gateup", sharded, "-o", src, "--max-shard-size", "100KB")
    args = (COMMANDS[command] or (lambda s: ["split-gateup", s, "--max-shard-size", SHARD]))(src)
    ref, out = tmp_path / "ref" / "out", tmp_path / "out"  # one name: the receipts name it
    n = _writes([*args, "-o", ref])  # the uninterrupted run, counting its writes
    assert len([p for p in ref.iterdir() if p.suffix == ".safetensors"]) >= 4  # shards to resume from
    rng = random.Random(f"resume-{command}")
    points = sorted(rng.sample(range(1, n + 1), KILLS[command]))
    first = _killed([*args, "-o", out], points[0], tmp_path)
    assert first.returncode == -9 and not out.exists()
    done = 0
    for at in points[1:]:  # killed again while resuming: each run continues what the one before left
        r = _killed([*args, "-o", out, "--resume"], max(1, at - done), tmp_path)
        assert r.returncode in (-9, 0), r.stderr
        if r.returncode == 0:
            break
        done = at
        assert not out.exists() and len(_temporaries(out)) == 1
    if not out.exists():  # the last --resume, not killed: in this process
        r = _resumed(*args, "-o", out)
        assert "--resume: continuing the unfinished output" in r.stderr
    assert _digest(out) == _digest(ref)  # every file, every byte; no ledger left in the output
    assert not _temporaries(out)


def test_a_changed_finished_shard_is_written_again(sharded, tmp_path):
    args = ["fuse-gateup", sharded, "--max-shard-size", SHARD]
    ref, out = tmp_path / "ref" / "out", tmp_path / "out"  # one name: the receipts name it
    run_cli(*args, "-o", ref)
    assert _killed([*args, "-o", out], 0, tmp_path, manifests=3).returncode == -9
    (tmp,) = _temporaries(out)
    finished = sorted(p.name.removesuffix(".json") for p in (tmp / LEDGER).glob("*.safetensors.json"))
    assert len(finished) == 3
    victim = tmp / finished[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor: same size, other bytes
    victim.write_bytes(bytes(data))
    kept = {n: (tmp / n).stat().st_mtime_ns for n in finished[1:]}
    r = _resumed(*args, "-o", out)
    assert f"({len(finished)} shards finished, each checked before reuse)" in r.stderr
    assert _digest(out) == _digest(ref)
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # the good shards were kept, not written again


def test_resume_of_another_run_starts_afresh_and_says_so(sharded, tmp_path):
    out = tmp_path / "out"
    args = ["fuse-gateup", sharded, "-o", out]
    assert _killed([*args, "--max-shard-size", SHARD], 0, tmp_path, manifests=1).returncode == -9
    (tmp,) = _temporaries(out)
    assert json.loads((tmp / LEDGER / "plan.json").read_text())["key"]
    r = run_cli(*args, "--max-shard-size", "40KB", "--resume")  # other shards: another run
    assert "removed the unfinished output of a killed or interrupted run" in r.output
    assert "begun by another command, with other options or from other inputs" in r.output
    ref = tmp_path / "ref" / out.name
    run_cli("fuse-gateup", sharded, "-o", ref, "--max-shard-size", "40KB")
    assert _digest(out) == _digest(ref) and not _temporaries(out)


def test_a_run_without_resume_says_what_it_threw_away(sharded, tmp_path):
    out = tmp_path / "out"
    args = ["fuse-gateup", sharded, "-o", out, "--max-shard-size", SHARD]
    assert _killed(args, 0, tmp_path, manifests=1).returncode == -9
    r = run_cli(*args)
    assert "removed the unfinished output of a killed or interrupted run" in r.output
    assert "--resume continues one" in r.output
    assert not _temporaries(out)


@pytest.mark.parametrize("extra", [["convert", "--to", "gguf"], ["fuse-gateup"]])
def test_resume_is_refused_where_nothing_can_be_reused(model_dir, tmp_path, extra):
    src = model_dir("llama")
    out = tmp_path / ("out.gguf" if "gguf" in extra else "out.safetensors")
    r = run_cli(extra[0], src, *extra[1:], "-o", out, "--resume", ok=False)
    assert "--resume continues a directory of safetensors shards" in r.output and not out.exists()


def test_a_resumed_run_without_a_partial_output_is_a_plain_run(sharded, tmp_path):
    ref, out = tmp_path / "ref" / "out", tmp_path / "out"  # one name: the receipts name it
    run_cli("fuse-gateup", sharded, "-o", ref, "--max-shard-size", SHARD)
    r = run_cli("fuse-gateup", sharded, "-o", out, "--max-shard-size", SHARD, "--resume")
    assert "continuing" not in r.output
    assert f"{out}: --resume: no unfinished output of this same run was left (by a killed or interrupted run); " \
           "writing it from the start" in r.output.splitlines()
    assert _digest(out) == _digest(ref)
    assert not any(p.name == LEDGER for p in out.rglob("*"))
    assert os.listdir(tmp_path) and not _temporaries(out)


def test_a_merge_resumed_after_its_adapter_changed_starts_afresh(tmp_path):
    """merge's shards are made from the adapter too: an adapter edited between the kill and --resume is another
    run (its bytes in the key), so no shard merged with the old one is kept."""
    pytest.importorskip("peft")
    from test_adapters import FFN, peft_adapter
    from tiny_models import build, make_model

    base = build("llama", tmp_path / "base", torch.bfloat16)
    model = make_model("llama", torch.bfloat16)
    adapter = peft_adapter(model, tmp_path / "lora", target_modules=FFN)
    out = tmp_path / "merged"
    args = ["merge", base, adapter, "-o", out, "--max-shard-size", SHARD]
    assert _killed(args, 0, tmp_path, manifests=2).returncode == -9
    peft_adapter(model, adapter, seed=2, target_modules=FFN)  # the same targets and ranks, other factors
    r = run_cli(*args, "--resume")
    assert "begun by another command, with other options or from other inputs" in r.output
    ref = tmp_path / "ref" / out.name
    run_cli("merge", base, adapter, "-o", ref, "--max-shard-size", SHARD)
    assert _digest(out) == _digest(ref)


def test_a_killed_or_interrupted_verify_resumes_from_the_steps_it_finished(tmp_path, monkeypatch):
    """verify --json SIGKILLed, or interrupted (Ctrl-C: it says in one line what it kept), right after its first
    finished FFN step; --resume reuses it and runs the rest: the report is the uninterrupted run's (but for wall
    times), and the ledger is gone after; --resume with nothing to continue says so."""
    from tiny_models import build

    from ffn_tools.verification.report import without_times

    src = build("mixtral", tmp_path / "mixtral", torch.bfloat16)
    fused = tmp_path / "fused"
    run_cli("fuse-gateup", src, "-o", fused)
    args = ["verify", src, fused, "--no-load-check", "--json", "--backend", "reference"]
    caches = {sig: tmp_path / sig for sig in ("SIGKILL", "SIGINT")}
    for sig, cache in caches.items():
        stopped = _killed(args, 0, tmp_path, manifests=1, KILL_WITH=sig, FFN_TOOLS_CACHE=str(cache))
        (left,) = (cache / "verify").iterdir()  # the stopped run's ledger: its plan and one step
        assert sorted(p.name for p in left.iterdir())[-1].startswith("step-")
        if sig == "SIGKILL":
            assert stopped.returncode == -9, stopped.stderr
            continue
        assert stopped.returncode == 130, stopped.stderr
        assert json.loads(stopped.stdout.splitlines()[-1]) == {"error": "interrupted", "signal": "SIGINT"}
        said = [ln for ln in stopped.stderr.splitlines() if "interrupted: kept" in ln]
        assert said == [f"verify: interrupted: kept the 1 FFN step it had finished in {left}; the same verify with "
                        f"--resume continues from them, without --resume (or rm -r {left}) discards them"]
    monkeypatch.setenv("FFN_TOOLS_CACHE", str(tmp_path / "other"))
    whole = _resumed(*args)  # nothing to continue there
    assert ("verify --resume: no FFN step of this same verify was left finished (by a killed or interrupted run); "
            "running every step") in whole.stderr.splitlines()
    for cache in caches.values():
        monkeypatch.setenv("FFN_TOOLS_CACHE", str(cache))
        resumed = _resumed(*args)
        assert "FFN steps a killed run had finished, reused" in resumed.stderr
        assert "no FFN step of this same verify" not in resumed.stderr
        assert without_times(json.loads(resumed.stdout)) == without_times(json.loads(whole.stdout))
        assert not list((cache / "verify").iterdir())


def test_only_the_last_shard_is_hashed_on_every_core(sharded, tmp_path, monkeypatch):
    """The ledger hashes each shard on its thread while the next is written, on one core (the writer needs the
    other); the last one is the only hashing left when the writing ends, and gets every core."""
    from ffn_tools.io import digests, resume

    asked = []
    monkeypatch.setattr(resume, "file_digest", lambda path, stop=None, threads=1, real=digests.file_digest:
                        asked.append((Path(path).name, threads)) or real(path, stop, threads=threads))
    run_cli("fuse-gateup", sharded, "--max-shard-size", SHARD, "-o", tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors"))
    assert len(names) > 3 and sorted(n for n, _ in asked) == names
    assert [t for n, t in asked] == [1] * (len(names) - 1) + [digests.EVERY_CORE]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM], ids=lambda s: s.name)
def test_an_interrupted_run_keeps_its_finished_shards_for_resume(sharded, tmp_path, sig):
    """Ctrl-C, a lost session (SIGHUP), SIGTERM: the signal ends the run (128 + its number) but leaves the shards
    it finished, said in one line; --resume keeps them (not written again) and writes the uninterrupted bytes."""
    args = ["fuse-gateup", sharded, "--max-shard-size", SHARD]
    ref, out = tmp_path / "ref" / "out", tmp_path / "out"  # one name: the receipts name it
    run_cli(*args, "-o", ref)
    r = _killed([*args, "-o", out], 0, tmp_path, manifests=2, KILL_WITH=sig.name)
    assert r.returncode == 128 + sig, r.stderr
    (tmp,) = _temporaries(out)
    said = [ln for ln in r.stderr.splitlines() if "interrupted: kept" in ln]
    assert said == [f"{out}: interrupted: kept 2 finished shards in {tmp}; the same command with --resume continues "
                    f"from them, without --resume (or rm -r {tmp}) discards them"], r.stderr
    assert f"Interrupted ({sig.name})" in r.stderr and not out.exists()
    finished = sorted(p.name.removesuffix(".json") for p in (tmp / LEDGER).glob("*.safetensors.json"))
    kept = {n: (tmp / n).stat().st_mtime_ns for n in finished}
    resumed = _resumed(*args, "-o", out)
    assert "(2 shards finished, each checked before reuse)" in resumed.stderr
    assert _digest(out) == _digest(ref) and not _temporaries(out)
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # reused, not written again


def test_a_kill_in_the_end_phase_keeps_every_shard(sharded, tmp_path):
    """SIGKILL as the receipt is made (every shard written and hashed, side files in place): the ledger is still
    there (it is removed last), so --resume keeps every shard and only finishes the end."""
    args = ["fuse-gateup", sharded, "--max-shard-size", SHARD]
    ref, out = tmp_path / "ref" / "out", tmp_path / "out"  # one name: the receipts name it
    run_cli(*args, "-o", ref)
    shards = sorted(p.name for p in ref.glob("*.safetensors"))
    assert len(shards) >= 4
    assert _killed([*args, "-o", out], 0, tmp_path, KILL_IN_RECEIPT="1").returncode == -9
    (tmp,) = _temporaries(out)
    kept = {n: (tmp / n).stat().st_mtime_ns for n in shards}
    r = _resumed(*args, "-o", out)
    assert f"({len(shards)} shards finished, each checked before reuse)" in r.stderr
    assert _digest(out) == _digest(ref) and not _temporaries(out)  # no ledger in the output either
    assert {n: (out / n).stat().st_mtime_ns for n in shards} == kept


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: their command lines."""
    found = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    return found


def _state(pid: int) -> str | None:
    """A process's state letter (R, S, T stopped, Z zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
def test_a_killed_quantizing_export_leaves_no_worker_behind(sharded, tmp_path):
    """``kill -9`` of ``convert --to mlx -q`` while its worker processes quantize: none of its children (the workers,
    the resource tracker) outlives it (they waited forever for their next job, writing into the temporary output)."""
    pytest.importorskip("mlx")
    out = tmp_path / "out"
    env = {**python_env(), "QUANT_WORKERS": "2", "KILL_AFTER_POOLED": "1", "KILL_WITH": "SIGSTOP"}
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, str(HERE / "kill_at.py"), "convert", str(sharded), "--to", "mlx",
                                 "-q", "--q-bits", "4", "--max-shard-size", "12KB", "-o", str(out)],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, env=env)
    children: dict[int, str] = {}
    try:
        while _state(proc.pid) not in ("T", None) and proc.poll() is None:  # stopped after its first pooled weight
            time.sleep(0.05)
        assert _state(proc.pid) == "T", (tmp_path / "stderr").read_text()
        children = _children(proc.pid)
        assert sum("multiprocessing" in c for c in children.values()) >= 2, children  # the workers (and tracker)
        os.kill(proc.pid, signal.SIGKILL)  # as a user's kill -9
        assert proc.wait(timeout=60) == -9
        deadline = time.monotonic() + 30
        while (left := {p: c for p, c in children.items() if _state(p) not in (None, "Z")}) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"still running after their parent was killed: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in children:  # what this test started, where it outlived the test's failure
            if _state(p) not in (None, "Z"):
                os.kill(p, signal.SIGKILL)
