"""Bad input and faults, as a hostile user would bring them: every one ends in one clear line and exit 2,
nothing outside the checkpoint is read, no temporary output is left behind, and inputs stay byte-identical.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import run_cli, tree_digest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ffn_tools.errors import CheckpointError, pip_install
from ffn_tools.io.safetensors_format import read_header

FFN_TOOLS = [sys.executable, "-m", "ffn_tools.cli"]


def _raw(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def _valid() -> tuple[dict, bytes]:
    """A tiny Llama-named checkpoint: header dict and data, both editable."""
    shapes = {"model.layers.0.mlp.gate_proj.weight": (4, 2), "model.layers.0.mlp.up_proj.weight": (4, 2),
              "model.layers.0.mlp.down_proj.weight": (2, 4)}
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    return header, bytes(range(256))[:off] + b"\0" * max(0, off - 256)


G, U, D = (f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))


def _edit(fn):
    def make():
        header, data = _valid()
        fn(header)
        return _raw(header, data)
    return make


BAD_FILES = {
    "empty": lambda: b"",
    "short": lambda: b"\x01\x02",
    "huge-header-length": lambda: struct.pack("<Q", 1 << 40) + b"{}",
    "header-past-end": lambda: struct.pack("<Q", 100) + b"{}",
    "not-json": lambda: struct.pack("<Q", 4) + b"{abc",
    "not-an-object": lambda: struct.pack("<Q", 2) + b"[]",
    "not-utf8": lambda: struct.pack("<Q", 4) + b"{\xff\xfe}",
    "overlap": _edit(lambda h: h[U].update(data_offsets=[16, 48])),
    "gap": _edit(lambda h: (h[U].update(data_offsets=[40, 72]), h[D].update(data_offsets=[72, 104]))),
    "swapped-with-wrong-size": _edit(lambda h: (h[G].update(data_offsets=[32, 64]), h[U].update(data_offsets=[0, 40]))),
    "float-offsets": _edit(lambda h: h[G].update(data_offsets=[0.0, 32.0])),
    "string-offsets": _edit(lambda h: h[G].update(data_offsets=["0", "32"])),
    "bool-dim": _edit(lambda h: h[D].update(shape=[True, 8])),
    "negative-dim": _edit(lambda h: h[D].update(shape=[-2, -4])),
    "float-dim": _edit(lambda h: h[D].update(shape=[2.0, 4])),
    "dtype-not-string": _edit(lambda h: h[D].update(dtype=7)),
    "dtype-unknown": _edit(lambda h: h[D].update(dtype="F128")),
    "size-mismatch": _edit(lambda h: h[D].update(shape=[2, 5])),
    "metadata-int-value": _edit(lambda h: h["__metadata__"].update(format=1)),
    "metadata-not-object": _edit(lambda h: h.update(__metadata__=["pt"])),
    "entry-not-object": _edit(lambda h: h.update({D: [1, 2]})),
    "missing-offsets": _edit(lambda h: h[D].pop("data_offsets")),
    "offsets-reversed": _edit(lambda h: h[D].update(data_offsets=[96, 64])),
    "trailing-bytes": lambda: _raw(*_valid()) + b"\0" * 8,
    "truncated-data": lambda: _raw(*_valid())[:-5],
    "duplicate-name": lambda: _dup(),
    # empty tensors whose shape multiplies out past a usize on the way (safetensors' reader refuses them), or
    # holds a dimension no torch tensor can have (int64 sizes)
    "empty-shape-overflows": lambda: _empty({D: [2 ** 62, 4, 0]}),
    "empty-dim-past-int64": lambda: _empty({D: [2 ** 63, 0]}),
}


def _empty(shapes: dict) -> bytes:
    """The valid checkpoint with the tensors of ``shapes`` emptied (no bytes) to those shapes."""
    header, data = _valid()
    for name, shape in shapes.items():
        gone = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
        header[name].update(shape=shape, data_offsets=[header[name]["data_offsets"][0]] * 2)
        for other in header.values():  # the tensors after it move down by its bytes
            if "data_offsets" in other and other is not header[name] and other["data_offsets"][0] >= header[name]["data_offsets"][0]:
                other["data_offsets"] = [o - gone for o in other["data_offsets"]]
        data = data[:header[name]["data_offsets"][0]] + data[header[name]["data_offsets"][0] + gone:]
    return _raw(header, data)


def _dup() -> bytes:
    header, data = _valid()
    text = json.dumps(header)
    g = json.dumps({G: header[G]})[1:-1]
    text = text[:-1] + ", " + g + "}"
    h = text.encode()
    return struct.pack("<Q", len(h)) + h + data


def _checkpoint_dir(tmp_path: Path, raw: bytes) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors").write_bytes(raw)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_act": "silu"}))
    return d


def _one_line_exit_2(r):
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit)
    assert len([ln for ln in r.output.splitlines() if ln.startswith("Error:")]) == 1, r.output


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_a_git_lfs_pointer_is_named_with_git_lfs_pull(model_dir, tmp_path, weights):
    """Issue 59.9: a clone made without Git LFS holds, under each weight file's name, the pointer git-lfs writes
    (its spec's three lines, the real file's sha256 and size). Read as safetensors it was "header claims
    2336927755350992246 bytes" (b"version " as a length); as a pickle, "could run code". Both name the pointer
    and `git lfs pull`, for inspect and verify, exit 2."""
    import hashlib
    import shutil

    real = (model_dir("llama") / "model.safetensors").read_bytes()
    d = tmp_path / "clone"
    d.mkdir()
    shutil.copy(model_dir("llama") / "config.json", d)
    (d / weights).write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(real).hexdigest()}"
                             f"\nsize {len(real)}\n")
    for args in (["inspect", d], ["verify", model_dir("llama"), d]):
        r = run_cli(*args, ok=False)
        assert f"Error: {d / weights}: a Git LFS pointer (" in r.output, r.output
        assert "run `git lfs pull` in the clone" in r.output and "header claims" not in r.output, r.output


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_headers_exit_2_with_one_line(tmp_path, case):
    d = _checkpoint_dir(tmp_path, BAD_FILES[case]())
    before = tree_digest(d)
    good = tmp_path / "good"
    good.mkdir()
    header, data = _valid()
    (good / "model.safetensors").write_bytes(_raw(header, data))
    for args in (["inspect", d], ["inspect", d, "--json"], ["split-gateup", d, "-o", tmp_path / "o1"],
                 ["fuse-gateup", d, "-o", tmp_path / "o2"], ["extract", d, "-o", tmp_path / "o3"],
                 ["convert", d, "--to", "mlx", "-o", tmp_path / "o4"], ["verify", good, d]):
        r = run_cli(*args, ok=None)
        _one_line_exit_2(r)
        if "--json" in args:
            assert "error" in json.loads(r.stdout)
    assert tree_digest(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "good"]  # no output, no temporary


@pytest.mark.parametrize("order", ["as-written", "offsets-not-in-name-order"])
def test_valid_header_is_accepted(tmp_path, order):
    header, data = _valid()
    if order != "as-written":  # tiled, but not in the order the names come: valid (the Rust reader sorts)
        header[G]["data_offsets"], header[U]["data_offsets"] = [32, 64], [0, 32]
    d = _checkpoint_dir(tmp_path, _raw(header, data))
    assert json.loads(run_cli("inspect", d, "--json").stdout)["ffn"]["dense"]["count"] == 1


# ------------------------------------------------------------------ indexes: nothing outside the directory


def _sharded(tmp_path: Path) -> Path:
    d = tmp_path / "sharded"
    d.mkdir()
    t = {G: torch.randn(4, 2), U: torch.randn(4, 2), D: torch.randn(2, 4)}
    save_file({G: t[G], U: t[U]}, d / "a.safetensors")
    save_file({D: t[D]}, d / "b.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {G: "a.safetensors", U: "a.safetensors", D: "b.safetensors"}}))
    return d


@pytest.mark.parametrize("case, weight_map, words", [
    ("climbs-out", {D: "../secret/b.safetensors"}, "points outside"),
    ("absolute", {D: "/etc/passwd"}, "'/etc/passwd'"),
    ("absent-tensor", {"model.layers.0.mlp.extra.weight": "b.safetensors"}, "which lacks it"),
    ("wrong-shard", {D: "a.safetensors"}, "mapped to a.safetensors, which lacks it"),
    ("phantom", "phantom", "missing from the weight_map ('model.norm.weight')"),
    ("missing-shard", {D: "c.safetensors"}, "do not exist"),
    ("not-a-map", "list", "weight_map"),
])
def test_bad_indexes_are_refused(tmp_path, case, weight_map, words):
    d = _sharded(tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    save_file({D: torch.full((2, 4), 7.0)}, secret / "b.safetensors")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    if weight_map == "phantom":  # a shard holds a tensor the map does not name
        save_file({D: torch.randn(2, 4), "model.norm.weight": torch.ones(2)}, d / "b.safetensors")
    elif weight_map == "list":
        index["weight_map"] = [G, U, D]
    else:
        index["weight_map"].update(weight_map)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    for args in (["inspect", d], ["convert", d, "--to", "torch", "-o", tmp_path / "out"]):
        r = run_cli(*args, ok=None)
        _one_line_exit_2(r)
        assert words in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_symlinked_shards_of_a_hub_cache_are_followed(tmp_path):
    """A Hugging Face cache snapshot: the shard names are links into ../../blobs/, which must keep working."""
    src = _sharded(tmp_path)
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    assert json.loads(run_cli("inspect", snap, "--json").stdout)["ffn"]["dense"]["count"] == 1


# ------------------------------------------------------------------ outputs: atomic, locked, clean


def test_output_parent_is_a_file(model_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    r = run_cli("fuse-gateup", model_dir("llama"), "-o", tmp_path / "file" / "out", ok=None)
    _one_line_exit_2(r)
    assert "is a file, not a directory" in r.output and str(tmp_path / "file" / "out") in r.output


def test_stale_temporaries_of_dead_processes_are_removed(model_dir, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.tmp-{int(dead.stdout)}-0123abcd"
    live = tmp_path / f".out.tmp-{os.getpid()}-4567abcd"
    stale.mkdir()
    live.mkdir()
    run_cli("fuse-gateup", model_dir("llama"), "-o", tmp_path / "out")
    assert not stale.exists() and live.exists()  # a running process's temporary is not touched


def test_a_second_writer_of_the_same_output_is_refused(model_dir, tmp_path):
    lock = tmp_path / ".out.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242")
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        r = run_cli("fuse-gateup", model_dir("llama"), "-o", tmp_path / "out", ok=None)
        _one_line_exit_2(r)
        assert "another ffn-tools process (PID 4242)" in r.output
    finally:
        os.close(fd)
    assert not (tmp_path / "out").exists()
    run_cli("fuse-gateup", model_dir("llama"), "-o", tmp_path / "out")
    assert not lock.exists()  # released and removed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signals_leave_no_temporary_output(model_dir, tmp_path, sig):
    """The command is stopped mid-write (a copy made to block), then signalled: nothing is left behind."""
    src = model_dir("llama")
    script = (
        "import signal, sys, time, ffn_tools.io.writer as w\n"
        # Ctrl-C as a terminal delivers it: a shell running this suite in the background (a job without job
        # control) starts its children with SIGINT ignored, which Python then keeps ignored
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "def slow(*a, **k):\n"
        "    print('writing', flush=True); time.sleep(60)\n"
        "w._copy_range = slow\n"
        "w.write_tensor = slow if hasattr(w, 'write_tensor') else None\n"
        "from ffn_tools.cli import main\n"
        f"sys.argv = ['ffn-tools', 'fuse-gateup', {str(src)!r}, '-o', {str(tmp_path / 'out')!r}, '--json']\n"
        "main()\n")
    before = tree_digest(src)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not any(n.name.startswith(".out.tmp-") for n in tmp_path.iterdir()) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig and "Traceback" not in err, (p.returncode, err)  # 130, 143, 129
    assert json.loads(out.splitlines()[-1]) == {"error": "interrupted", "signal": signal.Signals(sig).name}
    assert sorted(n.name for n in tmp_path.iterdir()) == [], sorted(n.name for n in tmp_path.iterdir())
    assert tree_digest(src) == before


# ------------------------------------------------------------------ other formats and packages


def test_pickle_that_runs_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    d = tmp_path / "m"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"model.layers.0.mlp.gate_proj.weight": Evil()}))
    r = run_cli("inspect", d, ok=None)
    _one_line_exit_2(r)
    assert "refused to load" in r.output and "Warning" not in r.output and not marker.exists()


def test_msgpack_work_is_bounded_by_the_file(tmp_path):
    p = tmp_path / "flax_model.msgpack"
    n = 30_000_000
    p.write_bytes(b"\x81\xa1a\xdd" + struct.pack(">I", n) + b"\x01" * 1000)  # claims 30M items in 1 KB
    r = run_cli("inspect", p, ok=None)
    _one_line_exit_2(r)
    # refused from the claim against the bytes left, before any item is read (its time: bench_timings.py)
    assert "an array of 30000000 items where 1000 bytes remain" in r.output, r.output


def test_mlx_directory_without_mlx_names_the_extra(model_dir, tmp_path):
    out = tmp_path / "mlx"
    run_cli("convert", model_dir("llama"), "--to", "mlx", "-o", out)
    code = ("import sys\nsys.modules.update(dict.fromkeys(['mlx', 'mlx.core', 'mlx_lm'], None))\n"
            f"from ffn_tools.cli import main\nsys.argv = ['ffn-tools', 'inspect', {str(out)!r}]\nmain()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"{pip_install('mlx')} (Apple silicon) or {pip_install('mlx-cpu')} (Linux)" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_an_mlx_that_does_not_load_names_the_extra(model_dir, tmp_path):
    """mlx installed without its backend (``pip install mlx`` on Linux): importing mlx.core raises an ImportError
    without a name, from the shared library; the error names the package and the Linux extra."""
    out = tmp_path / "mlx"
    run_cli("convert", model_dir("llama"), "--to", "mlx", "-o", out)
    broken = tmp_path / "site" / "mlx"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    (broken / "core.py").write_text("raise ImportError('libmlx.so: cannot open shared object file: No such file')\n")
    code = (f"import sys\nsys.path.insert(0, {str(tmp_path / 'site')!r})\n"
            f"from ffn_tools.cli import main\nsys.argv = ['ffn-tools', 'inspect', {str(out)!r}]\nmain()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "this needs mlx, which does not load here (libmlx.so: cannot open" in p.stderr, p.stderr
    assert pip_install("mlx-cpu") in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_missing_extra_is_installed_from_where_ffn_tools_came_from(tmp_path):
    """Issue 59.7: the hint for a missing extra said `pip install 'ffn-tools[mlx]'`, a name no index holds for
    ffn-tools (README installs from a clone; whoever registers the name would be installed). The hint is pip's
    command for where ffn-tools was installed from, as pip recorded it (PEP 610's direct_url.json): the checkout,
    editable or not, the repository and commit, the archive; the name only where an index gave it; and where the
    recorded checkout is gone, the extra's own requirements. This checkout's install is the first case."""
    from importlib.metadata import PathDistribution

    root = Path(__file__).resolve().parents[1]
    assert pip_install("mlx") == f"pip install -e '{root}[mlx]'"  # make install: pip install -e '.[...]'
    meta = ("Metadata-Version: 2.1\nName: ffn-tools\nVersion: 0.1.0\nProvides-Extra: gguf\n"
            "Requires-Dist: gguf>=0.17; extra == \"gguf\"\nRequires-Dist: llama-cpp-python>=0.3; extra == \"gguf\"\n"
            "Requires-Dist: torch>=2.2\n")
    clone = tmp_path / "my clone"
    clone.mkdir()
    origins = [(None, "pip install 'ffn-tools[gguf]'"),
               ({"url": clone.as_uri(), "dir_info": {"editable": True}}, f"pip install -e '{clone}[gguf]'"),
               ({"url": clone.as_uri(), "dir_info": {}}, f"pip install '{clone}[gguf]'"),
               ({"url": "https://github.com/o/ffn-tools", "vcs_info": {"vcs": "git", "commit_id": "abc123"}},
                "pip install 'ffn-tools[gguf] @ git+https://github.com/o/ffn-tools@abc123'"),
               ({"url": "https://example.org/ffn_tools-0.1.0.tar.gz", "archive_info": {}},
                "pip install 'ffn-tools[gguf] @ https://example.org/ffn_tools-0.1.0.tar.gz'"),
               ({"url": (tmp_path / "gone").as_uri(), "dir_info": {"editable": True}},
                "pip install 'gguf>=0.17' 'llama-cpp-python>=0.3'")]
    for i, (origin, hint) in enumerate(origins):
        info = tmp_path / f"d{i}" / "ffn_tools-0.1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(meta)
        if origin is not None:
            (info / "direct_url.json").write_text(json.dumps(origin))
        assert pip_install("gguf", PathDistribution(info)) == hint, origin


def test_verify_runs_without_transformers_and_says_its_load_check_did_not(model_dir, tmp_path):
    """Issue 59.7: README's extras table puts verify in the core install, but a default verify without transformers
    exited 2 ("... not installed here (transformers): ..."). It runs: every check that needs no transformers
    passes, and the load check says it did not run and how to install transformers, in its line and the verdict's
    list of what did not run (never passed); exit 0."""
    code = ("import sys\nsys.modules['transformers'] = None\nfrom ffn_tools.cli import main\n"
            f"sys.argv = ['ffn-tools', 'verify', {str(model_dir('llama'))!r}, {str(model_dir('llama'))!r}]\nmain()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0 and p.stderr == "", (p.stdout[-800:], p.stderr[-800:])
    verdict = p.stdout.splitlines()[-1]
    assert verdict.startswith("PASS: ") and ("load check not run (the load check needs transformers, which is not "
                                             "installed here: pip install transformers)") in verdict, verdict
    assert "(transformers):" not in p.stdout


def test_an_empty_tensor_mlx_cannot_shape_is_refused_in_one_line(tmp_path):
    """Issue 37.10: [2^62, 0] is valid safetensors (0 bytes; torch and safetensors read it), but no MLX array has a
    dimension past 2^31 - 1: convert --to mlx printed mlx's OverflowError with a traceback."""
    pytest.importorskip("mlx_lm")
    from safetensors import safe_open

    d = tmp_path / "m"
    d.mkdir()
    header, data = _valid()
    header["model.embed_tokens.weight"] = {"dtype": "F32", "shape": [2 ** 62, 0], "data_offsets": [len(data)] * 2}
    (d / "model.safetensors").write_bytes(_raw(header, data))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_act": "silu", "hidden_size": 2,
                                               "intermediate_size": 4, "num_attention_heads": 1, "num_hidden_layers": 1,
                                               "rms_norm_eps": 1e-5, "vocab_size": 8}))
    with safe_open(str(d / "model.safetensors"), "pt") as f:  # the reference reader takes it
        assert f.get_tensor("model.embed_tokens.weight").shape == (2 ** 62, 0)
    for args in (["convert", d, "--to", "mlx", "-o", tmp_path / "mlx"],
                 ["convert", d, "--to", "mlx", "-q", "-o", tmp_path / "mlx-q"]):
        r = run_cli(*args, ok=False)
        assert "model.embed_tokens.weight [4611686018427387904, 0]" in r.output and "MLX" in r.output, r.output
    run_cli("convert", d, "--to", "torch", "-o", tmp_path / "torch")  # the others carry it as it is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "torch"]


def test_json_errors_go_to_stdout_too(tmp_path):
    d = _checkpoint_dir(tmp_path, b"garbage!")
    r = run_cli("inspect", d, "--json", ok=None)
    assert r.exit_code == 2 and "not a safetensors file" in json.loads(r.stdout)["error"]
    assert "Error:" in r.stderr


# ------------------------------------------------------------------ fuzzing: our reader agrees with safetensors'

DTYPES = ["F32", "F16", "BF16", "I64", "U8", "BOOL", "F64"]
ITEM = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1, "F64": 8}

value = st.one_of(st.integers(-3, 40), st.floats(-1, 40), st.text(max_size=3), st.booleans(), st.none())
entry = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(DTYPES), value),
    "shape": st.one_of(st.lists(st.integers(0, 4), max_size=3), st.lists(value, max_size=3), value),
    "data_offsets": st.one_of(st.lists(st.integers(0, 64), min_size=2, max_size=2), st.lists(value, max_size=3)),
})


@st.composite
def headers(draw):
    """Mostly well-formed headers (tiled offsets), with random damage."""
    names = draw(st.lists(st.text("abcdef.", min_size=1, max_size=6), min_size=1, max_size=4, unique=True))
    header, off = {}, 0
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        n = ITEM[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    if draw(st.booleans()):
        victim = draw(st.sampled_from(names))
        header[victim] = draw(entry)
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=3), st.one_of(st.text(max_size=3), value),
                                                      max_size=2))
    extra = draw(st.sampled_from([0, 0, 0, 1, 8]))
    return header, off + extra - draw(st.sampled_from([0, 0, 0, 1]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(headers())
def test_fuzzed_headers_agree_with_safetensors(tmp_path, spec):
    from safetensors import safe_open

    header, size = spec
    p = tmp_path / "f.safetensors"
    p.write_bytes(_raw(header, b"\0" * max(size, 0)))
    try:
        entries, _ = read_header(p)
        ours = True
    except CheckpointError:
        ours = False
    try:
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k)
        theirs = True
    except Exception:  # noqa: BLE001 - any refusal of the reference reader
        theirs = False
    if ours:  # what we accept, safetensors reads in full (we may be stricter, never looser)
        assert theirs, header


@pytest.mark.parametrize("key, value", [("model_type", ["llama"]), ("hidden_act", {"a": 1}),
                                        ("architectures", "LlamaForCausalLM"), ("model_type", 5)])
def test_config_keys_of_the_wrong_type(model_dir, tmp_path, key, value):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(model_dir("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    for args in (["inspect", d], ["split-gateup", d, "-o", tmp_path / "o"], ["verify", model_dir("llama"), d]):
        r = run_cli(*args, ok=None)
        _one_line_exit_2(r)
        assert f"{key} must be" in r.output


def test_output_inside_the_input_directory_is_refused(model_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(model_dir("llama"), d)
    before = tree_digest(d)
    r = run_cli("fuse-gateup", d, "-o", d / "fused", ok=None)
    _one_line_exit_2(r)
    assert "inside the input directory" in r.output and tree_digest(d) == before


@pytest.mark.parametrize("case", ["zero-d_ffn", "integer-weights"])
def test_degenerate_ffn_tensors(tmp_path, case):
    t = ({G: torch.zeros(0, 4), U: torch.zeros(0, 4), D: torch.zeros(4, 0)} if case == "zero-d_ffn" else
         {G: torch.ones(8, 4, dtype=torch.int64), U: torch.ones(8, 4, dtype=torch.int64),
          D: torch.ones(4, 8, dtype=torch.int64)})
    d = tmp_path / "m"
    d.mkdir()
    save_file(t, d / "model.safetensors")
    words = "zero dimension" if case == "zero-d_ffn" else "floating point"
    r = run_cli("inspect", d, ok=None)
    _one_line_exit_2(r)
    assert words in r.output
    r = run_cli("verify", d, d, ok=None)  # found, but not an FFN one can run: a failed check naming the tensor
    assert r.exit_code == 1 and words in r.output and "Traceback" not in r.output


def test_split_load_check_without_transformers_says_so_and_warns_from_the_familys_data(model_dir, tmp_path):
    """--load-check asked for where transformers is not installed: it says it did not run, and the family's data
    still warns that Phi-3's class holds its FFNs fused (asking for the stronger check gave no warning at all)."""
    out = tmp_path / "split"
    code = ("import sys\nsys.modules['transformers'] = None\nfrom ffn_tools.cli import main\n"
            f"sys.argv = ['ffn-tools', 'split-gateup', {str(model_dir('phi3'))!r}, '-o', {str(out)!r}, "
            "'--load-check']\nmain()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-800:]
    assert "--load-check did not run: " in p.stderr and "pip install transformers" in p.stderr, p.stderr
    assert "phi3 model class holds its FFNs fused" in p.stderr, p.stderr


def test_run_options_travel_as_one_value_and_io_imports_nothing_above_it():
    """#53: no ContextVar carries a run option anywhere (the executor takes ``io.run.Run``; verify's Ray connection
    and ledger are its options' fields); ``io/`` imports only the leaf modules beside it (errors, progress, sizes),
    never the executor, Ray or the commands; nothing re-runs a command (``rerun`` is gone)."""
    import ast

    import ffn_tools

    root = Path(ffn_tools.__file__).resolve().parent
    sources = [p for base in (root, root.parent / "converters") for p in base.rglob("*.py")]
    assert len(sources) > 100
    carriers = [str(p) for p in sources if "ContextVar" in p.read_text()]
    assert carriers == []
    assert not (root / "rerun.py").exists()
    above = []
    for p in (root / "io").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                top = (node.module or "").split(".")[0]
                if node.level > 2 or top not in ("errors", "progress", "sizes"):
                    above.append(f"{p.name}: from {'.' * node.level}{node.module}")
    assert above == []
