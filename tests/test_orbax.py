"""Orbax read and write: tiny real transformers models converted to Orbax checkpoints in the Hugging Face Flax tree
and in MaxText's scanned decoder, restored by orbax.checkpoint itself, their FFNs run by flax.linen modules against
transformers' own MLPs, round trips bit for bit, checkpoints Orbax saved itself read back, verify against the source."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers
from flax import linen as nn
from helpers import assert_identical, run_cli, tensors, tree_digest, write_tokenizer

from ffn_tools.converters import open_any

D = "decoder"


def _save(model, path):
    model.to(torch.bfloat16).save_pretrained(path)
    write_tokenizer(path, 128)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Llama (head_dim 16: MaxText's query scaling exact in bf16), Llama 3.1 (head_dim 8: the scaled query kept in
    float32; rotary scaling of type llama3: q/k interleaved), Qwen3-MoE, Mixtral."""
    root = tmp_path_factory.mktemp("orbax")
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    out = {"llama": _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **common, intermediate_size=96, head_dim=16)), root / "llama")}
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    out["llama31"] = _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**common, "num_attention_heads": 8}, intermediate_size=96, head_dim=8, rope_parameters=rope)),
        root / "llama31")
    out["qwen3_moe"] = _save(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **common, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16)),
        root / "qwen3moe")
    out["mixtral"] = _save(transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **common, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=16)), root / "mixtral")
    return out


class SwiGLU(nn.Module):
    """Linen's SwiGLU with Dense kernels (in, out), as the hf tree and MaxText store them."""

    @nn.compact
    def __call__(self, x, gate, up, down):
        return (nn.silu(x @ gate) * (x @ up)) @ down


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy()


def _jnp(a) -> jnp.ndarray:
    return jnp.asarray(np.asarray(a).astype(np.float32))


def _hf_mlp_out(path, layer: int, x: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model.model.layers[layer].mlp(torch.from_numpy(x)).numpy()


def test_hf_tree_is_what_orbax_restores_and_linen_runs_it_as_transformers_runs_the_mlp(models, tmp_path):
    src = models["llama"]
    before = tree_digest(src)
    run_cli("convert", src, "--to", "orbax", "-o", tmp_path / "o")
    assert tree_digest(src) == before
    restored = ocp.PyTreeCheckpointer().restore(str(tmp_path / "o"))
    mlp = restored["model"]["layers"]["1"]["mlp"]
    assert mlp["gate_proj"]["kernel"].dtype == ml_dtypes.bfloat16 and mlp["gate_proj"]["kernel"].shape == (64, 96)
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    y = SwiGLU().apply({}, _jnp(x), *(_jnp(mlp[k]["kernel"]) for k in ("gate_proj", "up_proj", "down_proj")))
    np.testing.assert_allclose(np.asarray(y), _hf_mlp_out(src, 1, x), rtol=2e-5, atol=2e-6)
    run_cli("convert", tmp_path / "o", "--to", "torch", "-o", tmp_path / "back")
    assert_identical(tensors(tmp_path / "back"), tensors(src))
    assert not {"_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt"} & set(_files(tmp_path / "back"))  # Orbax's own
    assert json.loads(run_cli("inspect", tmp_path / "back", "--json").stdout)["format"] == "safetensors"


@pytest.mark.parametrize("arch", ["llama", "llama31", "qwen3_moe", "mixtral"])
def test_maxtext_layout_round_trips_bit_exact(models, tmp_path, arch):
    run_cli("convert", models[arch], "--to", "orbax", "--orbax-layout", "maxtext", "-o", tmp_path / "mt")
    run_cli("convert", tmp_path / "mt", "--to", "torch", "-o", tmp_path / "back")
    assert_identical(tensors(tmp_path / "back"), tensors(models[arch]))


def test_maxtext_arrays_are_maxtexts_and_its_mlp_runs_as_transformers(models, tmp_path):
    src = models["llama"]
    run_cli("convert", src, "--to", "orbax", "--orbax-layout", "maxtext", "-o", tmp_path / "mt")
    p = ocp.PyTreeCheckpointer().restore(str(tmp_path / "mt"))["params"]["params"]
    layers = p[D]["layers"]
    assert layers["mlp"]["wi_0"]["kernel"].shape == (64, 3, 96)  # (embed, layers, mlp): the scan axis is 1
    assert layers["mlp"]["wo"]["kernel"].shape == (96, 3, 64)
    assert layers["self_attention"]["query"]["kernel"].shape == (64, 3, 4, 16)
    assert layers["self_attention"]["out"]["kernel"].shape == (4, 3, 16, 64)
    assert layers["pre_self_attention_layer_norm"]["scale"].shape == (64, 3)
    assert p["token_embedder"]["embedding"].shape == (128, 64) and p[D]["logits_dense"]["kernel"].shape == (64, 128)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    mlp = layers["mlp"]
    y = SwiGLU().apply({}, _jnp(x), *(_jnp(mlp[k]["kernel"][:, 2]) for k in ("wi_0", "wi_1", "wo")))
    np.testing.assert_allclose(np.asarray(y), _hf_mlp_out(src, 2, x), rtol=2e-5, atol=2e-6)
    hf = tensors(src)  # MaxText's converter: query = q_proj.T * head_dim**-0.5 (exact here: 16**-0.5 = 1/4)
    q = layers["self_attention"]["query"]["kernel"][:, 1].astype(np.float32) * 4
    np.testing.assert_array_equal(q.reshape(64, 64), _np(hf["model.layers.1.self_attn.q_proj.weight"]).T)


def test_llama31_query_is_stored_wider_and_q_k_interleaved_as_maxtext_converts_them(models, tmp_path):
    src = models["llama31"]
    r = run_cli("convert", src, "--to", "orbax", "--orbax-layout", "maxtext", "-o", tmp_path / "mt", "--json")
    assert "stored wider" in r.stdout and "interleaved" in r.stdout
    att = ocp.PyTreeCheckpointer().restore(str(tmp_path / "mt"))["params"]["params"][D]["layers"]["self_attention"]
    assert att["query"]["kernel"].dtype == np.float32 and att["key"]["kernel"].dtype == ml_dtypes.bfloat16
    hf = tensors(src)

    def adjust_rope(w, head_dim):  # MaxText's param_mapping.adjust_rope on HF's (in, heads, head_dim) kernel
        first, second = w[..., : head_dim // 2], w[..., head_dim // 2:]
        return np.stack([first, second], axis=-1).reshape(w.shape)

    k = _np(hf["model.layers.0.self_attn.k_proj.weight"]).T.reshape(64, 2, 8)
    np.testing.assert_array_equal(att["key"]["kernel"][:, 0].astype(np.float32), adjust_rope(k, 8))
    q = _np(hf["model.layers.0.self_attn.q_proj.weight"]).T.reshape(64, 8, 8)
    np.testing.assert_allclose(att["query"]["kernel"][:, 0], adjust_rope(q, 8) * 8 ** -0.5, rtol=1e-7)
    (tmp_path / "mt" / "config.json").unlink()  # read without its config: the weights' dtype, not the query's
    with open_any(tmp_path / "mt") as c:
        assert c.info("model.layers.0.self_attn.q_proj.weight").st_dtype == "BF16"
        assert c.config["dtype"] == "bfloat16"


def test_moe_experts_stack_as_maxtext_stacks_them(models, tmp_path):
    run_cli("convert", models["qwen3_moe"], "--to", "orbax", "--orbax-layout", "maxtext", "-o", tmp_path / "q")
    layers = ocp.PyTreeCheckpointer().restore(str(tmp_path / "q"))["params"]["params"][D]["layers"]
    assert layers["moe_block"]["wi_0"].shape == (4, 3, 64, 32) and layers["moe_block"]["wo"].shape == (4, 3, 32, 64)
    assert layers["moe_block"]["gate"]["kernel"].shape == (64, 3, 4)
    assert layers["self_attention"]["query_norm"]["scale"].shape == (16, 3)
    hf = tensors(models["qwen3_moe"])  # qk-norm: no query scaling
    np.testing.assert_array_equal(layers["self_attention"]["query"]["kernel"][:, 2].astype(np.float32).reshape(64, 64),
                                  _np(hf["model.layers.2.self_attn.q_proj.weight"]).T)
    np.testing.assert_array_equal(layers["moe_block"]["wi_1"][3, 1].astype(np.float32),
                                  _np(hf["model.layers.1.mlp.experts.3.up_proj.weight"]).T)
    run_cli("convert", models["mixtral"], "--to", "orbax", "--orbax-layout", "maxtext", "-o", tmp_path / "m")
    layers = ocp.PyTreeCheckpointer().restore(str(tmp_path / "m"))["params"]["params"][D]["layers"]
    assert layers["MoeBlock_0"]["wi_0"].shape == (4, 3, 64, 48)


def test_a_checkpoint_orbax_saved_reads_with_its_config_assumed_or_given(models, tmp_path):
    """As MaxText's converters save: StandardCheckpointer in a CheckpointManager step (0/items), zarr3, one chunk a
    whole array, no config.json."""
    src = models["llama"]
    run_cli("convert", src, "--to", "orbax", "--orbax-layout", "maxtext", "-o", tmp_path / "ours")
    tree = ocp.PyTreeCheckpointer().restore(str(tmp_path / "ours"))
    with ocp.StandardCheckpointer() as c:
        c.save(str(tmp_path / "run" / "0" / "items"), tree)
    assert not (tmp_path / "run" / "0" / "items" / "config.json").exists()
    r = run_cli("convert", tmp_path / "run", "--to", "torch", "-o", tmp_path / "guessed")
    assert "read step 0" in r.stderr and "assumed rope_theta" in r.stderr and "--config" in r.stderr
    assert_identical(tensors(tmp_path / "guessed"), tensors(src))  # shapes say every size here
    run_cli("--config", src / "config.json", "convert", tmp_path / "run" / "0", "--to", "torch", "-o", tmp_path / "g")
    assert_identical(tensors(tmp_path / "g"), tensors(src))


def test_verify_passes_conversions_and_fails_a_swap_and_a_scan_axis_off_by_one(models, tmp_path):
    src = models["llama"]
    for layout in ("hf", "maxtext"):
        run_cli("convert", src, "--to", "orbax", "--orbax-layout", layout, "-o", tmp_path / layout)
        report = json.loads(run_cli("verify", src, tmp_path / layout, "--json").stdout)
        assert report["passed"] is True and "PyTreeCheckpointer.restore of all" in json.dumps(report["load_check"])
    for name in ("swapped", "rolled"):
        t = ocp.PyTreeCheckpointer().restore(str(tmp_path / "maxtext"))
        m = t["params"]["params"][D]["layers"]["mlp"]
        if name == "swapped":
            m["wi_0"], m["wi_1"] = m["wi_1"], m["wi_0"]
        else:
            m["wi_0"]["kernel"] = np.roll(m["wi_0"]["kernel"], 1, axis=1)  # layer l's gate from layer l-1
        ocp.PyTreeCheckpointer().save(str(tmp_path / name), t)
        shutil.copy(tmp_path / "maxtext" / "config.json", tmp_path / name / "config.json")
        r = run_cli("verify", src, tmp_path / name, ok=None)
        assert r.exit_code == 1, r.stdout
        assert "layer 0" in r.stdout and "layer 2" in r.stdout


def test_refusals_say_what_is_wrong(models, model_dir, tmp_path):
    r = run_cli("convert", model_dir("phi3"), "--to", "orbax", "--orbax-layout", "maxtext", "-o", tmp_path / "a",
                ok=False)
    assert "--orbax-layout hf" in r.output
    run_cli("convert", model_dir("phi3"), "--to", "orbax", "-o", tmp_path / "b")
    with open_any(tmp_path / "b") as c:
        assert c.layout == "hf"
    r = run_cli("convert", models["llama"], "--to", "orbax", "-o", tmp_path / "c", "--max-shard-size", "1MB", ok=False)
    assert "OCDBT" in r.output
    r = run_cli("convert", models["llama"], "--to", "orbax", "--orbax-layout", "maxtext", "-o", tmp_path / "d",
                "--dry-run")
    assert "params/params/decoder/layers/mlp/wi_0/kernel[2]" in r.stdout and not (tmp_path / "d").exists()


def test_nnx_layout_is_a_state_nnx_linear_modules_take_and_run_as_transformers_runs_the_mlp(tmp_path):
    """The FFNs as NNX states (biases included): an nnx module of three nnx.Linear takes layer 1's state with
    nnx.update and computes what transformers' MLP computes; read back, the FFNs are the source's, bit for bit."""
    from flax import nnx

    torch.manual_seed(2)
    src = _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, mlp_bias=True)), tmp_path / "src")
    run_cli("convert", src, "--to", "orbax", "--orbax-layout", "nnx", "-o", tmp_path / "nnx")

    class FFN(nnx.Module):
        def __init__(self, rngs):
            self.gate, self.up = nnx.Linear(64, 96, rngs=rngs), nnx.Linear(64, 96, rngs=rngs)
            self.down = nnx.Linear(96, 64, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.silu(self.gate(x)) * self.up(x))

    module = FFN(nnx.Rngs(0))
    target = {"layers_1": nnx.state(module)}
    restored = ocp.StandardCheckpointer().restore(str(tmp_path / "nnx"), {"layers_0": nnx.state(module), **target})
    state = jax_tree_map(lambda a: jnp.asarray(np.asarray(a).astype(np.float32)), restored["layers_1"])
    nnx.update(module, state)
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(module(jnp.asarray(x))), _hf_mlp_out(src, 1, x), rtol=2e-5, atol=2e-6)
    with open_any(tmp_path / "nnx") as c:
        assert c.layout == "nnx"
        viewed = {n: c[n].clone() for n in c}
    hf = tensors(src)
    for layer in (0, 1):
        for role in ("gate", "up", "down"):
            ours, theirs = f"layers.{layer}.{role}", f"model.layers.{layer}.mlp.{role}_proj"
            assert torch.equal(viewed[f"{ours}.weight"], hf[f"{theirs}.weight"])
            assert torch.equal(viewed[f"{ours}.bias"], hf[f"{theirs}.bias"])


def jax_tree_map(f, tree):
    import jax

    return jax.tree_util.tree_map(f, tree)


def test_maxtext_converts_to_the_gguf_its_source_converts_to(gguf_model, gguf_ref, tmp_path):
    """MaxText's tree to llama.cpp: the GGUF llama.cpp's converter writes from the Hugging Face source, byte for
    byte (the output named as the source: the converter names a model from its directory; the query's scaling
    undone exactly on read)."""
    src = gguf_model("llama")
    run_cli("convert", src, "--to", "orbax", "--orbax-layout", "maxtext", "-o", tmp_path / "model")
    run_cli("convert", tmp_path / "model", "--to", "gguf", "--outtype", "f32", "-o", tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == gguf_ref("llama", "f32").read_bytes()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_maxtext_saved_without_scanning_reads_layer_by_layer(models, tmp_path, arch):
    """MaxText with scan_layers false saves decoder/layers_{L}/... without the layer axis (experts still first):
    read, its config inferred from the shapes, it is the source."""
    src = models[arch]
    run_cli("convert", src, "--to", "orbax", "--orbax-layout", "maxtext", "-o", tmp_path / "scanned")
    tree = ocp.PyTreeCheckpointer().restore(str(tmp_path / "scanned"))
    decoder = tree["params"]["params"]["decoder"]
    scanned = decoder.pop("layers")

    def layer(node, n):
        return {k: layer(v, n) for k, v in node.items()} if isinstance(node, dict) else np.take(node, n, axis=1)

    for n in range(3):
        decoder[f"layers_{n}"] = layer(scanned, n)
    with ocp.StandardCheckpointer() as c:
        c.save(str(tmp_path / "run" / "0" / "items"), tree)
    r = run_cli("convert", tmp_path / "run", "--to", "torch", "-o", tmp_path / "back")
    assert "assumed" in r.stderr
    assert_identical(tensors(tmp_path / "back"), tensors(src))


def _files(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


@pytest.fixture(scope="module")
def maxtext_run(models, tmp_path_factory):
    """A MaxText run's checkpoint as orbax's CheckpointManager saves it: a flax TrainState (step, params under
    params/params, optax AdamW's state beside them: opt_state/0/mu/params/..., nu, count) in step 0's items/, with
    Orbax's own files (_METADATA, _sharding, manifest.ocdbt, commit_success.txt) and no config.json."""
    import optax
    from flax.training import train_state

    root = tmp_path_factory.mktemp("maxtext-run")
    run_cli("convert", models["llama"], "--to", "orbax", "--orbax-layout", "maxtext", "-o", root / "tree")
    params = ocp.PyTreeCheckpointer().restore(str(root / "tree"))["params"]
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-3))
    with ocp.CheckpointManager(root / "run") as manager:
        manager.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave(item=state)))
        manager.wait_until_finished()
    assert {"_METADATA", "_sharding", "manifest.ocdbt"} <= set(_files(root / "run" / "0" / "items"))
    return root / "run"


def test_a_maxtext_run_with_its_optimizer_state_reads_its_params_and_none_of_orbaxs_files(models, maxtext_run,
                                                                                            tmp_path):
    """The params are read, opt_state left out and said (not refused as a kernel of 3 dims); the output holds the
    source's weights bit for bit and none of Orbax's own files, reads back as a PyTorch checkpoint, loads in
    transformers, and verify passes it against the run."""
    config = models["llama"] / "config.json"
    r = run_cli("--config", config, "convert", maxtext_run, "--to", "torch", "-o", tmp_path / "hf")
    assert ("25 training-state array(s) not read as weights, left out: opt_state/* (25); the model read from "
            "params/params/*") in r.stderr
    assert _files(tmp_path / "hf") == ["config.json", "ffn-tools-receipt.json", "model.safetensors"]
    assert_identical(tensors(tmp_path / "hf"), tensors(models["llama"]))
    assert json.loads(run_cli("inspect", tmp_path / "hf", "--json").stdout)["format"] == "safetensors"
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    report = json.loads(run_cli("--config", config, "verify", maxtext_run, tmp_path / "hf", "--json").stdout)
    assert report["passed"] is True


def test_orbax_to_orbax_writes_its_own_metadata_not_the_inputs(models, maxtext_run, tmp_path):
    """Orbax's own files never travel as side files (formats.owner_of): a MaxText tree (the run's, as ffn-tools
    wrote it) written in the Hugging Face Flax tree keeps the _METADATA the writer wrote (the input's, copied over
    it, named arrays the output has not), so orbax restores the new tree."""
    run_cli("convert", maxtext_run.parent / "tree", "--to", "orbax", "-o", tmp_path / "o")
    restored = ocp.PyTreeCheckpointer().restore(str(tmp_path / "o"))
    assert sorted(restored) == ["lm_head", "model"]
    hf = tensors(models["llama"])
    np.testing.assert_array_equal(restored["model"]["layers"]["2"]["mlp"]["down_proj"]["kernel"].astype(np.float32),
                                  _np(hf["model.layers.2.mlp.down_proj.weight"]).T)
