"""Flax format: hf and linen trees, checked with flax's own reader, flax.linen Dense apply and transformers."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_identical, progress_bars, raw, run_cli, tensors, tree_digest

import tiny_models
from ffn_tools.converters import convert, detect_format, open_any
from ffn_tools.detect import find_ffns
from ffn_tools.errors import FFNToolsError
from ffn_tools.ffn import canonical_weights
from ffn_tools.io.receipt import NAME as RECEIPT

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
nn = pytest.importorskip("flax.linen")
serialization = pytest.importorskip("flax.serialization")
# our own modules: with jax and flax present they must import (an importorskip here would hide a broken one)
import ffn_tools.converters.flax as flax_format  # noqa: E402
import ffn_tools.converters.flax.writer as flax_writer  # noqa: E402

ARCHS = ["llama", "qwen2", "mixtral", "llama-bias"]
DTYPES = [torch.float32, torch.bfloat16]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    """``exported(arch, dtype, layout) -> Path``: the tiny checkpoint converted to Flax (cached)."""
    cache: dict = {}

    def get(arch: str, dtype: torch.dtype = torch.float32, layout: str = "hf") -> Path:
        key = (arch, dtype, layout)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"flax-{arch}-{layout}") / "flax"
            convert(model_dir(arch, dtype), "flax", out, flax_layout=layout)
            cache[key] = out
        return cache[key]

    return get


def restore(path: Path) -> dict:
    """The tree as flax itself reads it."""
    return serialization.msgpack_restore(path.read_bytes())


def flatten(tree: dict, prefix: tuple = ()) -> dict[tuple, np.ndarray]:
    out = {}
    for k, v in tree.items():
        out.update(flatten(v, (*prefix, k)) if isinstance(v, dict) else {(*prefix, k): v})
    return out


def np_raw(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


class SwiGLU(nn.Module):
    """The user's module: three nn.Dense named gate, up, down."""

    d_model: int
    d_ffn: int
    bias: bool = False

    @nn.compact
    def __call__(self, x):
        g = nn.Dense(self.d_ffn, use_bias=self.bias, name="gate")(x)
        u = nn.Dense(self.d_ffn, use_bias=self.bias, name="up")(x)
        return nn.Dense(self.d_model, use_bias=self.bias, name="down")(nn.silu(g) * u)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_tree_keys_and_shapes(model_dir, exported, arch):
    src, out = model_dir(arch), exported(arch)
    tree = flatten(restore(out / "flax_model.msgpack"))
    base = tensors(src)
    expected = {}
    for name, t in base.items():
        parts = tuple(name.split("."))
        if parts[-1] == "weight" and t.ndim == 2:
            leaf = "embedding" if parts[-2] == "embed_tokens" else "kernel"
            expected[(*parts[:-1], leaf)] = t if leaf == "embedding" else t.T  # kernel = W.T (in, out)
        else:
            expected[parts] = t
    assert sorted(tree) == sorted(expected)
    for key, t in expected.items():
        assert tree[key].shape == tuple(t.shape) and tree[key].dtype == np.float32, key
        assert np.array_equal(tree[key], t.numpy()), key
    assert ("model", "layers", "0", "input_layernorm", "weight") in tree  # FlaxLlamaRMSNorm's name
    assert tree[("model", "embed_tokens", "embedding")].shape == (96, 64)
    assert tree[("lm_head", "kernel")].shape == (64, 96)
    source = json.loads((src / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    v4 = {"rope_theta": source["rope_parameters"]["rope_theta"], "torch_dtype": source["dtype"]}  # transformers 4 reads
    assert config == {**source, **v4, "ffn_tools_added_config_keys": ["rope_theta", "torch_dtype"]}
    with open_any(out) as ckpt:
        assert ckpt.config == source  # the Flax view: the source's config, without what export added
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_linen_module_reproduces_torch_ffn(model_dir, exported, arch):
    src = model_dir(arch)
    params = restore(exported(arch, layout="linen") / "flax_model.msgpack")["params"]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    model = None if arch == "mixtral" else getattr(__import__("transformers"), tiny_models.ARCHS[arch][1]).from_pretrained(src)
    with open_any(src) as ckpt:
        ffns = find_ffns(ckpt).ffns
        assert len(ffns) == (8 if arch == "mixtral" else 2)
        assert sorted(params) == sorted(f"layers_{f.ref.layer}" + (f"_experts_{f.ref.expert}" if f.ref.kind == "expert" else "")
                                        for f in ffns)
        for f in ffns:
            w = canonical_weights(ckpt, f)
            if model is not None:
                with torch.no_grad():
                    ref = model.model.layers[f.ref.layer].mlp(x)
            else:
                ref = F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])
            sub = params[f"layers_{f.ref.layer}" + (f"_experts_{f.ref.expert}" if f.ref.kind == "expert" else "")]
            assert ("bias" in sub["gate"]) == (arch == "llama-bias")
            y = SwiGLU(64, f.d_ffn, bias=arch == "llama-bias").apply({"params": sub}, jnp.asarray(x.numpy()))
            err = np.abs(np.asarray(y) - ref.numpy()).max() / np.abs(ref.numpy()).max()
            assert err <= 1e-5, f"{f.ref}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_bit_exact(model_dir, exported, tmp_path, arch, dtype):
    src, out = model_dir(arch, dtype), exported(arch, dtype)
    with open_any(out) as ckpt:
        assert ckpt.kind == "flax" and ckpt.layout == "hf"
        assert {short for short in (str(ckpt.info(n).dtype) for n in ckpt)} == {str(dtype)}
    convert(out, "torch", tmp_path / "back")
    assert_identical(tensors(src), tensors(tmp_path / "back"))
    for a in (tmp_path / "back").iterdir():  # config, generation config carried
        if a.suffix == ".json" and a.name != RECEIPT:
            assert json.loads(a.read_text()) == json.loads((src / a.name).read_text()), a.name
    # Linen: the FFNs come back as extract names them, bit-exact with the source's canonical weights.
    convert(exported(arch, dtype, "linen"), "torch", tmp_path / "ffn")
    back = tensors(tmp_path / "ffn")
    with open_any(src) as ckpt:
        want = {}
        for f in find_ffns(ckpt).ffns:
            prefix = f"layers.{f.ref.layer}" + (f".experts.{f.ref.expert}" if f.ref.kind == "expert" else "")
            for role, t in canonical_weights(ckpt, f).items():
                want[f"{prefix}.{role.split('_')[0]}.{'bias' if role.endswith('_bias') else 'weight'}"] = t
    assert_identical(want, back)
    # ... and writing those canonical tensors as linen again gives the same bytes.
    convert(tmp_path / "ffn", "flax", tmp_path / "linen2", flax_layout="linen")
    assert (tmp_path / "linen2" / "flax_model.msgpack").read_bytes() == \
        (exported(arch, dtype, "linen") / "flax_model.msgpack").read_bytes()


@pytest.mark.parametrize("arch,dtype", [("llama", torch.bfloat16), ("mixtral", torch.float32)], ids=str)
def test_transformers_loads_round_trip(model_dir, exported, tmp_path, arch, dtype):
    convert(exported(arch, dtype), "torch", tmp_path / "back")
    assert torch.equal(tiny_models.logits(tmp_path / "back", arch), tiny_models.logits(model_dir(arch, dtype), arch))


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_config_holds_what_transformers_4_reads(model_dir, tmp_path, dtype):
    """transformers 4 (the Flax models' client) reads rope_theta / rope_scaling / torch_dtype, not v5's
    rope_parameters / dtype: without them a Llama 3 runs with rope_theta 10000. Read back, the keys go again."""
    import transformers

    src = tmp_path / "llama3"
    shutil.copytree(model_dir("llama", dtype), src)
    source = {**json.loads((src / "config.json").read_text()), "rope_parameters": LLAMA3_ROPE}
    (src / "config.json").write_text(json.dumps(source, indent=2))
    r = convert(src, "flax", tmp_path / "flax")
    config = json.loads((tmp_path / "flax" / "config.json").read_text())
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert config["torch_dtype"] == config["dtype"] == str(dtype).removeprefix("torch.")
    assert config["ffn_tools_added_config_keys"] == ["rope_scaling", "rope_theta", "torch_dtype"]
    assert {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype",
                                                          "ffn_tools_added_config_keys")} == source
    assert any("rope_scaling" in c and "rope_theta 500000.0" in c and "added" in c for c in r["changes"])
    # transformers 5 reading the Flax config.json (rope_scaling before rope_parameters) gets the same RoPE
    v5 = transformers.LlamaConfig.from_dict(config).rope_parameters
    assert v5 == transformers.LlamaConfig.from_dict(source).rope_parameters
    with open_any(tmp_path / "flax") as ckpt:
        assert ckpt.config == source
    convert(tmp_path / "flax", "torch", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == source
    assert "ffn_tools_added_config_keys" not in (tmp_path / "back" / "config.json").read_text()
    # a Flax export of the Flax export: the same config.json again, the same tree
    convert(tmp_path / "flax", "flax", tmp_path / "again")
    for name in ("config.json", "flax_model.msgpack"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "flax" / name).read_bytes()


V4_CASES = {
    "v5 default rope": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "dtype": "bfloat16"},
                        {"rope_theta": 1e6, "torch_dtype": "bfloat16"}),
    "partial rotary": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
                       {"rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    "already v4": ({"rope_theta": 5e5, "rope_scaling": None, "torch_dtype": "float16"}, {}),
    "both spellings": ({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                        "dtype": "float32", "torch_dtype": "float32"}, {}),
    "nested per layer type": ({"layer_types": ["full_attention"], "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, {}),
    "no config keys": ({"model_type": "llama"}, {}),
}


@pytest.mark.parametrize("case", V4_CASES)
def test_v4_keys_and_their_record_are_exact_inverses(case):
    from ffn_tools.converters.flax.config import restore_source_config, v4_config

    source, added = V4_CASES[case]
    out = v4_config(source)
    assert {k: out[k] for k in added} == added
    assert out.get("ffn_tools_added_config_keys", []) == sorted(added)
    assert "ffn_tools_null_config_keys" not in out and restore_source_config(out) == source


def test_v4_keys_fill_nulls_and_read_back_null(tmp_path, model_dir):
    from ffn_tools.converters.flax.config import restore_source_config, v4_config

    source = {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, "rope_scaling": None,
              "rope_theta": None, "dtype": "float32"}
    out = v4_config(source)
    assert out["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and out["rope_theta"] == 1e4
    assert out["ffn_tools_null_config_keys"] == ["rope_scaling", "rope_theta"]
    assert out["ffn_tools_added_config_keys"] == ["torch_dtype"]
    assert restore_source_config(out) == source
    # a hand-edited record is refused by name, not half-applied
    src = tmp_path / "m"
    shutil.copytree(model_dir("llama"), src)
    convert(src, "flax", tmp_path / "flax")
    config = json.loads((tmp_path / "flax" / "config.json").read_text())
    (tmp_path / "flax" / "config.json").write_text(json.dumps({**config, "ffn_tools_added_config_keys": "rope_theta"}))
    r = run_cli("inspect", tmp_path / "flax", ok=False)
    assert "ffn_tools_added_config_keys must be a list of config keys" in r.output and "config.json" in r.output


def test_runs_through_the_one_executor(model_dir, tmp_path, monkeypatch):
    """The plan is what is written: --dry-run lists it, progress counts it, a failure leaves nothing behind."""
    import ffn_tools.executor as executor

    src = model_dir("llama")
    dry = convert(src, "flax", tmp_path / "dry", dry_run=True, flax_layout="linen")
    assert not (tmp_path / "dry").exists() and dry["files"] == []
    assert "params/layers_1/down/kernel  float32[96, 64]  \u2190 down of layer 1 (model.layers.1.mlp.down_proj.weight), " \
           "transposed (kernel = W.T)" in dry["plan"]
    dry = convert(src, "flax", tmp_path / "dry", dry_run=True)
    assert "model/norm/weight  float32[64]  \u2190 copy of model.norm.weight" in dry["plan"]
    assert "lm_head/kernel  float32[64, 96]  \u2190 lm_head.weight, transposed (kernel = W.T)" in dry["plan"]
    with pytest.raises(FFNToolsError, match=re.escape("one.msgpack: --max-shard-size needs a directory output, not a "
                                                      ".msgpack file")):
        convert(src, "flax", tmp_path / "one.msgpack", max_shard_size=10_000, dry_run=True)
    calls = []
    real = executor.execute
    monkeypatch.setattr(flax_format, "execute", lambda plan, run: calls.append(run.writer) or real(plan, run))
    bars = progress_bars(monkeypatch)
    r = convert(src, "flax", tmp_path / "out", dtype="bfloat16")
    assert r["tensors"] == len(dry["plan"]) and r["bytes"] == dry["bytes"] // 2 and r["changes"][-1] == \
        "floating tensors cast to bfloat16"
    (bar,) = bars
    assert type(calls[0]).__name__ == "MsgpackWriter" and bar.desc == "converting to flax (hf)"
    assert sum(bar.steps) == bar.total == r["bytes"]
    # a failure mid-stream: no output, no temporary left, the input untouched
    monkeypatch.setattr(flax_writer, "_write_leaf", lambda sink, leaf: (_ for _ in ()).throw(OSError(5, "disk died")))
    before = tree_digest(src)
    with pytest.raises(OSError, match="disk died"):
        convert(src, "flax", tmp_path / "failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and tree_digest(src) == before


def test_sharded_as_transformers_4(model_dir, exported, tmp_path):
    src, limit = model_dir("llama"), 30_000
    out = tmp_path / "sharded"
    r = convert(src, "flax", out, max_shard_size=limit)
    assert len(r["files"]) > 2 and r["files"][0] == f"flax_model-00001-of-{len(r['files']):05d}.msgpack"
    assert all((out / f).stat().st_size <= limit for f in r["files"])
    index_text = (out / "flax_model.msgpack.index.json").read_text()
    index = json.loads(index_text)
    assert index_text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    merged = {}  # what FlaxPreTrainedModel.load_flax_sharded_weights did: restore each shard, merge flat
    for f in r["files"]:
        shard = {"/".join(k): v for k, v in flatten(restore(out / f)).items()}
        assert all(index["weight_map"][k] == f for k in shard)
        merged.update(shard)
    whole = {"/".join(k): v for k, v in flatten(restore(exported("llama") / "flax_model.msgpack")).items()}
    assert sorted(merged) == sorted(index["weight_map"]) == sorted(whole)
    assert all(np_raw(merged[k]) == np_raw(whole[k]) for k in whole)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in whole.values())
    for path in (out, out / "flax_model.msgpack.index.json"):
        convert(path, "torch", tmp_path / f"back-{path.name}")
        assert_identical(tensors(src), tensors(tmp_path / f"back-{path.name}"))


def test_reads_and_rewrites_trees_flax_wrote(tmp_path):
    rng = np.random.default_rng(0)
    bf16 = jnp.bfloat16
    tree = {"model": {"embed_tokens": {"embedding": jnp.asarray(rng.standard_normal((10, 8)), bf16)},
                      "layers": {"0": {"mlp": {"gate_proj": {"kernel": jnp.asarray(rng.standard_normal((8, 12)), bf16)},
                                               "up_proj": {"kernel": jnp.asarray(rng.standard_normal((8, 12)), bf16)},
                                               "down_proj": {"kernel": jnp.asarray(rng.standard_normal((12, 8)), bf16)}},
                                       "input_layernorm": {"weight": jnp.ones(8, bf16)}}}}}
    src = tmp_path / "flax_model.msgpack"
    src.write_bytes(serialization.to_bytes(tree))
    with open_any(src) as ckpt:
        assert ckpt.kind == "flax" and ckpt.layout == "hf"
        assert find_ffns(ckpt).ffns[0].d_ffn == 12
        gate = ckpt["model.layers.0.mlp.gate_proj.weight"]
        assert gate.dtype == torch.bfloat16 and gate.shape == (12, 8)
        assert raw(gate) == np_raw(np.asarray(tree["model"]["layers"]["0"]["mlp"]["gate_proj"]["kernel"]).T)
        assert raw(ckpt["model.embed_tokens.weight"]) == np_raw(np.asarray(tree["model"]["embed_tokens"]["embedding"]))
    convert(src, "flax", tmp_path / "again.msgpack")
    assert (tmp_path / "again.msgpack").read_bytes() == src.read_bytes()  # same bytes as flax.serialization


def test_chunked_arrays_as_flax_does(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(flax_writer.flax_msgpack, "MAX_CHUNK_SIZE", 4096)
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 4096)
    src = model_dir("llama", torch.bfloat16)
    convert(src, "flax", tmp_path / "f")
    data = (tmp_path / "f" / "flax_model.msgpack").read_bytes()
    assert b"__msgpack_chunked_array__" in data
    assert serialization.to_bytes(serialization.msgpack_restore(data)) == data
    convert(tmp_path / "f", "torch", tmp_path / "back")
    assert_identical(tensors(src), tensors(tmp_path / "back"))


def _example():
    spec = importlib.util.spec_from_file_location("flax_swiglu", ROOT / "examples" / "flax_swiglu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # flax.linen modules are dataclasses: their module must be importable
    spec.loader.exec_module(mod)
    return mod


def test_example_hand_worked_and_random(tmp_path):
    ex = _example()
    y_flax, y_torch = ex.hand_worked(tmp_path)
    np.testing.assert_allclose(y_flax, [[-3.1422775, 2.8577223]], rtol=0, atol=1e-6)
    np.testing.assert_allclose(y_torch, [[-3.1422775, 2.8577223]], rtol=0, atol=1e-6)
    w = tensors(tmp_path / "torch_ffn")
    assert sorted(w) == [f"layers.0.{r}.{k}" for r in ("down", "gate", "up") for k in ("bias", "weight")]
    h = F.silu(torch.tensor([[1.0, -1.0]]) @ w["layers.0.gate.weight"].T) * (torch.tensor([[1.0, -1.0]]) @ w["layers.0.up.weight"].T)
    np.testing.assert_allclose(h.numpy(), [[-0.2845552, 0, -2.8577223]], rtol=0, atol=1e-6)
    y_flax, y_torch = ex.compare_random(0, 16, 24, tmp_path)
    assert np.abs(y_flax - y_torch).max() <= 1e-5 * np.abs(y_flax).max()
    # The module's variables saved as they are (no layers_0) read as layer 0.
    module = ex.SwiGLU(4, 6)
    variables = module.init(jax.random.PRNGKey(1), jnp.ones((1, 4)))
    (tmp_path / "bare.msgpack").write_bytes(serialization.to_bytes(variables))
    with open_any(tmp_path / "bare.msgpack") as ckpt:
        assert ckpt.layout == "linen" and len(ckpt) == 6
        assert raw(ckpt["layers.0.down.weight"]) == np_raw(np.asarray(variables["params"]["down"]["kernel"]).T)


def test_cli_convert_and_inspect(model_dir, tmp_path):
    src = model_dir("qwen2_moe")
    run_cli("convert", src, "--to", "flax", "--flax-layout", "linen", "-o", tmp_path / "linen")
    params = restore(tmp_path / "linen" / "flax_model.msgpack")["params"]
    assert {"layers_0_experts_3", "layers_0_shared_expert", "layers_1_experts_0"} <= set(params)
    info = json.loads(run_cli("inspect", tmp_path / "linen", "--json").stdout)
    assert info["format"] == "flax" and info["scheme"] == "ffn-tools" and info["routed_experts"] == 4
    assert info["shared_experts"] == 1 and info["activation"].startswith("SwiGLU (silu)")
    run_cli("convert", tmp_path / "linen", "--to", "torch", "-o", tmp_path / "torch")
    assert "layers.0.shared_expert.gate.weight" in tensors(tmp_path / "torch")
    run_cli("convert", src, "--to", "flax", "-o", tmp_path / "hf", "--max-shard-size", "100KB")
    assert json.loads(run_cli("inspect", tmp_path / "hf", "--json").stdout)["scheme"] == "qwen-moe"
    for out in ("linen", "hf"):
        assert "PASS: 10 FFNs" in run_cli("verify", src, tmp_path / out, "--backend", "reference").output


def test_can_read(model_dir, exported, tmp_path):
    torch_dir, flax_dir = model_dir("llama"), exported("llama")
    assert not flax_format.FORMAT.can_read(torch_dir) and detect_format(torch_dir) == "torch"
    assert flax_format.FORMAT.can_read(flax_dir) and detect_format(flax_dir) == "flax"
    assert flax_format.FORMAT.can_read(flax_dir / "flax_model.msgpack")
    both = tmp_path / "both"
    shutil.copytree(torch_dir, both)
    shutil.copy(flax_dir / "flax_model.msgpack", both)
    assert detect_format(both) == "torch"  # transformers 4.x repos held both; the PyTorch weights win


# ---- bad input: one-line errors, nothing written, input untouched ------------------------------------


def _np_tree(h=8, i=12, **override):
    rng = np.random.default_rng(0)
    p = {"gate": {"kernel": rng.standard_normal((h, i), np.float32)}, "up": {"kernel": rng.standard_normal((h, i), np.float32)},
         "down": {"kernel": rng.standard_normal((i, h), np.float32)}}
    for k, v in override.items():
        p[k] = v
    return {"params": {"layers_0": p}}


def _bad_not_tree(d):
    import msgpack

    (d / "list.msgpack").write_bytes(msgpack.packb([1, 2, 3]))
    return d / "list.msgpack", "top level is a list"


def _bad_leaf(d):
    import msgpack

    (d / "str.msgpack").write_bytes(msgpack.packb({"model": {"w": "text"}}))
    return d / "str.msgpack", "model/w is a string"


def _bad_garbage(d):
    (d / "junk.msgpack").write_bytes(b"\xc1 not msgpack at all")
    return d / "junk.msgpack", "not a Flax msgpack file"


def _bad_truncated(d):
    data = serialization.to_bytes(_np_tree())
    (d / "cut.msgpack").write_bytes(data[: len(data) // 2])
    return d / "cut.msgpack", "truncated"


def _bad_linen_kernel(d):
    t = _np_tree(up={"kernel": np.zeros((12, 8), np.float32)})  # (out, in): not transposed
    (d / "ffn.msgpack").write_bytes(serialization.to_bytes(t))
    return d / "ffn.msgpack", "params/layers_0/up/kernel: shape [12, 8], expected [8, 12]"


def _bad_hf_kernel(d, exported):
    shutil.copytree(exported("llama"), d / "m")
    tree = restore(d / "m" / "flax_model.msgpack")
    mlp = tree["model"]["layers"]["1"]["mlp"]
    mlp["gate_proj"]["kernel"] = np.ascontiguousarray(mlp["gate_proj"]["kernel"].T)  # stored (out, in)
    (d / "m" / "flax_model.msgpack").write_bytes(serialization.to_bytes(tree))
    return d / "m", "model.layers.1.mlp.gate_proj.weight (= model/layers/1/mlp/gate_proj/kernel.T): shape [64, 96], expected [96, 64]"


def _bad_kernel_rank(d):
    (d / "k.msgpack").write_bytes(serialization.to_bytes({"model": {"lm_head": {"kernel": np.zeros((2, 3, 4), np.float32)}}}))
    return d / "k.msgpack", "model/lm_head/kernel has 3 dims"


def _bad_missing_shard(d, model_dir):
    files = convert(model_dir("llama"), "flax", d / "s", max_shard_size=30_000)["files"]
    (d / "s" / files[1]).unlink()
    return d / "s", f"names shard(s) that do not exist: {files[1]}"


def _bad_mixed_dtypes(d):
    t = _np_tree()
    t["params"]["layers_0"]["gate"]["kernel"] = t["params"]["layers_0"]["gate"]["kernel"].astype(jnp.bfloat16)
    (d / "mixed.msgpack").write_bytes(serialization.to_bytes(t))
    return d / "mixed.msgpack", "params/layers_0: mixes dtypes (down/kernel float32, gate/kernel bfloat16"


BAD = {"not-a-tree": _bad_not_tree, "string-leaf": _bad_leaf, "garbage": _bad_garbage, "truncated": _bad_truncated,
       "linen-kernel-shape": _bad_linen_kernel, "hf-kernel-shape": _bad_hf_kernel, "kernel-rank": _bad_kernel_rank,
       "missing-shard": _bad_missing_shard, "mixed-dtypes": _bad_mixed_dtypes}


@pytest.mark.parametrize("case", BAD)
def test_bad_input(model_dir, exported, tmp_path, case):
    make = BAD[case]
    extra = {"_bad_hf_kernel": (exported,), "_bad_missing_shard": (model_dir,)}.get(make.__name__, ())
    (tmp_path / "in").mkdir()
    bad, message = make(tmp_path / "in", *extra)
    before = tree_digest(tmp_path / "in")
    r = run_cli("convert", bad, "--to", "torch", "-o", tmp_path / "out", ok=False)
    assert message in r.output and str(bad.name) in r.output, r.output
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["in"]
    assert tree_digest(tmp_path / "in") == before


def test_linen_export_needs_one_dtype_per_ffn(model_dir, tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "mixed"
    shutil.copytree(model_dir("llama"), src)
    t = tensors(src)
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"].to(torch.bfloat16)
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    before = tree_digest(src)
    r = run_cli("convert", src, "--to", "flax", "--flax-layout", "linen", "-o", tmp_path / "out", ok=False)
    assert "model.layers.1.mlp.up_proj.weight bfloat16" in r.output and "pass --dtype" in r.output
    assert not (tmp_path / "out").exists() and tree_digest(src) == before
    run_cli("convert", src, "--to", "flax", "--flax-layout", "linen", "--dtype", "bfloat16", "-o", tmp_path / "out")
    leaves = flatten(restore(tmp_path / "out" / "flax_model.msgpack"))
    assert {v.dtype.name for v in leaves.values()} == {"bfloat16"}
    # the hf layout keeps each tensor's own dtype
    convert(src, "flax", tmp_path / "hf")
    convert(tmp_path / "hf", "torch", tmp_path / "back")
    assert_identical(tensors(src), tensors(tmp_path / "back"))


def test_refusals(model_dir, exported, tmp_path):
    src = model_dir("llama")
    with pytest.raises(FFNToolsError, match="--flax-layout does not apply to --to torch"):
        convert(src, "torch", tmp_path / "t", flax_layout="linen")
    with pytest.raises(FFNToolsError, match="unknown Flax layout"):
        convert(src, "flax", tmp_path / "t", flax_layout="nnx")
    (tmp_path / "exists").mkdir()
    r = run_cli("convert", src, "--to", "flax", "-o", tmp_path / "exists", ok=False)
    assert "already exists" in r.output and list((tmp_path / "exists").iterdir()) == []
    run_cli("convert", src, "--to", "flax", "-o", tmp_path / "exists", "--force")
    assert (tmp_path / "exists" / "flax_model.msgpack").is_file()
    with pytest.raises(FFNToolsError, match="would overwrite the input"):
        convert(exported("llama"), "flax", exported("llama"), force=True)
    with pytest.raises(FFNToolsError, match="needs a directory output"):
        convert(src, "flax", tmp_path / "one.msgpack", max_shard_size=10_000)
    from safetensors.torch import save_file

    for names, message in ((["a.kernel"], "'a.kernel' cannot be stored in the hf Flax layout"),
                           (["x.y", "x.y.z"], "x/y would be both an array and a subtree")):
        save_file({n: torch.zeros(2) for n in names}, tmp_path / "odd.safetensors")
        with pytest.raises(FFNToolsError, match=re.escape(message)):
            convert(tmp_path / "odd.safetensors", "flax", tmp_path / "odd")
        assert not (tmp_path / "odd").exists()
