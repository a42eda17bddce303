"""Shared fixtures: tiny real checkpoints, built once per session per (arch, dtype, variant)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

# one OpenMP thread a process: two xdist workers share two cores, and each torch's second thread spun in libgomp
# waiting for work (perf over a whole run: ~9% of the suite's CPU time, in the workers and their children)
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

os.environ.setdefault("PYTHONSAFEPATH", "1")  # children's `python -m`: no repository root first (ffn_tools.child)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests build every checkpoint locally: never wait on a hub
# dry runs plan only (each estimate is a sample run in a child process: seconds); test_estimate.py asks for them
os.environ.setdefault("FFN_TOOLS_ESTIMATE", "0")
if not torch.cuda.is_available():  # Triton runs through its interpreter; must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402
from helpers import once, write_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``model_dir(arch, dtype=torch.float32, **build_kwargs) -> Path``: a cached tiny checkpoint directory.

    Treat the result as read-only (several tests share it); copy it before modifying anything.
    """
    cache: dict = {}

    def get(arch: str, dtype: torch.dtype = torch.float32, **kwargs) -> Path:
        key = (arch, dtype, tuple(sorted(kwargs.items())))
        if key not in cache:
            tag = "-".join([arch, str(dtype).removeprefix("torch."), *(f"{k}{v}" for k, v in sorted(kwargs.items()))])
            cache[key] = tiny_models.build(arch, tmp_path_factory.mktemp(tag) / "model", dtype, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def hf(model_dir, tmp_path_factory):
    """``hf(arch, dtype, **config) -> Path``: a tiny transformers checkpoint plus a tokenizer (cached)."""
    cache: dict = {}

    def get(arch: str, dtype: torch.dtype = torch.float32, **config) -> Path:
        key = (arch, dtype, tuple(sorted(config.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"hf-{arch}") / "model"
            shutil.copytree(model_dir(arch, dtype), path)
            write_tokenizer(path)
            if config:
                cfg = json.loads((path / "config.json").read_text())
                (path / "config.json").write_text(json.dumps({**cfg, **config}, indent=2))
            cache[key] = path
        return cache[key]

    return get


@pytest.fixture(scope="session", autouse=True)
def shared_dir(tmp_path_factory) -> Path:
    """A directory all xdist workers of this run share (the run's own temporary directory without xdist), for
    fixtures that are slow to build and the same on every worker: one worker builds each, under a file lock,
    and the others wait for it and reuse it (``once``). It also holds the vocabulary tokenizers
    (``gguf_models.vocab_files``)."""
    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "shared"
    shared.mkdir(exist_ok=True)
    os.environ["FFN_TOOLS_TEST_SHARED"] = str(shared)
    return shared


@pytest.fixture(scope="session")
def gguf_model(shared_dir):
    """``gguf_model(name, dtype=torch.float32) -> Path``: a tiny checkpoint with a real tokenizer its GGUF
    converter accepts (``gguf_models``: ``name`` is an arch, or ``llama-spm`` etc. for a family's real
    vocabulary), built once per run (``shared_dir``): treat it as read-only, copy it before changing anything."""
    import gguf_models

    def get(arch: str, dtype: torch.dtype = torch.float32) -> Path:
        tag = f"gguf-{arch}-{str(dtype).removeprefix('torch.')}"
        return once(shared_dir / tag, lambda tmp: gguf_models.build(arch, tmp / "model", dtype)) / "model"

    return get


@pytest.fixture(scope="session")
def gguf_ref(gguf_model, shared_dir):
    """``gguf_ref(arch, outtype, dtype=torch.float32) -> Path``: llama.cpp's convert_hf_to_gguf.py output of
    ``gguf_model(arch, dtype)``, made once per run (``shared_dir``)."""
    import gguf_models

    def get(arch: str, outtype: str = "f32", dtype: torch.dtype = torch.float32) -> Path:
        src, name = gguf_model(arch, dtype), f"{arch}-{outtype}.gguf"
        tag = f"ref-{arch}-{outtype}-{str(dtype).removeprefix('torch.')}"
        made = once(shared_dir / tag, lambda tmp: gguf_models.convert_reference(src, tmp.mkdir() or tmp / name,
                                                                                outtype))
        return made / name

    return get


def pytest_collection_finish(session) -> None:
    """Everything imported and collected so far moved out of the collector's sight (``gc.freeze``): each full
    collection walked every object of torch, transformers, MLX, JAX and the collected tests again (perf over a
    whole run: ~15% of the suite's CPU time in ``gc_collect_main`` and its visits, ~4% in the two xdist workers,
    the rest in the processes tests start)."""
    gc.collect()
    gc.freeze()
