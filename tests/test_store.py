"""Lazy checkpoint reading: every input form, metadata without data, and clear errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers import run_cli, tensors
from safetensors.torch import save_file

from ffn_tools.errors import CheckpointError
from ffn_tools.io.store import config_dtype
from ffn_tools.io.readers import open_checkpoint


def test_directory_file_and_index_agree(model_dir, tmp_path):
    d = model_dir("llama")
    sharded = model_dir("llama", max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    base = tensors(d)
    for p in (d, d / "model.safetensors", sharded, sharded / "model.safetensors.index.json"):
        with open_checkpoint(p) as c:
            assert set(c) == set(base)
            assert all(torch.equal(c[n], base[n]) for n in c)
    with open_checkpoint(sharded) as c:
        assert len(c.files) > 1


def test_shapes_and_dtypes_without_reading(model_dir, monkeypatch):
    d = model_dir("qwen2_moe", torch.bfloat16)
    with open_checkpoint(d) as c:
        monkeypatch.setattr(type(c), "_read", lambda self, info: pytest.fail("data was read"))
        info = c.info("model.layers.0.mlp.experts.1.gate_proj.weight")
        assert info.shape == (48, 64) and info.dtype == torch.bfloat16 and info.nbytes == 48 * 64 * 2
        assert c.total_bytes == sum(c.info(n).nbytes for n in c)


def test_pickle_loads_with_weights_only(model_dir):
    d = model_dir("llama", safe_serialization=False)
    assert (d / "pytorch_model.bin").is_file()
    with open_checkpoint(d) as c:
        assert c.kind == "pickle"
        assert torch.equal(c["model.layers.1.mlp.up_proj.weight"],
                           tensors(model_dir("llama"))["model.layers.1.mlp.up_proj.weight"])


def test_config_dtype_keys():
    assert config_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert config_dtype({"torch_dtype": "float16"}) == "float16"
    assert config_dtype({"dtype": "float32", "torch_dtype": "float16"}) == "float32"
    assert config_dtype({}) is None


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _truncate(src, dst):
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) - 100])


def _corrupt_header(src, dst):
    data = bytearray(src.read_bytes())
    data[10:20] = b"\xff" * 10
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"),
    ("not-a-checkpoint", "not a checkpoint"),
    ("text-as-safetensors", "not a safetensors file"),
    ("truncated", "truncated"),
    ("corrupted-header", "corrupted safetensors header"),
    ("index-missing-shard", "shard(s) that do not exist"),
    ("evil-pickle", "refused to load"),
    ("empty-dir", "no checkpoint here"),
])
def test_bad_input_is_a_one_line_error(model_dir, tmp_path, case, message):
    src = model_dir("llama") / "model.safetensors"
    p = tmp_path / "x"
    if case == "missing":
        p = tmp_path / "nope.safetensors"
    elif case == "not-a-checkpoint":
        p = tmp_path / "notes.txt"
        p.write_text("hello")
    elif case == "text-as-safetensors":
        p = tmp_path / "model.safetensors"
        p.write_text("hello")
    elif case == "truncated":
        p = tmp_path / "model.safetensors"
        _truncate(src, p)
    elif case == "corrupted-header":
        p = tmp_path / "model.safetensors"
        _corrupt_header(src, p)
    elif case == "index-missing-shard":
        p = tmp_path / "sharded"
        shutil.copytree(model_dir("llama", max_shard_size="50KB"), p)
        next(p.glob("model-00002-*.safetensors")).unlink()
    elif case == "evil-pickle":
        p = tmp_path / "pytorch_model.bin"
        torch.save({"w": torch.ones(2), "x": Evil()}, p)
    elif case == "empty-dir":
        p.mkdir()
    if case != "missing":
        with pytest.raises(CheckpointError, match=message.split("(")[0]):
            open_checkpoint(p)
    r = run_cli("inspect", p, ok=False)
    assert message.split("(")[0] in r.output or case == "missing"


def test_duplicate_tensor_across_files_is_reported(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"a": torch.zeros(2)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="appears in both"):
        open_checkpoint(tmp_path)


def test_header_offsets_are_absolute(tmp_path):
    t = {"x": torch.arange(10, dtype=torch.float32), "y": torch.arange(4, dtype=torch.bfloat16)}
    save_file(t, tmp_path / "m.safetensors")
    with open_checkpoint(tmp_path / "m.safetensors") as c:
        data = (tmp_path / "m.safetensors").read_bytes()
        for n in t:
            i = c.info(n)
            assert data[i.start:i.start + i.nbytes] == t[n].view(torch.uint8).numpy().tobytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert json.loads(data[8:8 + n])["x"]["dtype"] == "F32"


def test_zip_pickles_are_read_and_copied_by_offset(model_dir, tmp_path):
    """torch.save's zip stores each storage uncompressed: tensors get file offsets, are read with pread
    (equal to torch.load's) and copied byte for byte; a legacy pickle has no offsets and is still read."""
    src = model_dir("llama", safe_serialization=False)
    full = torch.load(src / "pytorch_model.bin", weights_only=True)
    with open_checkpoint(src) as c:
        assert all(c.info(n).start is not None for n in c)
        for n in c:
            assert torch.equal(c[n], full[n]), n
    legacy = tmp_path / "legacy"
    shutil.copytree(src, legacy)
    torch.save(full, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with open_checkpoint(legacy) as c:
        assert all(c.info(n).start is None for n in c) and all(torch.equal(c[n], full[n]) for n in c)


def test_a_checkpoint_pickles_as_how_to_open_it_again(model_dir, tmp_path, monkeypatch):
    """A --ray task's plan slice carries its input checkpoint: pickled as its format, path (absolute) and which
    object of what opening it gives, never its open files; opened again elsewhere (another working directory), it
    reads the same tensors."""
    import pickle

    from ffn_tools.converters import open_any

    src = model_dir("llama")
    monkeypatch.chdir(src.parent)
    with open_any(src.name) as ckpt:  # a relative path, as a user gives it
        want = {name: ckpt[name] for name in ckpt}
        blob, blob_stored = pickle.dumps(ckpt), pickle.dumps(ckpt.stored)  # in the driver's working directory
        assert len(blob) < 2000  # a recipe, not the tensors
        monkeypatch.chdir(tmp_path)  # the task's working directory is not the driver's
        again = pickle.loads(blob)
        assert type(again) is type(ckpt) and again.format.name == ckpt.format.name
        assert Path(again.path) == src.resolve() and list(again) == list(ckpt)
        for name, t in want.items():
            assert torch.equal(again[name], t)
        stored = pickle.loads(blob_stored)  # the checkpoint a view decodes comes back as itself
        assert type(stored) is type(ckpt.stored)
    with open_any(src) as a, open_any(src, like=a) as b:  # read beside another (an MLX B traces A's layout)
        read_beside = pickle.loads(pickle.dumps(b)).like
        assert read_beside is not None and Path(read_beside.path) == src.resolve()


def test_a_single_file_carries_every_side_file_verify_compares(tmp_path):
    """Beside a single .safetensors input, the executor carries config.json and every side file a client reads
    (``io.store.SIDE_FILES``: the list verify compares, mistral_common's tekken.json and tokenizer.model.v3 too)."""
    from ffn_tools.executor import side_files
    from ffn_tools.io.store import SIDE_FILES

    save_file({"w": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    for name in ("config.json", "tekken.json", "tokenizer.model.v3", "tokenizer.json", "notes.txt"):
        (tmp_path / name).write_text("{}")
    with open_checkpoint(tmp_path / "model.safetensors") as ckpt:
        carried = {p.name for p in side_files(ckpt)}
    assert carried == {"config.json", "tekken.json", "tokenizer.model.v3", "tokenizer.json"}
    assert {"tekken.json", "tokenizer.model.v3"} <= set(SIDE_FILES)
