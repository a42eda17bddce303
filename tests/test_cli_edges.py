"""Edges of the command line a demanding user hits: options that do not apply, odd output paths,
activations recorded where there is no config, and FFN options for the linen export."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli, tensors
from safetensors.torch import save_file

from ffn_tools.ffn import activation_from_config


def test_linen_export_reads_the_layout_it_is_told(model_dir, tmp_path):
    run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "split")
    run_cli("fuse-gateup", tmp_path / "split", "-o", tmp_path / "il", "--layout", "interleaved")
    run_cli("convert", tmp_path / "il", "--to", "flax", "--flax-layout", "linen", "-o", tmp_path / "linen",
            "--layout", "interleaved")
    run_cli("convert", tmp_path / "linen", "--to", "torch", "-o", tmp_path / "back")
    back, split = tensors(tmp_path / "back"), tensors(tmp_path / "split")
    assert torch.equal(back["layers.1.gate.weight"], split["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(back["layers.1.up.weight"], split["model.layers.1.mlp.up_proj.weight"])


def test_linen_export_with_custom_templates(tmp_path):
    t = {f"blocks.{i}.ffn.{w}.weight": torch.randn(*s) for i in range(2)
         for w, s in (("W_gate", (24, 8)), ("W_up", (24, 8)), ("W_down", (8, 24)))}
    save_file(t, tmp_path / "apex.safetensors")
    args = ["--gate", "blocks.{layer}.ffn.W_gate.weight", "--up", "blocks.{layer}.ffn.W_up.weight",
            "--down", "blocks.{layer}.ffn.W_down.weight"]
    run_cli("convert", tmp_path / "apex.safetensors", "--to", "flax", "--flax-layout", "linen", "-o", tmp_path / "l", *args)
    run_cli("convert", tmp_path / "l", "--to", "torch", "-o", tmp_path / "back")
    assert torch.equal(tensors(tmp_path / "back")["layers.1.up.weight"], t["blocks.1.ffn.W_up.weight"])


def test_options_that_do_not_apply_are_refused(model_dir, tmp_path):
    r = run_cli("convert", model_dir("llama"), "--to", "torch", "-o", tmp_path / "x", "--layout", "interleaved", ok=False)
    assert "--layout/--order/--tp does not apply to --to torch" in r.output
    r = run_cli("convert", model_dir("llama"), "--to", "torch", "-o", tmp_path / "x.safetensors", ok=False)
    assert "convert writes a directory" in r.output
    r = run_cli("extract", model_dir("llama"), "-o", tmp_path / "e.safetensors", "--max-shard-size", "10KB", ok=False)
    assert "--max-shard-size needs a directory output" in r.output
    assert not list(tmp_path.iterdir())


def test_an_output_path_the_os_refuses_is_one_line(model_dir, tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    for args in (["convert", model_dir("llama"), "--to", "torch"], ["split-gateup", model_dir("phi3")]):
        r = run_cli(*args, "-o", tmp_path / "afile" / "out", ok=False)
        assert "afile" in r.output
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_single_file_extract_keeps_its_activation(model_dir, tmp_path):
    run_cli("extract", model_dir("gemma"), "-o", tmp_path / "g.safetensors")
    s = json.loads(run_cli("inspect", tmp_path / "g.safetensors", "--json").stdout)
    assert s["gated_unit"] == "GeGLU" and "gelu_pytorch_tanh" in s["activation"]
    r = run_cli("verify", model_dir("gemma"), tmp_path / "g.safetensors", "--backend", "reference")
    assert "PASS" in r.output


def test_gemma_legacy_gelu_is_the_tanh_approximation():
    assert activation_from_config({"model_type": "gemma", "hidden_act": "gelu"}).function == "gelu_tanh"
    assert activation_from_config({"model_type": "llama", "hidden_act": "gelu"}).function == "gelu"
    assert activation_from_config({"model_type": "gemma2", "hidden_act": "gelu",
                                   "hidden_activation": "gelu_pytorch_tanh"}).function == "gelu_tanh"


def test_force_never_replaces_a_file_that_is_not_a_checkpoint(model_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "notes.txt", "--force", ok=False)
    assert "earlier checkpoint output" in r.output and (tmp_path / "notes.txt").read_text() == "mine"
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "config.json").write_text("{}")
    (proj / "main.py").write_text("print()")
    run_cli("split-gateup", model_dir("phi3"), "-o", proj, "--force", ok=False)
    assert (proj / "main.py").is_file() and (proj / "src").is_dir()


def test_default_output_of_dot_lands_beside_it(model_dir, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(model_dir("phi3"), tmp_path / "ps")
    monkeypatch.chdir(tmp_path / "ps")
    r = run_cli("split-gateup", ".")
    assert (tmp_path / "ps-split" / "model.safetensors").is_file() and "ps-split" in r.output
    assert sorted(p.name for p in (tmp_path / "ps").iterdir()) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]


def test_dry_run_json_plan_holds_only_tensors(model_dir):
    j = json.loads(run_cli("split-gateup", model_dir("phi3"), "--dry-run", "--json").stdout)
    assert all("\u2190" in line for line in j["plan"]) and j["dry_run"]


def test_split_refuses_an_mlx_directory_with_the_way_out(model_dir, tmp_path):
    run_cli("convert", model_dir("phi3"), "--to", "mlx", "-o", tmp_path / "q", "--quantize", "4", "--group-size", "32")
    r = run_cli("split-gateup", tmp_path / "q", ok=False)
    assert "is an MLX checkpoint" in r.output and "--to torch" in r.output


def test_scheme_files_are_checked_when_loaded(tmp_path, model_dir):
    cases = [({"groups": []}, '"groups" is empty'),
             ({"groups": [{"kind": "dense", "forms": {"fused": {"gate_up": "layers.{layer}.w13.weight"}}}]},
              "form 'fused' of the dense group needs exactly down, gate_up"),
             ({"gate": "a.{layer}.g"}, 'needs "down"')]
    for data, message in cases:
        (tmp_path / "s.json").write_text(json.dumps(data))
        r = run_cli("inspect", model_dir("llama"), "--scheme-file", tmp_path / "s.json", ok=False)
        assert message in r.output


def test_split_with_templates_names_its_outputs(model_dir, tmp_path):
    args = ["--gate-up", "model.layers.{layer}.mlp.gate_up_proj.weight", "--down", "model.layers.{layer}.mlp.down_proj.weight"]
    r = run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "o", *args, ok=False)
    assert "--gate and --up" in r.output
    run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "o", *args,
            "--gate", "blocks.{layer}.g.weight", "--up", "blocks.{layer}.u.weight")
    assert "blocks.1.u.weight" in tensors(tmp_path / "o")


def test_an_output_the_os_refuses_is_named_as_o(model_dir):
    r = run_cli("fuse-gateup", model_dir("llama"), "-o", "/proc/forbidden", ok=False)
    assert "Error: /proc/forbidden: cannot write in /proc" in r.output and ".lock" not in r.output


def test_checkpoint_paths_complete_as_files():
    from click.shell_completion import ShellComplete

    from ffn_tools.cli import cli

    for args in (["inspect"], ["verify"], ["convert"], ["split-gateup"]):
        items = ShellComplete(cli, {}, "ffn-tools", "_FFN_TOOLS_COMPLETE").get_completions(args, "./")
        assert [i.type for i in items] == ["file"], args  # the shell lists files and directories


def test_python_api_errors_name_the_api_spelling_too(model_dir, tmp_path):
    import ffn_tools
    from ffn_tools.errors import FFNToolsError

    ffn_tools.fuse_gateup(model_dir("llama"), tmp_path / "out")
    with pytest.raises(FFNToolsError, match=r"choose another output path \(out=\) or pass force=True to replace it$"):
        ffn_tools.fuse_gateup(model_dir("llama"), tmp_path / "out")


def test_the_console_script_leaves_its_objects_to_the_exit_not_to_a_last_collection(tmp_path):
    """``ffn-tools`` freezes the collector once its command is done, whatever its exit status: the interpreter's
    exit then skips a cycle collection over everything torch and transformers made (~0.8 s a command, measured).
    atexit handlers (which clean temporary directories) still run after it. (Not where Triton is loaded: see
    ``test_a_passing_verify_prints_nothing_on_stderr``.)"""
    import subprocess
    import sys

    probe = ("import atexit, gc, sys; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); "
             "sys.argv = ['ffn-tools'] + sys.argv[1:]; from ffn_tools.cli import main; main()")
    for args in (["--help"], ["inspect", str(tmp_path / "absent.safetensors")]):
        r = subprocess.run([sys.executable, "-P", "-c", probe, *args], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
        assert "frozen True" in r.stdout, (args, r.returncode, r.stdout[-300:], r.stderr[-300:])
    assert r.returncode == 2  # a usage error: exited through the same path


def test_a_passing_verify_prints_nothing_on_stderr(model_dir, tmp_path):
    """Issue 59.3: after every command that imported Triton (a default verify, --load-check), ~30 lines of
    "nanobind: leaked 64 types!" followed the verdict on stderr, which a newcomer reads as a crash: Triton's bindings
    list at exit each of their objects still alive, and the collector frozen at exit kept them all alive. The real
    console script, as a user runs it: a passing verify says PASS on stdout and nothing on stderr."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    a, b = model_dir("llama"), tmp_path / "b"
    shutil.copytree(a, b)
    r = subprocess.run([str(Path(sys.executable).parent / "ffn-tools"), "verify", str(a), str(b)], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("PASS: "), (r.stdout[-800:], r.stderr[-800:])
    assert r.stderr == "", r.stderr[-1500:]


def test_the_package_builds_without_warnings_and_holds_every_module(tmp_path):
    """Issue 59.9: every `pip install -e .` printed setuptools' "Package 'ffn_tools.schemes' is absent from the
    `packages` configuration" (~45 lines): the hand-written list of packages lacked the data folder, and a new
    converters/ package had to be added to it by hand. The wheel setuptools builds from this tree warns of nothing
    and holds every module of ffn_tools/, converters/ and kernels/ (as ffn_tools.converters, ffn_tools.kernels) and
    the built-in naming families."""
    import shutil
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).parents[1]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "ffn_tools", "converters", "kernels"):
        if (root / name).is_dir():
            shutil.copytree(root / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        elif (root / name).exists():
            shutil.copy(root / name, src / name)
    build = ("import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))")
    r = subprocess.run([sys.executable, "-P", "-c", build, str(tmp_path / "dist")], cwd=src, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # setuptools' "Package 'ffn_tools.schemes' is absent from the `packages` configuration" (a newer setuptools
    # may print deprecation warnings of its own: not this check's business)
    assert "is absent from the" not in r.stdout + r.stderr, r.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "dist" / r.stdout.strip().splitlines()[-1]) as wheel:
        held = {n for n in wheel.namelist() if n.startswith("ffn_tools/")}
    expected = {f"ffn_tools/{p.relative_to(src / top).as_posix()}" if top == "ffn_tools" else
                f"ffn_tools/{top}/{p.relative_to(src / top).as_posix()}"
                for top in ("ffn_tools", "converters", "kernels") for p in (src / top).rglob("*.py")
                if top != "ffn_tools" or p.relative_to(src / top).parts[0] not in ("converters", "kernels")}
    assert expected <= held, sorted(expected - held)[:10]
    assert {f"ffn_tools/schemes/{p.name}" for p in (src / "ffn_tools" / "schemes").glob("*.json")} <= held
    assert any(n.startswith("ffn_tools/converters/gguf/") for n in held)


def test_convert_refuses_an_existing_output_before_importing_a_client(model_dir, tmp_path):
    """Issue 59.9: `convert` refused an existing output only in its format's export, after torch, transformers
    and the output's client were imported and the input checked (5 s; split refuses in 0.3 s). It refuses first:
    the same one line and exit 2, with neither transformers nor mlx_lm imported."""
    import subprocess
    import sys

    (tmp_path / "out").mkdir()
    probe = ("import atexit, sys; atexit.register(lambda: print('imported', sorted(m for m in ('transformers', "
             "'mlx_lm', 'mlx') if m in sys.modules))); sys.argv = ['ffn-tools'] + sys.argv[1:]; "
             "from ffn_tools.cli import main; main()")
    for to in ("mlx", "torch", "gguf"):
        r = subprocess.run([sys.executable, "-P", "-c", probe, "convert", str(model_dir("llama")), "--to", to, "-o",
                            str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr == (f"Error: {tmp_path / 'out'}: already exists; choose another output "
                                                  "path (-o) or pass --force to replace it\n"), (to, r.stderr[-500:])
        assert "imported []" in r.stdout, (to, r.stdout)


def test_a_terminal_is_told_what_runs_before_the_first_progress_bar(model_dir, tmp_path):
    """Issue 59.9: a long verify (or GGUF export) left the terminal blank for 12-18 s before its first progress
    bar: torch's import, the load check's model, a converter's start. On a terminal (stderr a pty here) each such
    step says what it does on one line redrawn in place, and the line is erased when the step ends: what is left
    on the terminal is what was there without it. With -q nothing is drawn (and where stderr is not a terminal,
    nothing: see test_a_passing_verify_prints_nothing_on_stderr)."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time
    from pathlib import Path

    from ffn_tools.progress import CLEAR

    script = str(Path(sys.executable).parent / "ffn-tools")
    for quiet in ([], ["-q"]):
        leader, follower = pty.openpty()
        stdout = tmp_path / f"stdout{len(quiet)}"
        with open(stdout, "w") as sink:  # a file, not a pipe: nothing waits on a full pipe while the pty is read
            p = subprocess.Popen([script, *quiet, "verify", str(model_dir("llama")), str(model_dir("llama"))],
                                 stdout=sink, stderr=follower, cwd=tmp_path, text=True)
        os.close(follower)
        drawn, deadline = b"", time.monotonic() + 300
        while time.monotonic() < deadline:
            if not select.select([leader], [], [], 1.0)[0]:
                if p.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            drawn += chunk
        else:
            p.kill()
            pytest.fail("ffn-tools verify on a pty did not end in 300 s")
        p.wait(timeout=60)
        os.close(leader)
        out = stdout.read_text()
        assert p.returncode == 0 and out.splitlines()[-1].startswith("PASS: "), out[-500:]
        text = drawn.decode().replace("\r\n", "\n")
        if quiet:
            assert text == "", text
            continue
        steps = [s for s in text.split(CLEAR) if s]
        assert steps[0].startswith("verify: opening A and B") and "verify: the load check (would B load in " \
            "transformers?)" in steps, steps
        assert text.endswith(CLEAR), text[-200:]  # erased: the report starts on a clean line


def test_a_line_said_during_a_status_stands_on_its_own_line(monkeypatch):
    """A warning or a cost line said while ``doing``'s status is drawn is written above it (the status erased,
    the line written, the status drawn again), never glued to the end of the status text."""
    import io
    import logging

    from ffn_tools import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    log = logging.getLogger("ffn_tools.test_status")
    handler = progress.StatusAwareHandler()
    log.addHandler(handler)
    try:
        with progress.doing("verify: opening A and B"):
            progress.say("this costs 3 s")
            log.warning("a warning")
    finally:
        log.removeHandler(handler)
    text = term.getvalue()
    c = progress.CLEAR
    assert text == (f"{c}verify: opening A and B{c}this costs 3 s\n{c}verify: opening A and B{c}a warning\n"
                    f"{c}verify: opening A and B{c}"), repr(text)
