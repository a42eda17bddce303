"""What a new user hit with GGUF (issue 37, items 1, 5, 7, 8), each against the real client.

The default ``--outtype`` (auto) is convert_hf_to_gguf.py's own auto, byte for byte; ``--to gguf`` after a pip
install alone fetches llama.cpp's converter from the llama-cpp-python source distribution of the installed
version; GGUF -> torch/MLX gives back the side files the GGUF stores and verify compares tokenizers by behaviour
where the GGUF cannot store a field; the config written from a GGUF's metadata is what each client needs.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_cli


@pytest.mark.parametrize("dtype,chosen", [(torch.bfloat16, "bf16"), (torch.float32, "f16")])
def test_default_outtype_is_the_converters_auto(gguf_model, gguf_ref, tmp_path, dtype, chosen):
    """No --outtype, and --outtype auto: the file convert_hf_to_gguf.py --outtype auto writes (bf16 for a bf16
    model, f16 for an f32 one), and the summary says which type auto chose. On main both were
    ``KeyError: 'auto'``, exit 2."""
    src = gguf_model("llama", dtype)
    ref = gguf_ref("llama", "auto", dtype)
    out = tmp_path / "default.gguf"
    r = json.loads(run_cli("-q", "convert", src, "--to", "gguf", "-o", out, "--json").output)
    assert out.read_bytes() == ref.read_bytes()
    assert r["outtype"] == chosen and set(r["types"]) == {chosen.upper(), "F32"}, r
    assert any(c.startswith(f"--outtype auto: {chosen}, as convert_hf_to_gguf.py's auto") for c in r["changes"])
    run_cli("-q", "convert", src, "--to", "gguf", "-o", tmp_path / "auto.gguf", "--outtype", "auto")
    assert (tmp_path / "auto.gguf").read_bytes() == ref.read_bytes()
    assert "auto, the default" in " ".join(run_cli("convert", "--help").output.split())


SDIST = Path(sys.prefix) / "sdist"  # where the dev install (the Makefile) downloads llama-cpp-python's archive


def sdist_archive() -> Path:
    from importlib.metadata import version

    return SDIST / f"llama_cpp_python-{version('llama-cpp-python')}.tar.gz"


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory) -> Path:
    """A folder from which pip, with no index, gives llama-cpp-python's source distribution: the archive the dev
    install downloaded, and the wheels of the archive's build backend (pip installs it to read the archive's
    metadata), fetched once here by pip with this machine's own configuration (skipped where it reaches none)."""
    import tarfile
    import tomllib

    archive = sdist_archive()
    if not archive.is_file():
        pytest.skip(f"no {archive}: the dev install (make install) downloads it")
    house = tmp_path_factory.mktemp("wheelhouse")
    (house / archive.name).symlink_to(archive)
    with tarfile.open(archive) as tar:
        top = tar.next().name.split("/")[0]
        requires = tomllib.load(tar.extractfile(f"{top}/pyproject.toml"))["build-system"]["requires"]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "-d", str(house),
                        *requires], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"pip cannot get the build backend of {archive.name} ({requires}): {r.stderr.strip()[-200:]}")
    return house


@pytest.fixture
def pip_only(monkeypatch, tmp_path):
    """The converter's usual places empty ($FFN_TOOLS_LLAMA_CPP unset, sys.prefix/llama.cpp an empty folder), a
    fresh user cache, and pip offline (no index): as after `pip install 'ffn-tools[gguf]'` alone."""
    from ffn_tools.converters.gguf import source

    monkeypatch.delenv(source.ENV, raising=False)
    monkeypatch.setattr(source, "PREFIX", tmp_path / "prefix" / "llama.cpp")
    monkeypatch.setenv(source.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return tmp_path / "cache"


def test_to_gguf_after_pip_install_alone(gguf_model, gguf_ref, wheelhouse, pip_only, monkeypatch, tmp_path, caplog):
    """With no converter tree anywhere, --to gguf fetches the installed llama-cpp-python's source distribution
    by pip (offline here: PIP_FIND_LINKS), says so first on stderr (the size, where), keeps only the converter
    (no archive), and writes convert_hf_to_gguf.py's file byte for byte; the next run finds it and says
    nothing. On main: "--to gguf runs llama.cpp's own converter, which is not at ...", exit 2."""
    from importlib.metadata import version

    from ffn_tools.converters.gguf import source

    monkeypatch.setenv("PIP_FIND_LINKS", str(wheelhouse))
    ver = version("llama-cpp-python")
    src = gguf_model("llama")
    caplog.set_level(logging.WARNING, logger=source.__name__)
    run_cli("-q", "convert", src, "--to", "gguf", "-o", tmp_path / "a.gguf", "--outtype", "f32")
    said = [r.getMessage() for r in caplog.records if r.name == source.__name__]
    tree = pip_only / f"llama.cpp-{ver}"
    assert len(said) == 1 and said[0].startswith("--to gguf runs llama.cpp's convert_hf_to_gguf.py, which is not "
                                                 f"installed here: fetching it once from the llama-cpp-python {ver} "
                                                 "source distribution (a 77 MB download by pip"), said
    assert str(tree) in said[0]
    assert (tmp_path / "a.gguf").read_bytes() == gguf_ref("llama", "f32").read_bytes()
    assert sorted(p.name for p in pip_only.iterdir()) == [tree.name]  # no archive, no temporary left
    assert (tree / source.MARKER).read_text().startswith(f"llama-cpp-python {ver}\n")
    assert sorted(p.name for p in tree.iterdir()) == sorted([*source.TREE, source.MARKER])
    kept = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())
    assert kept < 4 << 20, kept
    caplog.clear()
    run_cli("-q", "convert", src, "--to", "gguf", "-o", tmp_path / "b.gguf", "--outtype", "f32")
    assert not [r for r in caplog.records if r.name == source.__name__]  # once
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()


def test_to_gguf_without_a_reachable_archive_says_how(gguf_model, pip_only, monkeypatch, tmp_path):
    """pip reaching no archive (no index, nothing in PIP_FIND_LINKS): one line, exit 2, naming the fix; nothing
    written, nothing left in the cache. $FFN_TOOLS_LLAMA_CPP naming a folder without the converter is refused,
    never replaced by a download."""
    from importlib.metadata import version

    from ffn_tools.converters.gguf import source

    (tmp_path / "links").mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    ver = version("llama-cpp-python")
    out = tmp_path / "x.gguf"
    r = run_cli("convert", gguf_model("llama"), "--to", "gguf", "-o", out, ok=False)
    line = next(ln for ln in r.output.splitlines() if ln.startswith("Error:"))
    assert line.startswith(f"Error: --to gguf needs llama.cpp's converter from the llama-cpp-python {ver} source "
                           f"distribution, and `pip download llama-cpp-python=={ver}` failed (ERROR: "), line
    assert "PIP_FIND_LINKS=DIR" in line and "FFN_TOOLS_LLAMA_CPP" in line
    assert not out.exists() and [p.name for p in pip_only.iterdir()] == []
    monkeypatch.setenv(source.ENV, str(tmp_path / "links"))
    r = run_cli("convert", gguf_model("llama"), "--to", "gguf", "-o", out, ok=False)
    assert (f"Error: $FFN_TOOLS_LLAMA_CPP is {tmp_path / 'links'}, which lacks convert_hf_to_gguf.py, conversion, "
            "gguf-py: point it at") in r.output


def test_fetched_archive_must_be_the_installed_version(tmp_path):
    """An archive of another version than the installed llama-cpp-python is refused, naming both."""
    import io
    import tarfile

    from ffn_tools.converters.gguf.source import extract
    from ffn_tools.errors import FFNToolsError

    archive = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 9.9.9\n"
        info = tarfile.TarInfo("llama_cpp_python-9.9.9/PKG-INFO")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(FFNToolsError, match=r"pip downloaded llama-cpp-python 9\.9\.9 where 0\.3\.36 is installed"):
        extract(archive, "0.3.36", tmp_path / "tree")


def test_inspect_names_gguf_among_its_inputs(tmp_path):
    """inspect's --help and its refusal of an unknown file list .gguf; a .gguf that is not one says so."""
    assert "a .gguf file" in " ".join(run_cli("inspect", "--help").output.split())
    (tmp_path / "x.txt").write_text("hi")
    r = run_cli("inspect", tmp_path / "x.txt", ok=False)
    assert "not a checkpoint (expected .safetensors, .index.json, .bin, .pth, .pt or .gguf)" in r.output
    (tmp_path / "x.gguf").write_text("hi")
    r = run_cli("inspect", tmp_path / "x.gguf", ok=False)
    assert "x.gguf: not a GGUF file (it starts b'hi', not GGUF's magic b'GGUF')" in r.output
