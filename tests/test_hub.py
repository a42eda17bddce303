"""Hub ids wherever a checkpoint path is taken, resolved through a prepared offline Hugging Face cache (the
layout ``huggingface_hub`` writes: blobs, snapshots of symbolic links, refs), and ``python -m ffn_tools``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--acme--tiny-phi3"
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    for f in model_dir("phi3", torch.float32).iterdir():
        shutil.copy(f, repo / "blobs" / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    return home


def ffn_tools(home: Path, *args, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "ffn_tools", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def test_repo_ids_work_where_paths_do(hf_home, model_dir, tmp_path, monkeypatch):
    r = ffn_tools(hf_home, "inspect", "acme/tiny-phi3", "--json")  # HF_HOME and HF_HUB_OFFLINE as a user sets them
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["scheme"] == "hf" and s["ffn"]["dense"]["count"] == 2 and REV in s["path"]
    # the other commands in this process (a process each cost a verify's imports), its huggingface_hub told what
    # those variables tell one at its import: the cache under HF_HOME, offline
    from huggingface_hub import constants

    from helpers import run_cli

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert REV in json.loads(run_cli("inspect", f"acme/tiny-phi3@{REV}", "--json").stdout)["path"]
    run_cli("split-gateup", "acme/tiny-phi3", "-o", tmp_path / "split")
    assert (tmp_path / "split" / "model.safetensors").is_file()
    r = run_cli("verify", model_dir("phi3", torch.float32), "acme/tiny-phi3", "--tokens", "2", "--backend", "reference")
    assert "PASS" in r.stdout, r.output


def test_unknown_repo_id_is_one_line_exit_2(hf_home, tmp_path):
    r = ffn_tools(hf_home, "inspect", "acme/absent")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "acme/absent: no such path; as a Hub repo id, the local Hugging Face cache has no copy and Hub access is " \
           "off (HF_HUB_OFFLINE is set)" in r.stderr, r.stderr
    r = ffn_tools(hf_home, "inspect", "not/a/repo/id", cwd=tmp_path)  # three parts: a path, and absent
    assert r.returncode == 2 and "no such file or directory" in r.stderr


def test_an_unreachable_hub_is_called_unreachable(hf_home):
    """37.13: a Hub that cannot be reached read as "not a Hub repo the cache or the Hub has"."""
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")  # refused
    r = subprocess.run([sys.executable, "-m", "ffn_tools", "inspect", "acme/absent"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and [ln.startswith("Error:") for ln in r.stderr.splitlines()].count(True) == 1, r.stderr
    assert "acme/absent: no such path; as a Hub repo id, the Hub is unreachable (" in r.stderr, r.stderr
    assert "Connection refused" in r.stderr and "check the network connection" in r.stderr, r.stderr


def test_python_dash_m_is_the_cli(hf_home):
    r = ffn_tools(hf_home, "--help")
    assert r.returncode == 0 and "Split, fuse, convert and verify" in r.stdout and "Exit status" in r.stdout


def test_readme_python_example_runs_as_written(model_dir, tmp_path, monkeypatch):
    import re

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"## Python\n.*?```python\n(.*?)```", readme, re.S).group(1)
    shutil.copytree(model_dir("phi3", torch.float32), tmp_path / "phi3")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "phi3-split" / "model.safetensors").is_file() and (tmp_path / "phi3-mlx").is_dir()
