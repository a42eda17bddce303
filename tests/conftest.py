"""Shared fixtures: tiny real checkpoints, built once per session per (arch, dtype, variant)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests build every checkpoint locally: never wait on a hub
if not torch.cuda.is_available():  # Triton runs through its interpreter; must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402


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
