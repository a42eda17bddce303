"""Shared fixtures: tiny real checkpoints, built once per session per (arch, dtype, variant)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests build every checkpoint locally: never wait on a hub
if not torch.cuda.is_available():  # Triton runs through its interpreter; must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402
from helpers import write_tokenizer  # noqa: E402


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


@pytest.fixture(scope="session")
def gguf_model(tmp_path_factory):
    """``gguf_model(arch, dtype=torch.float32) -> Path``: a tiny checkpoint with a llama.cpp vocabulary (cached)."""
    import gguf_models

    cache: dict = {}

    def get(arch: str, dtype: torch.dtype = torch.float32) -> Path:
        if (arch, dtype) not in cache:
            path = tmp_path_factory.mktemp(f"gguf-{arch}") / "model"
            cache[arch, dtype] = gguf_models.build(arch, path, dtype)
        return cache[arch, dtype]

    return get


@pytest.fixture(scope="session")
def gguf_ref(gguf_model, tmp_path_factory):
    """``gguf_ref(arch, outtype, dtype=torch.float32) -> Path``: llama.cpp's convert_hf_to_gguf.py output of
    ``gguf_model(arch, dtype)`` (cached)."""
    import gguf_models

    cache: dict = {}

    def get(arch: str, outtype: str = "f32", dtype: torch.dtype = torch.float32) -> Path:
        key = (arch, outtype, dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ref-{arch}-{outtype}") / f"{arch}-{outtype}.gguf"
            cache[key] = gguf_models.convert_reference(gguf_model(arch, dtype), out, outtype)
        return cache[key]

    return get
