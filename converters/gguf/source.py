"""Where llama.cpp's converter lies for ``--to gguf``, fetched once when a pip install alone left none.

The writer runs llama.cpp's own ``convert_hf_to_gguf.py`` with its ``conversion/`` package and vendored ``gguf-py``
(``TREE``), which are not on PyPI as such: they ship in llama-cpp-python's source distribution, under
``vendor/llama.cpp``. Looked for, in order: ``$FFN_TOOLS_LLAMA_CPP`` (a llama.cpp checkout the user names: used
as it is, or refused), ``sys.prefix/llama.cpp`` (where ``make install`` extracts them), and this user's cache
(``cache_dir()``: ``$FFN_TOOLS_CACHE``, else ``$XDG_CACHE_HOME/ffn-tools``, else ``~/.cache/ffn-tools``) under
``llama.cpp-VERSION``. When none holds them, the source distribution of the *installed* llama-cpp-python is
fetched by pip (``pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==VERSION``, through the
user's own pip configuration: index, mirrors, proxies, ``PIP_FIND_LINKS``), its version checked against the
installed one, only ``TREE`` extracted (about 2 MB of the 77 MB archive) and the archive deleted. It is said on
stderr first, once: the next run finds the cache. ``--no-binary llama-cpp-python`` rather than ``:all:``: the
latter also forces pip to build the archive's build backend (scikit-build-core and its dependencies, which pip
installs to read the archive's metadata) from source.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ffn_tools.errors import FFNToolsError, pip_install
from ffn_tools.io.cache import CACHE_ENV, cache_dir  # noqa: F401  (CACHE_ENV: the tests set it through this module)

log = logging.getLogger(__name__)

ENV = "FFN_TOOLS_LLAMA_CPP"
PREFIX = Path(sys.prefix) / "llama.cpp"  # where the dev install (the Makefile) extracts the converter
TREE = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # what the writer runs, from llama.cpp's source
# extracted beside it where a fetch or `make install` puts the tree: the LoRA adapter writer's converter (not
# required of a tree: one fetched by an older ffn-tools, or a user's $FFN_TOOLS_LLAMA_CPP, may lack it)
LORA = "convert_lora_to_gguf.py"
DIST = "llama-cpp-python"
SDIST_SIZE = "77 MB"  # llama_cpp_python-0.3.36.tar.gz, measured; other versions are about as large
MARKER = ".ffn-tools-source"  # in a fetched tree: the distribution and version it came from


def missing(root: Path) -> list[str]:
    """The parts of ``TREE`` that ``root`` lacks."""
    return [p for p in TREE if not (root / p).exists()]


def installed_version() -> str | None:
    """The installed llama-cpp-python's version (its metadata; the package is not imported), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DIST)
    except PackageNotFoundError:
        return None


def installed_dir() -> Path | None:
    """Where llama.cpp's converter already lies, looked for as ``llama_cpp_dir`` does, or None: nothing fetched,
    nothing raised."""
    if os.environ.get(ENV):
        root = Path(os.environ[ENV])
        return None if missing(root) else root
    if not missing(PREFIX):
        return PREFIX
    version = installed_version()
    cached = cache_dir() / f"llama.cpp-{version}" if version else None
    return cached if cached is not None and not missing(cached) else None


def llama_cpp_dir() -> Path:
    """Where llama.cpp's converter lies: ``$FFN_TOOLS_LLAMA_CPP``, ``sys.prefix/llama.cpp``, this user's cache,
    or fetched into the cache from the installed llama-cpp-python's source distribution (``fetch``).

    Raises:
        FFNToolsError: ``$FFN_TOOLS_LLAMA_CPP`` lacks it; none found and it cannot be fetched (no llama-cpp-python
            installed, pip or the network unavailable, a version mismatch), saying how to provide it.
    """
    if os.environ.get(ENV):  # the user's own choice: used as it is, never replaced by a download
        root = Path(os.environ[ENV])
        if gone := missing(root):
            raise FFNToolsError(f"${ENV} is {root}, which lacks {', '.join(gone)}: point it at a llama.cpp source "
                                f"tree (convert_hf_to_gguf.py, conversion/ and gguf-py/), or unset it")
        return root
    if not missing(PREFIX):
        return PREFIX
    version = installed_version()
    if version is None:
        raise FFNToolsError(f"--to gguf runs llama.cpp's convert_hf_to_gguf.py, which is not at {PREFIX}, and "
                            f"llama-cpp-python, whose source distribution holds it, is not installed: "
                            f"{pip_install('gguf')}, or set {ENV} to a llama.cpp checkout")
    cached = cache_dir() / f"llama.cpp-{version}"
    if not missing(cached):
        return cached
    return fetch(version, cached)


def fetch(version: str, dest: Path) -> Path:
    """llama.cpp's converter from llama-cpp-python ``version``'s source distribution, downloaded by pip and
    extracted (``TREE`` only) into ``dest``, atomically; the archive is deleted.

    Raises:
        FFNToolsError: pip could not download it (no pip, no network, no such version on the index), or the
            archive is not that version's or lacks the converter.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.warning(f"--to gguf runs llama.cpp's convert_hf_to_gguf.py, which is not installed here: fetching it once "
                f"from the llama-cpp-python {version} source distribution (a {SDIST_SIZE} download by pip; 2 MB of "
                f"it kept) into {dest}")
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        sdist = download(version, Path(tmp) / "dist")
        tree = Path(tmp) / "tree"
        extract(sdist, version, tree)
        (tree / MARKER).write_text(f"{DIST} {version}\n{sdist.name}\n")
        try:
            tree.rename(dest)
        except OSError:  # another process put it there first: theirs is the same version's
            if missing(dest):
                raise
    return dest


def download(version: str, into: Path) -> Path:
    """The source distribution of llama-cpp-python ``version``, downloaded by ``python -m pip download`` into
    ``into``.

    Raises:
        FFNToolsError: pip failed, saying pip's own last line and how to get the converter otherwise.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", DIST, "--disable-pip-version-check",
           "-d", str(into), f"{DIST}=={version}"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    found = sorted(into.glob("*.tar.gz")) if into.is_dir() else []
    if proc.returncode != 0 or len(found) != 1:
        lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else
                   f"exit status {proc.returncode}")
        raise FFNToolsError(f"--to gguf needs llama.cpp's converter from the llama-cpp-python {version} source "
                            f"distribution, and `pip download {DIST}=={version}` failed ({why[:200]}): run it where "
                            f"pip reaches an index (or give pip a folder holding the archive: PIP_FIND_LINKS=DIR), "
                            f"or set {ENV} to a llama.cpp checkout of the same version")
    return found[0]


def extract(sdist: Path, version: str, tree: Path) -> None:
    """``TREE`` from the archive's ``vendor/llama.cpp`` into ``tree``, after checking the archive is llama-cpp-python
    ``version`` (its PKG-INFO). The archive is read in one pass (a gzip stream read again from its start for every
    backward seek: listing it first, then going back for each file, decompressed it two to three times), the wanted
    files (about 2 MB) held until the version is checked.

    Raises:
        FFNToolsError: another version, or no converter in it.
    """
    top = stated = None
    found = False
    kept: list[tuple[str, bytes | None]] = []  # (path under tree, the file's bytes; None: a directory), in order
    with tarfile.open(sdist) as tar:
        for m in tar:
            if top is None:
                top = m.name.split("/")[0]
            if not found and m.name == f"{top}/PKG-INFO":
                found = True
                if (f := tar.extractfile(m)) is not None:
                    stated = next((ln.split(":", 1)[1].strip() for ln in f.read().decode("utf-8", "replace")
                                   .splitlines() if ln.startswith("Version:")), None)
            base = f"{top}/vendor/llama.cpp/"
            if (m.name.startswith(base) and (m.isfile() or m.isdir())  # no links
                    and m.name[len(base):].split("/")[0] in (*TREE, LORA) and ".." not in m.name.split("/")):
                if m.isdir():
                    kept.append((m.name[len(base):], None))
                elif (src := tar.extractfile(m)) is not None:
                    with src:
                        kept.append((m.name[len(base):], src.read()))
    if stated != version:
        raise FFNToolsError(f"{sdist.name}: pip downloaded llama-cpp-python {stated or '(no version)'} where "
                            f"{version} is installed; the converter must be the installed llama.cpp's")
    tree.mkdir(parents=True)
    for name, data in kept:
        if data is None:
            (tree / name).mkdir(parents=True, exist_ok=True)
            continue
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(data)
    if gone := missing(tree):
        raise FFNToolsError(f"{sdist.name} holds no {', '.join(gone)} under vendor/llama.cpp: this llama-cpp-python "
                            f"cannot give llama.cpp's converter; set {ENV} to a llama.cpp checkout")
