"""Receipts: every output carries one (tool, command, options, sources and outputs with their BLAKE3 digests), and
``verify --receipt OUT`` checks an output against it without the source (and one of version 1, with SHA-256)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import blake3
import pytest
import torch

from ffn_tools.io.receipt import NAME

from helpers import run_cli


def _b3(p: Path) -> str:
    return blake3.blake3(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    from tiny_models import build

    return build("phi3", tmp_path_factory.mktemp("receipt") / "phi3", torch.bfloat16, max_shard_size="60KB")


@pytest.fixture(scope="module")
def split(sharded, tmp_path_factory):
    out = tmp_path_factory.mktemp("receipt-out") / "split"
    run_cli("split-gateup", sharded, "-o", out, "--max-shard-size", "40KB")
    return out


def test_receipt_records_the_command_its_sources_and_every_output_file(sharded, split):
    r = json.loads((split / NAME).read_text())
    assert r["tool"]["name"] == "ffn-tools" and r["tool"]["version"]
    assert "torch" in r["tool"]["libraries"]
    assert r["command"] == "split-gateup"
    assert r["options"]["max_shard_size"] == 40_000 and r["options"]["path"] == str(sharded)
    assert "out" not in r["options"] and r["output"] == split.name  # the receipt moves with the output
    # every source file the run read (shards, index, side files), each with its own bytes' BLAKE3
    sources = {Path(s["path"]).name: s for s in r["sources"]}
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and set(shards) <= set(sources)
    assert {"config.json", "model.safetensors.index.json"} <= set(sources)
    for s in r["sources"]:
        p = Path(s["path"])
        assert p.is_absolute() and s["size"] == p.stat().st_size and s["blake3"] == _b3(p)
    # every output file but the receipt, by its path in the output
    files = sorted(p.relative_to(split).as_posix() for p in split.rglob("*") if p.is_file() and p.name != NAME)
    assert [o["path"] for o in r["outputs"]] == files
    assert len([f for f in files if f.endswith(".safetensors")]) > 1
    for o in r["outputs"]:
        assert o["size"] == (split / o["path"]).stat().st_size and o["blake3"] == _b3(split / o["path"])


def test_verify_receipt_passes_an_untouched_output_and_fails_each_change(split, tmp_path):
    r = run_cli("verify", "--receipt", split, "--json")
    got = json.loads(r.output)
    assert got["passed"] and got["summary"].startswith("PASS") and got["sources_checked"] is False
    assert "sources: not read" in run_cli("verify", "--receipt", split).output

    out = tmp_path / "copy"
    shutil.copytree(split, out)
    shard = sorted(out.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one bit of a weight, the size unchanged
    shard.write_bytes(bytes(data))
    (out / "notes.txt").write_text("added\n")
    (out / "config.json").unlink()
    r = run_cli("verify", "--receipt", out, ok=None)
    assert r.exit_code == 1, r.output
    assert f"{shard.name}: BLAKE3" in r.output and "same size: its bytes changed" in r.output
    assert "notes.txt: not in the receipt" in r.output
    assert "config.json: missing" in r.output and r.output.rstrip().splitlines()[-1].startswith("FAIL")


def test_one_file_output_carries_its_receipt_beside_it_and_force_replaces_both(model_dir, tmp_path):
    src = model_dir("phi3", torch.bfloat16) / "model.safetensors"
    out = tmp_path / "split.safetensors"
    run_cli("split-gateup", src, "-o", out)
    side = tmp_path / f"split.safetensors.{NAME}"
    first = json.loads(side.read_text())
    assert [o["path"] for o in first["outputs"]] == ["split.safetensors"] and first["output"] == "split.safetensors"
    assert first["outputs"][0]["blake3"] == _b3(out)
    assert [Path(s["path"]).name for s in first["sources"]][0] == "model.safetensors"
    run_cli("verify", "--receipt", out)
    run_cli("split-gateup", src, "-o", out, "--force")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split.safetensors", f"split.safetensors.{NAME}"]
    assert json.loads(side.read_text())["options"]["force"] is True
    out.write_bytes(out.read_bytes()[:-1])
    assert run_cli("verify", "--receipt", out, ok=None).exit_code == 1


def test_a_receipt_is_never_carried_into_the_next_output(split, tmp_path):
    out = tmp_path / "fused"
    run_cli("fuse-gateup", split, "-o", out)
    r = json.loads((out / NAME).read_text())
    assert r["command"] == "fuse-gateup"
    assert NAME not in {Path(s["path"]).name for s in r["sources"]}
    assert all(o["path"] != NAME for o in r["outputs"])
    run_cli("verify", "--receipt", out)


def test_verify_receipt_errors(split, model_dir, tmp_path):
    r = run_cli("verify", "--receipt", split, split, ok=False)
    assert "give no A or B" in r.output
    r = run_cli("verify", split, ok=False)
    assert "--receipt OUT" in r.output
    r = run_cli("verify", "--receipt", model_dir("phi3", torch.bfloat16), ok=False)
    assert "has no receipt" in r.output
    r = run_cli("verify", "--receipt", tmp_path / "nothing", ok=False)
    assert "no such output" in r.output


def test_a_version_1_receipt_is_checked_by_its_sha256(split, tmp_path):
    """Receipts written before BLAKE3 (version 1: SHA-256 digests) are still read, and checked by SHA-256."""
    out = tmp_path / "old"
    shutil.copytree(split, out)
    r = json.loads((out / NAME).read_text())
    r["receipt"] = 1
    for o in r["outputs"]:
        o["sha256"] = hashlib.sha256((out / o["path"]).read_bytes()).hexdigest()
        del o["blake3"]
    (out / NAME).write_text(json.dumps(r))
    got = run_cli("verify", "--receipt", out)
    assert "each of its size and SHA-256" in got.output, got.output
    config = out / "config.json"
    data = config.read_bytes()
    config.write_bytes(data[:-1] + (b" " if data[-1:] != b" " else b"\n"))  # its last byte, the size unchanged
    got = run_cli("verify", "--receipt", out, ok=None)
    assert got.exit_code == 1 and "config.json: SHA-256" in got.output, got.output


def test_a_file_hashed_ahead_is_read_once_and_its_digest_is_the_files(tmp_path, monkeypatch):
    """``digests.ahead`` hashes a conversion's sources on a thread while it checks and plans; the receipt's own
    hashing of a file that thread is reading waits for its digest instead of reading the file a second time."""
    import threading

    from ffn_tools.io import digests

    f = tmp_path / "big.bin"
    f.write_bytes(bytes(range(256)) * (64 << 10))  # 16 MB: 16 chunks
    reads, entered, go = [], threading.Event(), threading.Event()

    def slow(path, ident, stop, *more, real=digests._hashed):
        reads.append(path)
        entered.set()
        go.wait(30)  # the receipt's thread asks while this one is reading
        return real(path, ident, stop, *more)

    monkeypatch.setattr(digests, "_hashed", slow)
    got = []
    with digests.ahead([f]):
        assert entered.wait(30)
        asker = threading.Thread(target=lambda: got.append(digests.file_digest(f)))
        asker.start()
        go.set()
        asker.join(30)
    assert got == [blake3.blake3(f.read_bytes()).hexdigest()] and reads == [f]


def test_a_stopped_caller_does_not_wait_for_a_file_another_thread_is_hashing(tmp_path, monkeypatch):
    """The receipt of a run that failed stops its hashing (``Sources.stop``): a file the ahead thread is still
    reading is not waited for."""
    import threading

    from ffn_tools.io import digests

    f = tmp_path / "big.bin"
    f.write_bytes(b"\2" * (1 << 20))
    entered, go, hashed = threading.Event(), threading.Event(), threading.Event()

    def slow(path, ident, stop, *more, real=digests._hashed):
        entered.set()
        go.wait(30)
        hashed.set()  # the ahead thread's digest exists only from here
        return real(path, ident, stop, *more)

    monkeypatch.setattr(digests, "_hashed", slow)
    stop = threading.Event()
    stop.set()
    with digests.ahead([f]):
        assert entered.wait(30)
        assert digests.file_digest(f, stop) is None
        assert not hashed.is_set()  # returned without waiting for the thread (which waits until ``go``)
        go.set()


def test_hashing_ahead_stops_when_its_block_ends(tmp_path, monkeypatch):
    """A conversion that fails while its sources are hashed ahead leaves no thread reading them: the block's end
    stops it within a window, and nothing is remembered for the file it did not finish."""
    from ffn_tools.io import digests

    import threading

    f = tmp_path / "big.bin"
    f.write_bytes(b"\1" * (32 << 20))
    monkeypatch.setattr(digests, "WINDOW", 512)  # 65,536 windows: still reading when the block ends
    before = set(digests._known)
    with digests.ahead([f]):
        pass
    assert not [t for t in threading.enumerate() if t.name == "ffn-tools-hash-ahead"]
    assert set(digests._known) == before  # stopped before the file's end: no digest of part of it remembered
    assert digests.file_digest(f) == blake3.blake3(f.read_bytes()).hexdigest()  # and hashed whole when asked


def test_a_file_is_hashed_through_its_mapping_whole_in_part_and_on_several_threads(tmp_path, monkeypatch):
    """``digests.hash_into`` feeds a mapped file window by window (the window boundaries fall inside the file), a
    byte budget's prefix of it (the sample run's share), an empty file (which cannot be mapped) by reading; BLAKE3's
    own threads give the same digest."""
    from ffn_tools.io import digests

    monkeypatch.setattr(digests, "WINDOW", 3000)
    f = tmp_path / "w.bin"
    data = bytes(range(251)) * 400  # 100,400 bytes: 34 windows, the last one short
    f.write_bytes(data)
    for budget in (None, 7, 3000, 6001, len(data), 10 * len(data)):
        h = blake3.blake3()
        assert digests.hash_into(h, f, budget=budget)
        assert h.hexdigest() == blake3.blake3(data[:budget]).hexdigest()
    stop = threading.Event()
    stop.set()
    assert not digests.hash_into(blake3.blake3(), f, stop)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert digests.file_digest(empty) == blake3.blake3(b"").hexdigest()
    assert digests.file_digest(f, fresh=True, threads=blake3.blake3.AUTO) == blake3.blake3(data).hexdigest()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssFile from /proc")
def test_a_mapped_file_hashed_keeps_one_window_resident(tmp_path, monkeypatch):
    """A mapping keeps every page it touched in the process's RSS: hashed through one, a 5 GB shard counted 5 GB
    (measured in the MLX benchmark). Each window's pages leave it once hashed (they stay in the page cache)."""
    from ffn_tools.io import digests

    def rss_file() -> int:
        row = next(r for r in Path("/proc/self/status").read_text().splitlines() if r.startswith("RssFile:"))
        return int(row.split()[1]) * 1024

    monkeypatch.setattr(digests, "WINDOW", 1 << 20)
    f = tmp_path / "big.bin"
    f.write_bytes(b"\3" * (48 << 20))
    seen = []

    class Hasher:
        def __init__(self):
            self.h = blake3.blake3()

        def update(self, data):
            self.h.update(data)
            seen.append(rss_file())

    base = rss_file()
    h = Hasher()
    assert digests.hash_into(h, f)
    assert h.h.hexdigest() == blake3.blake3(f.read_bytes()).hexdigest() and len(seen) == 48
    assert max(seen) - base < 8 << 20, (base, max(seen))  # a window or two of 1 MiB, not the 48 MiB file
