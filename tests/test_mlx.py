"""MLX format, checked against mlx-lm itself: ``mlx_lm.load`` runs the export, ``mlx_lm.convert`` quantizes the
same model to the same bits, and transformers reloads what comes back."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_identical, raw, run_cli, tensors, tree_digest, write_tokenizer

import tiny_models
from ffn_tools.converters import convert, detect_format, open_any
from ffn_tools.errors import CheckpointError, FFNToolsError, OutputExistsError

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
# our own modules: with mlx and mlx_lm present they must import (an importorskip here would hide a broken one)
import ffn_tools.converters.mlx as mlx_format  # noqa: E402
import ffn_tools.converters.mlx.models as mlx_models  # noqa: E402
import ffn_tools.converters.mlx.quant as mlx_quant  # noqa: E402

ARCHS = ["llama", "qwen2", "mistral", "phi3", "mixtral", "qwen2_moe"]
TOKENS = torch.arange(3, 19).reshape(2, 8)
# Keys the export adds because mlx-lm reads transformers v4 names (see converters/mlx/models.py ALIASES).
V4_KEYS = {*mlx_models.ALIASES, "rope_scaling"}
# mlx_lm cannot read transformers v5's Qwen3-MoE config; its reference conversion gets the v4 keys.
QWEN3_MOE_V4 = {"num_experts": 4, "rope_theta": 10000.0}


@pytest.fixture(scope="session")
def mlx_ref(hf, tmp_path_factory):
    """``mlx_ref(arch, bits=None, group_size=64, dtype) -> Path``: what mlx_lm.convert writes (cached)."""
    cache: dict = {}

    def get(arch: str, bits: int | None = None, group_size: int = 64, dtype=torch.float32, to: str | None = None,
            **config) -> Path:
        key = (arch, bits, group_size, dtype, to, tuple(sorted(config.items())))
        if key not in cache:
            src = hf(arch, dtype, **(QWEN3_MOE_V4 if arch == "qwen3_moe" else {}), **config)
            out = tmp_path_factory.mktemp(f"mlxref-{arch}") / "mlx"
            mlx_lm.convert(str(src), str(out), quantize=bits is not None, q_bits=bits, q_group_size=group_size,
                           dtype=to)
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session")
def exported(hf, tmp_path_factory):
    """``exported(arch, dtype, quantize=None, group_size=None) -> (Path, summary)``: ffn-tools' MLX output."""
    cache: dict = {}

    def get(arch: str, dtype=torch.float32, quantize: int | None = None, group_size: int | None = None):
        key = (arch, dtype, quantize, group_size)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"mlx-{arch}") / "mlx"
            cache[key] = out, convert(hf(arch, dtype), "mlx", out, quantize=quantize, group_size=group_size)
        return cache[key]

    return get


def mlx_logits(path: Path, **model_config) -> torch.Tensor:
    model, _ = mlx_lm.load(str(path), model_config=model_config or None)
    out = model(mx.array(TOKENS.numpy()))
    return torch.tensor(out.astype(mx.float32).tolist())


def config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def assert_mlx_lm_config(mine: dict, theirs: dict) -> None:
    """mlx_lm.convert's config.json, plus only the v4 keys mlx-lm needs (same values where it has them)."""
    assert {k: mine.get(k) for k in theirs} == theirs
    assert set(mine) - set(theirs) <= V4_KEYS


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary files left"


@pytest.mark.parametrize("arch", ARCHS)
def test_export_runs_in_mlx_lm_like_transformers(arch, hf, exported, mlx_ref):
    out, summary = exported(arch)
    got = mlx_logits(out)
    want = tiny_models.logits(hf(arch), arch, TOKENS)
    assert (got - want).abs().max().item() <= 1e-4
    # The same tensors mlx_lm.convert writes (names after sanitize, shapes, bytes) and mlx-lm's config.
    assert_identical(tensors(out), tensors(mlx_ref(arch)))
    assert_mlx_lm_config(config(out), config(mlx_ref(arch)))
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].keys() == tensors(out).keys()
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert summary["format"] == "mlx" and summary["quantization"] is None
    names = set(tensors(out))
    if arch in ("mixtral", "qwen2_moe"):
        stacked = [n for n in names if ".switch_mlp." in n]
        assert stacked and not [n for n in names if ".experts." in n]
        assert any("stacked" in c for c in summary["changes"])
    if arch == "phi3":
        assert "model.layers.0.mlp.gate_up_proj.weight" in names


@pytest.mark.parametrize("arch,bits,group_size", [(a, 4, 64) for a in ARCHS] +
                         [("llama", 8, 32), ("qwen2_moe", 8, 32), ("mixtral", 4, 128), ("qwen3_moe", 4, 64)])
def test_quantized_is_bit_identical_to_mlx_lm_convert(arch, bits, group_size, exported, mlx_ref):
    out, summary = exported(arch, quantize=bits, group_size=group_size)
    ref = mlx_ref(arch, bits, group_size)
    assert_identical(tensors(out), tensors(ref))
    mine, theirs = config(out), config(ref)
    assert_mlx_lm_config(mine, theirs)
    assert mine["quantization"] == mine["quantization_config"] == theirs["quantization"]
    # It loads and runs in mlx-lm, computing what mlx-lm's own conversion computes.
    added = {k: mine[k] for k in set(mine) - set(theirs)}
    assert torch.equal(mlx_logits(out), mlx_logits(ref, **added))
    assert summary["quantized"] == sum(n.endswith(".scales") for n in tensors(out))


@pytest.mark.parametrize("to,bits", [("float16", None), ("bfloat16", 4)])
def test_dtype_casts_like_mlx_lm_convert(to, bits, hf, mlx_ref, tmp_path):
    summary = convert(hf("qwen2"), "mlx", tmp_path / "out", dtype=to, quantize=bits)
    assert_identical(tensors(tmp_path / "out"), tensors(mlx_ref("qwen2", bits, 64, to=to)))
    floats = {t.dtype for t in tensors(tmp_path / "out").values() if t.dtype != torch.uint32}
    assert floats == {getattr(torch, to)}
    assert any(f"cast to {to}" in c for c in summary["changes"])


def test_legacy_torch_dtype_is_applied_before_quantizing_as_mlx_lm_does(hf, mlx_ref, tmp_path):
    src = hf("llama", torch_dtype="float16")  # a transformers v4 key, weights still float32
    summary = convert(src, "mlx", tmp_path / "q", quantize=4)
    assert_identical(tensors(tmp_path / "q"), tensors(mlx_ref("llama", 4, 64, torch_dtype="float16")))
    assert any("torch_dtype" in c for c in summary["changes"])
    convert(src, "mlx", tmp_path / "plain")  # lossless without quantizing
    assert tensors(tmp_path / "plain")["model.norm.weight"].dtype == torch.float32


def test_rotary_buffers_and_tied_heads_are_dropped_like_sanitize(hf, mlx_ref, tmp_path):
    from safetensors.torch import load_file, save_file

    src = _copy(hf("llama", tie_word_embeddings=True), tmp_path / "src")
    weights = load_file(src / "model.safetensors")
    extra = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(8) for i in range(2)}
    save_file({**weights, **extra}, src / "model.safetensors", metadata={"format": "pt"})
    summary = convert(src, "mlx", tmp_path / "out")
    mlx_lm.convert(str(src), str(tmp_path / "ref"))
    assert_identical(tensors(tmp_path / "out"), tensors(tmp_path / "ref"))
    assert "lm_head.weight" not in tensors(tmp_path / "out")
    assert any("inv_freq" in c for c in summary["changes"]) and any("lm_head" in c for c in summary["changes"])


def test_weights_not_a_multiple_of_the_group_size_stay_unquantized(exported):
    # d_ffn 96: down_proj's last dimension is not a multiple of 64, so mlx_lm leaves it unquantized.
    out, summary = exported("llama", quantize=4, group_size=64)
    names = tensors(out)
    assert "model.layers.0.mlp.down_proj.scales" not in names and "model.layers.0.mlp.gate_proj.scales" in names
    assert names["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert summary["unquantized"] == ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    line = [c for c in summary["changes"] if "unquantized" in c]
    assert len(line) == 1 and "down_proj" in line[0] and "96" in line[0] and "64" in line[0]


def test_qwen3_moe_router_keeps_its_8_bit_override(exported):
    out, _ = exported("qwen3_moe", quantize=4, group_size=64)
    q = config(out)["quantization"]
    assert q["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert config(out)["num_experts"] == 4 and config(out)["rope_theta"] == 10000.0


@pytest.mark.parametrize("workers,shard,pieces", [(False, None, False), (True, None, False), (True, 30_000, False),
                                                  (True, None, True)])
def test_chunked_quantization_equals_whole_tensor(workers, shard, pieces, hf, mlx_ref, tmp_path, monkeypatch):
    """Row chunks, and worker processes: they write every part into its shard themselves (``Placed``), a later
    shard's too (``io.writer.prepare`` makes every shard and tells every place before the first is written: small
    shards, many of them), so nothing comes back through the pipe to wait. ``pieces``: a weight larger than
    ``PIECE_BYTES`` is quantized by several workers, a row range each (Mixtral's stacked experts: pieces that
    begin in one expert and end in the next)."""
    from ffn_tools.converters.mlx import quantize as mlx_quantize, workers as mlx_workers
    from ffn_tools.io.writer import Placed

    monkeypatch.setattr(mlx_quant, "CHUNK_BYTES", 100)  # one row per chunk
    split = []
    if pieces:
        monkeypatch.setattr(mlx_quantize, "PIECE_BYTES", 1000)  # 7.8 rows of 64 bf16 values
        monkeypatch.setattr(mlx_quantize.QuantJob, "pieces", lambda self, f=mlx_quantize.QuantJob.pieces:
                            split.append((self, f(self))) or split[-1][1])
    if workers:  # the worker processes big models use, here for a tiny one
        monkeypatch.setattr(mlx_workers, "PARALLEL_MIN_BYTES", 0)
        monkeypatch.setattr(mlx_workers, "MAX_WORKERS", 2)
        monkeypatch.setattr(mlx_workers, "idle_cores", lambda: 2)
    started, given, window = [], [], []
    monkeypatch.setattr(mlx_workers.QuantPool, "ahead", lambda self, job, f=mlx_workers.QuantPool.ahead:
                        started.append(job.index) or f(self, job) or
                        window.append(self.submitted - min(job.index + 1 + 2 * self.workers, len(self.jobs))))
    monkeypatch.setattr(mlx_quantize.QuantJob, "part", lambda self, k, f=mlx_quantize.QuantJob.part:
                        given.append(f(self, k)) or given[-1])
    early = []  # the workers started as the export began, as the pool took them
    monkeypatch.setattr(mlx_workers.Workers, "take", lambda self, f=mlx_workers.Workers.take: early.append(f(self)) or
                        early[-1])
    convert(hf("mixtral", torch.bfloat16), "mlx", tmp_path / "out", quantize=4, max_shard_size=shard)
    assert bool(started) == workers
    assert [(e is not None, n) for e, n in early] == ([(True, 2)] if workers else [])  # started before the plan
    assert all(w >= 0 for w in window), window  # as each job is taken, 2 * workers after it are already sent
    assert len(set(started)) == len(started) > 4 or not workers  # topped up at every job, not in batches
    placed = sum(isinstance(p, Placed) for p in given)
    assert placed == (len(given) if workers else 0) and given, (placed, len(given))
    if shard:
        assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 3
    if pieces:  # a job larger than a piece cut into row ranges that cover its rows, one after the other
        cut = [(job, rows) for job, rows in split if rows != [None]]
        assert cut and all(rows[0][0] == 0 and rows[-1][1] == mlx_quant._rows_cols(job.specs[0][1])[1] and
                           all(a[1] == b[0] for a, b in zip(rows, rows[1:])) for job, rows in cut), cut
        per_expert = [job.infos[0].shape[0] for job, _ in cut if len(job.sources) > 1]
        assert any(r[0] % n for n, (job, rows) in zip(per_expert, [c for c in cut if len(c[0].sources) > 1])
                   for r in rows), cut  # a piece that begins in one expert's rows and ends in the next one's
    assert_identical(tensors(tmp_path / "out"), tensors(mlx_ref("mixtral", 4, 64, torch.bfloat16)))


def test_workers_started_early_end_when_planning_fails(hf, tmp_path, monkeypatch):
    """The quantization workers start as the export begins, beside the planning: where planning then fails, they
    are shut down and end (none is left behind), and the error is planning's own."""
    from multiprocessing.connection import wait

    from ffn_tools.converters.mlx import exporter, workers as mlx_workers

    monkeypatch.setattr(mlx_workers, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(mlx_workers, "idle_cores", lambda: 2)
    started = []

    def start(self, f=mlx_workers.Workers._start):
        f(self)
        started.append(list(self.executor._processes.values()))  # spawned at submit, before the plan exists

    def fail(*args, **kwargs):
        raise FFNToolsError("planted planning failure")

    monkeypatch.setattr(mlx_workers.Workers, "_start", start)
    monkeypatch.setattr(exporter, "match_or_dequantize", fail)
    with pytest.raises(FFNToolsError, match="planted planning failure"):
        convert(hf("llama", torch.bfloat16), "mlx", tmp_path / "out", quantize=4)
    (procs,) = started
    assert len(procs) == 2
    left = {p.sentinel for p in procs}  # ready when the process has ended (the pool's own thread reaps it)
    while left:
        ended = wait(list(left), timeout=60)
        assert ended, f"{len(left)} worker(s) still running a minute after the export failed"
        left -= set(ended)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("busy,load,free", [(0.0, 50.0, 0), (1.0, 50.0, 1), (1e6, 0.0, None), (None, 2.0, 1)])
def test_idle_cores_see_the_cores_busy_now_not_the_load_average(monkeypatch, busy, load, free):
    """The pool's worker count comes from the cores busy over the last quarter second (``busy_cores``), not the
    1-minute load average (which kept an export on one core of an idle machine for a minute after a build); the
    load average only where there is no /proc/stat (``busy_cores`` None; ours counted idle). At least one core,
    at most this process's. ``free``: cores less than all (None: one core). Given readings, not measured: a
    process spinning on a core, as ``busy_cores`` reads it, is ``benchmarks/bench_timings.py``'s."""
    from ffn_tools.converters.mlx import workers as mlx_workers

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(mlx_workers, "busy_cores", lambda: busy)
    monkeypatch.setattr(mlx_workers.os, "getloadavg", lambda: (load, load, load))
    assert mlx_workers.idle_cores() == (1 if free is None else max(1, cores - free))


@pytest.mark.parametrize("machine,own,other", [(1.5, 1.0, 0.5), (1.0, 1.0, 0.0), (0.5, 1.0, 0.0), (2.0, 0.0, 2.0)])
def test_this_process_busy_on_another_thread_is_not_a_busy_core(monkeypatch, machine, own, other):
    """``Workers`` samples the cores on a thread while the export plans on the main one: that planning is this
    process's own work, which the workers will take over, not another process's. Counted as busy, it started no
    workers on two cores (measured: the 16 GB 4-bit export's workers then started only after planning). Over one
    window, /proc/stat's all-CPU line says ``machine`` cores were busy and this process used ``own`` cores of CPU
    time: ``busy_cores`` is the rest, never below 0. The window's readings are given, not measured (how busy a
    machine is belongs to benchmarks, not unit tests: on a loaded machine a spinning thread got 0.17 of a core)."""
    import io
    import types

    from ffn_tools.converters.mlx import workers as mlx_workers

    cores = os.cpu_count() or 1
    ticks = 1000 * cores  # jiffies over the window, all cores
    idle = [0, round(ticks * (1 - machine / cores))]
    stat = iter(f"cpu  {ticks * i - idle[i]} 0 0 {idle[i]} 0 0 0 0 0 0\n" for i in (0, 1))
    clock = {"at": 100.0, "own": 7.0}

    def sleep(seconds):  # the window: wall time passes, and this process spends ``own`` cores of CPU time in it
        clock["at"] += seconds
        clock["own"] += own * seconds

    fake_time = types.SimpleNamespace(sleep=sleep, monotonic=lambda: clock["at"], process_time=lambda: clock["own"])
    monkeypatch.setattr(mlx_workers, "time", fake_time)
    monkeypatch.setattr(mlx_workers, "open", lambda path: io.StringIO(next(stat)), raising=False)
    assert mlx_workers.busy_cores() == pytest.approx(other, abs=1e-9)


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("llama", torch.bfloat16), ("mixtral", torch.bfloat16),
                                        ("qwen2_moe", torch.float32), ("phi3", torch.bfloat16),
                                        ("qwen3_moe", torch.bfloat16)])
def test_torch_mlx_torch_is_bit_exact(arch, dtype, hf, exported, tmp_path):
    out, _ = exported(arch, dtype)
    with open_any(out) as view:
        assert view.kind == "mlx"
        assert all(view.info(n).start is not None for n in view)  # unstacking copies bytes
    convert(out, "torch", tmp_path / "back")
    assert_identical(tensors(tmp_path / "back"), tensors(hf(arch, dtype)))
    assert config(tmp_path / "back") == config(hf(arch, dtype))
    if dtype == torch.float32:
        assert torch.equal(tiny_models.logits(tmp_path / "back", arch, TOKENS),
                           tiny_models.logits(hf(arch, dtype), arch, TOKENS))


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_quantized_mlx_imports_dequantized(arch, hf, mlx_ref, tmp_path):
    ref = mlx_ref(arch, 4, 64)
    convert(ref, "torch", tmp_path / "back", dtype="float32")
    back, orig, q = tensors(tmp_path / "back"), tensors(hf(arch)), tensors(ref)
    assert sorted(back) == sorted(orig)  # experts unstacked, HF names
    for name, t in back.items():
        m = re.fullmatch(r"(.*)\.experts\.(\d+)\.(w[123])\.weight", name)
        module = f"{m[1]}.switch_mlp.{ {'w1': 'gate_proj', 'w3': 'up_proj', 'w2': 'down_proj'}[m[3]] }" if m \
            else name.removesuffix(".weight")
        if f"{module}.scales" in q:
            parts = [mx.array(q[f"{module}.{p}"].numpy()) for p in ("weight", "scales", "biases")]
            if m:
                parts = [p[int(m[2])] for p in parts]
            want = torch.tensor(mx.dequantize(*parts, group_size=64, bits=4).tolist())
            assert torch.equal(t, want), name
        else:
            assert raw(t) == raw(orig[name]), name
    assert "quantization" not in config(tmp_path / "back")
    # transformers runs it as mlx-lm runs the quantized model.
    got = tiny_models.logits(tmp_path / "back", arch, TOKENS)
    assert (got - mlx_logits(ref)).abs().max().item() <= 1e-4


def test_sharded_export_loads_and_reads_back(hf, exported, tmp_path):
    out = tmp_path / "sharded"
    summary = convert(hf("mixtral"), "mlx", out, max_shard_size=200_000)
    assert len(summary["files"]) > 1 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)
                                             for f in summary["files"])
    assert all((out / f).stat().st_size <= 200_000 for f in summary["files"])
    assert_identical(tensors(out), tensors(exported("mixtral")[0]))
    assert torch.equal(mlx_logits(out), mlx_logits(exported("mixtral")[0]))
    convert(out, "torch", tmp_path / "back")
    assert_identical(tensors(tmp_path / "back"), tensors(hf("mixtral")))


def test_mlx_to_mlx_requantizes_like_the_source(exported, mlx_ref, tmp_path):
    plain, _ = exported("qwen2_moe")
    convert(plain, "mlx", tmp_path / "q", quantize=4)
    assert_identical(tensors(tmp_path / "q"), tensors(mlx_ref("qwen2_moe", 4, 64)))


def test_can_read_claims_mlx_and_not_hf(hf, exported, mlx_ref, model_dir):
    for arch in ARCHS + ["qwen3_moe", "gemma"]:
        assert not mlx_format.FORMAT.can_read(model_dir(arch)), arch
        assert detect_format(model_dir(arch)) == "torch"
    assert not mlx_format.FORMAT.can_read(model_dir("llama", safe_serialization=False))
    assert not mlx_format.FORMAT.can_read(Path("/nonexistent"))
    for path in (exported("llama")[0], exported("mixtral", quantize=4)[0], mlx_ref("llama", 4, 64),
                 exported("llama")[0] / "model.safetensors"):
        assert mlx_format.FORMAT.can_read(path) and detect_format(path) == "mlx", path


def test_cli_convert_inspect_and_back(hf, tmp_path):
    out = tmp_path / "mlx"
    r = run_cli("convert", hf("mixtral", torch.bfloat16), "--to", "mlx", "-o", out, "--quantize", "8",
                "--group-size", "32", "--json")
    summary = json.loads(r.stdout)
    assert summary["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert summary["unquantized"] == []
    info = json.loads(run_cli("inspect", out, "--json").stdout)
    assert info["format"] == "mlx" and info["routed_experts"] == 4 and info["scheme"] == "mixtral"
    run_cli("convert", out, "--to", "torch", "-o", tmp_path / "back")
    assert sorted(tensors(tmp_path / "back")) == sorted(tensors(hf("mixtral", torch.bfloat16)))
    run_cli("convert", hf("llama"), "--to", "mlx", "-o", out, ok=False)  # exists, no --force
    run_cli("convert", hf("llama"), "--to", "mlx", "-o", out, "--force")
    assert config(out)["model_type"] == "llama"


def test_bad_options_write_nothing(hf, tmp_path):
    src, out = hf("llama"), tmp_path / "out"
    before = tree_digest(src)
    for kwargs, words in (({"dtype": "float8"}, "unknown dtype 'float8'"),
                          ({"group_size": 64}, "only apply with -q/--quantize"),
                          ({"q_mode": "mxfp4"}, "only apply with -q/--quantize"),
                          ({"quantize": 7}, "cannot quantize to 7 bits"),
                          ({"quantize": True, "q_bits": 7}, "cannot quantize to 7 bits"),
                          ({"quantize": 4, "group_size": 48}, "group size 48"),
                          ({"quantize": True, "q_mode": "mxfp4", "q_group_size": 64}, "mode mxfp4 quantizes with"),
                          ({"quantize": True, "q_mode": "int3"}, "unknown quantization mode 'int3'"),
                          ({"quantize": True, "quant_predicate": "mixed_9_9"}, "unknown quantization recipe"),
                          ({"quantize": True, "q_mode": "mxfp4", "quant_predicate": "mixed_3_6"}, "affine only")):
        with pytest.raises(FFNToolsError, match=re.escape(words)):
            convert(src, "mlx", out, **kwargs)
        assert_nothing_written(out)
    with pytest.raises(FFNToolsError, match="MLX models are directories"):
        convert(src, "mlx", tmp_path / "model.safetensors")
    assert_nothing_written(tmp_path / "model.safetensors")
    with pytest.raises(FFNToolsError, match="--flax-layout does not apply to --to mlx"):
        convert(src, "mlx", out, flax_layout="linen")
    run_cli("convert", src, "--to", "mlx", "-o", out, "--dtype", "float64", ok=False)
    assert_nothing_written(out)
    assert tree_digest(src) == before


def _copy(src: Path, dst: Path, edit_config=None) -> Path:
    shutil.copytree(src, dst)
    if edit_config:
        cfg = config(dst)
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_config_keys_the_source_had_come_back(model_dir, tmp_path):
    # Only the keys export added for mlx-lm are dropped on the way back: a top-level rope_theta beside
    # rope_parameters is the source's own (same value or not), and a null rope_scaling export fills in is null again.
    src = _copy(model_dir("llama"), tmp_path / "src", lambda c: c.update(
        rope_theta=c["rope_parameters"]["rope_theta"], rope_scaling=None,
        rope_parameters={**c["rope_parameters"], "rope_type": "linear", "factor": 2.0}))
    write_tokenizer(src)
    convert(src, "mlx", tmp_path / "mlx")
    mine = config(tmp_path / "mlx")
    assert mine["rope_theta"] == config(src)["rope_theta"]
    assert mine["rope_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 2.0}
    convert(tmp_path / "mlx", "torch", tmp_path / "back")
    assert config(tmp_path / "back") == config(src)
    assert_identical(tensors(tmp_path / "back"), tensors(src))
    # MLX to MLX records the same again.
    convert(tmp_path / "mlx", "mlx", tmp_path / "again")
    assert config(tmp_path / "again") == mine
    convert(tmp_path / "again", "torch", tmp_path / "back2")
    assert config(tmp_path / "back2") == config(src)


def test_bad_mlx_directories_are_refused_in_one_line(exported, mlx_ref, tmp_path):
    no_config = _copy(exported("llama")[0], tmp_path / "no-config")
    (no_config / "config.json").unlink()
    no_block = _copy(mlx_ref("llama", 4, 64), tmp_path / "no-block",
                     lambda c: [c.pop("quantization"), c.pop("quantization_config")])
    wrong_bits = _copy(mlx_ref("llama", 4, 64), tmp_path / "wrong-bits",
                       lambda c: c.update(quantization={"group_size": 64, "bits": 8}))
    for path, words in ((no_config, "no config.json"), (no_block, "has no 'quantization' block"),
                        (wrong_bits, "does not fit")):
        before = tree_digest(path)
        with pytest.raises(CheckpointError, match=re.escape(words)) as e:
            convert(path, "torch", tmp_path / "out")
        assert "\n" not in str(e.value) and str(path) in str(e.value)
        r = run_cli("convert", path, "--to", "torch", "-o", tmp_path / "out", ok=False)
        assert words in r.output
        assert_nothing_written(tmp_path / "out")
        assert tree_digest(path) == before


def test_a_fused_llama_is_split_in_the_export(hf, exported, tmp_path):
    from ffn_tools.gateup import fuse_gateup

    fused = tmp_path / "fused"
    fuse_gateup(hf("llama"), fused)
    summary = convert(fused, "mlx", tmp_path / "out")
    assert any("FFNs gate_up split" in c for c in summary["changes"])
    assert_identical(tensors(tmp_path / "out"), tensors(exported("llama")[0]))


def test_checkpoints_mlx_lm_cannot_run_are_refused(hf, model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    unknown = _copy(model_dir("llama"), tmp_path / "unknown", lambda c: c.update(model_type="apex1"))
    missing = _copy(model_dir("mixtral"), tmp_path / "missing")
    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})
    no_config = _copy(model_dir("llama"), tmp_path / "no-config")
    (no_config / "config.json").unlink()
    cases = ((unknown, "has no model for model_type 'apex1'"),
             (missing, "does not fit mlx_lm's mixtral model"), (no_config, "no config.json"),
             (model_dir("gemma"), "lm_head.weight differs from model.embed_tokens.weight"))
    for path, words in cases:
        with pytest.raises(FFNToolsError, match=re.escape(words)) as e:
            convert(path, "mlx", tmp_path / "out", quantize=4)
        assert "\n" not in str(e.value)
        assert_nothing_written(tmp_path / "out")


def test_existing_output_needs_force(hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(OutputExistsError):
        convert(hf("llama"), "mlx", out)
    with pytest.raises(OutputExistsError, match="earlier checkpoint output"):  # --force replaces only outputs
        convert(hf("llama"), "mlx", out, force=True)
    assert (out / "keep.txt").exists()
    (out / "config.json").write_text("{}")  # an earlier output
    convert(hf("llama"), "mlx", out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_absent_tie_key_keeps_the_head_as_transformers_does(arch, model_dir, tmp_path):
    # transformers' Llama/Qwen2/Qwen3 configs default tie_word_embeddings to False; mlx-lm's ModelArgs default
    # Llama/Qwen2 to True (and Qwen3 requires the key), so the export must keep lm_head and say so.
    src = _copy(model_dir(arch), tmp_path / "src", lambda c: c.pop("tie_word_embeddings"))
    write_tokenizer(src)
    summary = convert(src, "mlx", tmp_path / "mlx")
    assert "lm_head.weight" in tensors(tmp_path / "mlx")
    assert config(tmp_path / "mlx")["tie_word_embeddings"] is False
    assert any("tie_word_embeddings false" in c for c in summary["changes"])
    want = tiny_models.logits(src, arch, TOKENS)
    assert (mlx_logits(tmp_path / "mlx") - want).abs().max().item() <= 1e-4
    # Back to torch: every tensor bit for bit, and config.json without the key the export added.
    convert(tmp_path / "mlx", "torch", tmp_path / "back")
    assert_identical(tensors(tmp_path / "back"), tensors(src))
    assert config(tmp_path / "back") == config(src)
    assert torch.equal(tiny_models.logits(tmp_path / "back", arch, TOKENS), want)
    # MLX to MLX re-adds it; with no lm_head at all the model can only be tied, as mlx-lm's default says.
    convert(tmp_path / "mlx", "mlx", tmp_path / "again")
    assert_identical(tensors(tmp_path / "again"), tensors(tmp_path / "mlx"))
    assert config(tmp_path / "again") == config(tmp_path / "mlx")
    if arch == "llama":
        from safetensors.torch import load_file, save_file

        headless = _copy(src, tmp_path / "headless")
        weights = load_file(headless / "model.safetensors")
        del weights["lm_head.weight"]
        save_file(weights, headless / "model.safetensors", metadata={"format": "pt"})
        convert(headless, "mlx", tmp_path / "tied")
        assert "tie_word_embeddings" not in config(tmp_path / "tied")
        assert "lm_head.weight" not in tensors(tmp_path / "tied")


@pytest.mark.parametrize("arch", ["llama", "phi3", "mixtral"])
def test_the_view_traces_b_through_a_s_layout_when_a_is_its_source(arch, hf, exported, tmp_path, monkeypatch):
    """verify opens B beside A (``like``): where A is the checkpoint B was exported from, B's view is traced
    through A's own tensors, never building transformers' model (a second of imports), and reads exactly as the
    view traced through transformers' layout; where A is not what was exported (a fused Llama against the
    export of the split one), the view falls back to transformers' layout, and reads the same again."""
    from ffn_tools.converters import open_any
    from ffn_tools.converters.mlx import inverse
    from ffn_tools.gateup import fuse_gateup

    out = exported(arch)[0]
    with open_any(out) as plain:
        want = {n: tuple(plain.info(n).shape) for n in plain}
        want_bits = {n: plain[n] for n in list(plain)[:6]}
    fused = tmp_path / "fused"
    fuse_gateup(hf("llama"), fused)
    with open_any(hf(arch)) as a:
        source_layout = inverse.source_layout
        monkeypatch.setattr(inverse, "source_layout", lambda config: pytest.fail("built transformers' model"))
        with open_any(out, like=a) as b:
            assert b.inverse.shapes == {n: tuple(a.info(n).shape) for n in a}
            assert {n: tuple(b.info(n).shape) for n in b} == want
            assert all(torch.equal(b[n], t) for n, t in want_bits.items())
        built = []
        monkeypatch.setattr(inverse, "source_layout", lambda config: built.append(1) or source_layout(config))
    if arch == "llama":
        with open_any(fused) as a, open_any(out, like=a) as b:
            assert built and {n: tuple(b.info(n).shape) for n in b} == want


def test_quantize_op_declares_its_place_and_shared_job_and_travels_as_data(hf, tmp_path):
    """A quantized weight's parts are ``Quantize`` ops of one ``QuantJob``: the entry's ``place`` and ``shared`` come
    from what the op declares (the job, told where each part goes), and pickled with its entries (a ``--ray`` task's
    slice) the parts still share one job, without the pool, futures or places of the process that planned them,
    and make the bytes ``mx.quantize`` makes of the whole weight."""
    import pickle

    from ffn_tools.converters.mlx.ops import Quantize
    from ffn_tools.converters.mlx.quant import part_specs
    from ffn_tools.converters.mlx.quantize import PARTS, QuantJob
    from ffn_tools.plan import Entry

    ckpt = open_any(hf("llama", torch.bfloat16))
    name = "model.layers.0.mlp.gate_proj.weight"
    info = ckpt.info(name)
    job = QuantJob(ckpt, (name,), tuple(info.shape), "BF16", None, 64, 4)
    specs = part_specs(tuple(info.shape), "BF16", 64, 4, "affine")
    entries = [Entry(f"w.{PARTS[k]}", st, shape, (), (Quantize(job, k),), reads=0) for k, (st, shape) in
               enumerate(specs)]
    assert all(e.shared is job for e in entries) and all(e.place is not None for e in entries)
    job.dests = {0: ("planned-here", 0)}  # what running it here holds does not travel
    copies = pickle.loads(pickle.dumps(entries))
    jobs = {id(e.shared) for e in copies}
    assert len(jobs) == 1 and copies[0].shared is not job and copies[0].shared.dests == {}
    assert copies[0].shared.pool is None and copies[0].shared.sources == (name,)
    w = mx.array(ckpt[name].float().numpy()).astype(mx.bfloat16)
    want = [mlx_quant.from_mx(a) for a in mx.quantize(w, group_size=64, bits=4)]
    got = [e.apply([]) for e in copies]
    assert [bytes(g) for g in got] == [bytes(x) for x in want]
