"""llama.cpp's converter process, kept between the conversions of one ffn-tools process.

The converter needs torch, transformers and llama.cpp's ``conversion`` imported: about 3 s of a process's start
(3.5 s under load) before any work. ``worker --zygote`` makes those imports once and forks a child for each
conversion (``worker.zygote``): the child starts with them made, and takes nothing of an earlier conversion with it
(its state dies with it). A command converts once, and starts the zygote while it checks the conversion
(``warm``, from ``GGUFFormat.preparing``), so that the imports overlap the check; a library or a test that converts
many models in one process pays the imports once. One zygote lives at a time, for one environment (the child
runs with the zygote's: another ``PYTHONPATH`` or ``FFN_TOOLS_*`` starts another); it ends with the end of its
stdin (this process ended) or after ``worker.IDLE_SECONDS`` without a request, and is started again when asked.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_live: dict = {}  # "key": what it was started with; "proc": the zygote
_busy = threading.Lock()  # one conversion at a time through the zygote's pipes
# read by no import (the child gets the request's environment whole: what a conversion reads at run time is the
# caller's), so a change of one starts no other zygote: pytest's per test, the worker's proof limit (``prove``),
# the advisory-warnings switch transformers reads at each warning and ``import mlx_lm`` sets (a GGUF -> MLX export
# started a second zygote for every later conversion of the process), and the breakpoint hook ``breakpoint()`` reads
# at each call, which ``ray.init`` sets (a process that started ray restarted the zygote)
VOLATILE = ("PYTEST_CURRENT_TEST", "FFN_TOOLS_GGUF_CHECK_LIMIT", "TRANSFORMERS_NO_ADVISORY_WARNINGS",
            "PYTHONBREAKPOINT")


def _key(env: dict) -> tuple:
    return sys.executable, tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE))


def ensure(model_type: str | None, env: dict) -> subprocess.Popen:
    """The zygote for ``env``: the live one, or one started now (importing ``model_type``'s config class too)."""
    proc = _live.get("proc")
    if proc is not None and proc.poll() is None and _live.get("key") == _key(env):
        return proc
    stop()
    proc = subprocess.Popen([sys.executable, "-m", "ffn_tools.converters.gguf.worker", "--zygote", model_type or ""],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if not _live:
        atexit.register(stop)
    _live.update(key=_key(env), proc=proc)
    return proc


def prestart(model_type: str | None, env: dict) -> None:
    """``ensure`` now, so that the start overlaps the caller's other work; nothing where another thread is
    converting through the zygote (a zygote for another environment would have replaced it under that conversion,
    and this one's conversion runs in a process of its own: ``run``)."""
    if _busy.acquire(blocking=False):
        try:
            ensure(model_type, env)
        finally:
            _busy.release()


def stop() -> None:
    """End the zygote (its stdin closed: it ends; killed if it does not at once)."""
    proc = _live.pop("proc", None)
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


def run(request: dict, env: dict, model_type: str | None = None) -> subprocess.CompletedProcess | None:
    """``request`` converted by a child of the zygote: its exit status, its stdout (the result line) and, where
    ``request["progress"]`` is off, its stderr (else it goes to this process's); None where another thread of this
    process is converting through it (the caller starts a process of its own). A zygote that ended on its own
    (idle) is started again, once."""
    if not _busy.acquire(blocking=False):
        return None
    try:
        return _run(request, env, model_type)
    finally:
        _busy.release()


def _run(request: dict, env: dict, model_type: str | None) -> subprocess.CompletedProcess:
    for attempt in (0, 1):
        proc = ensure(model_type, env)
        assert proc.stdin is not None and proc.stdout is not None  # both pipes
        with tempfile.TemporaryDirectory(prefix="ffn-tools-gguf-") as d:
            out, err = Path(d) / "stdout", (None if request.get("progress") else Path(d) / "stderr")
            job = {"request": request, "cwd": os.getcwd(), "env": env, "stdout": str(out), "stderr": err and str(err)}
            pid = None
            try:
                proc.stdin.write(json.dumps(job) + "\n")
                proc.stdin.flush()
                pid = _said(proc.stdout, "pid")
                if pid is not None:
                    rc = _said(proc.stdout, "rc")
                    if rc is not None:
                        return subprocess.CompletedProcess(proc.args, rc, _text(out), _text(err) if err else "")
            except BrokenPipeError:
                pass
            except BaseException:  # interrupted: the conversion goes, and the zygote with it
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                proc.kill()
                proc.wait()
                raise
            if pid is not None:  # the zygote died under a conversion: not an idle end
                raise OSError(f"llama.cpp's converter process ended during the conversion (exit {proc.wait()})")
        stop()
    raise OSError("llama.cpp's converter process could not be started")


def alive(env: dict) -> bool:
    """Whether a zygote for ``env`` runs now (started by an earlier conversion of this process)."""
    proc = _live.get("proc")
    return proc is not None and proc.poll() is None and _live.get("key") == _key(env)


def script(path: Path, argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """``python PATH ARGV`` (one of llama.cpp's scripts: its converter, its LoRA converter), forked from the zygote
    (its imports made once a process); in a process of its own where another thread converts through the zygote or
    it could not start. Its exit status, stdout and stderr."""
    try:
        proc = run({"script": str(path), "argv": argv}, env)
    except OSError:
        proc = None
    if proc is None:
        proc = subprocess.run([sys.executable, str(path), *argv], env=env, capture_output=True, text=True)
    return proc


def last_line(proc: subprocess.CompletedProcess) -> str:
    """Why a failed ``script`` run failed: the last line it wrote (stderr, else stdout), or its exit status."""
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def _said(stdout, key: str):
    """The value of ``key`` in the zygote's next JSON line that has it (a line an import printed is passed over);
    None at the end of its output (it ended)."""
    for line in stdout:
        try:
            said = json.loads(line)
        except ValueError:
            continue
        if isinstance(said, dict) and key in said:
            return said[key]
    return None


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
