"""torch.distributed.checkpoint (DCP) read and write: tiny real transformers models converted to DCP in torchtitan's
and Hugging Face's names, checked against torch's own ``dcp.load`` / ``dcp.save`` and torchtitan's own state-dict
adapters (the anchor for the Hugging Face mapping), round trips bit for bit, and verify against the source."""

from __future__ import annotations

import importlib
import json
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from helpers import assert_identical, run_cli, tensors, tree_digest, write_tokenizer

from ffn_tools.converters import open_any

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _hf_llama(path):
    """Llama with torchtitan's llama3 debugmodel's attention (dim 256, 16 heads of 16): its adapter permutes q/k
    over those heads."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=16, dtype="bfloat16")
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    write_tokenizer(path, 128)
    return path


def _hf_qwen3_moe(path):
    """Qwen3-MoE with torchtitan's qwen3 debugmodel_moe's 64 experts (its adapter stacks exactly that many)."""
    torch.manual_seed(1)
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=8,
                                      num_experts=64, num_experts_per_tok=8, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, dtype="bfloat16")
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    write_tokenizer(path, 128)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _hf_llama(tmp_path_factory.mktemp("dcp") / "llama")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return _hf_qwen3_moe(tmp_path_factory.mktemp("dcp") / "qwen3moe")


def _dcp_load(path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, loaded by torch.distributed.checkpoint itself."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if hasattr(v, "size")}
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def _viewed(path) -> dict[str, torch.Tensor]:
    with open_any(path) as c:
        return {n: c[n].clone() for n in c}


def _adapter(model: str, flavor: str):
    importlib.import_module("tyro")  # torchtitan's package imports it (installed with torchtitan, see Makefile)
    mod = importlib.import_module(f"torchtitan.models.{model}")
    spec = mod.model_registry(flavor)
    return spec.state_dict_adapter(spec.model, None)


@pytest.mark.parametrize("ranks", [1, 3])
def test_llama_to_torchtitan_dcp_is_what_torchtitans_adapter_makes_and_comes_back_bit_exact(llama, tmp_path, ranks):
    out = tmp_path / "dcp"
    before = tree_digest(llama)
    run_cli("convert", llama, "--to", "dcp", "-o", out, "--dcp-ranks", ranks)
    assert tree_digest(llama) == before
    assert sorted(p.name for p in out.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(ranks)]
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    loaded = _dcp_load(out)  # torch's own reader accepts it
    hf = tensors(llama)
    expected = _adapter("llama3", "debugmodel").from_hf(dict(hf))  # torchtitan's own mapping (permutes q/k)
    assert_identical(loaded, {k: v.contiguous() for k, v in expected.items()})
    if ranks > 1:  # sharded like FSDP's Shard(0): each rank a chunk of the rows
        md = dcp.FileSystemReader(str(out)).read_metadata()
        chunks = md.state_dict_metadata["layers.0.feed_forward.w1.weight"].chunks
        assert [c.offsets[0] for c in chunks] == [0, 32, 64] and [c.sizes[0] for c in chunks] == [32, 32, 32]
    back = tmp_path / "back"
    run_cli("convert", out, "--to", "torch", "-o", back)
    assert_identical(tensors(back), hf)
    assert json.loads((back / "config.json").read_text())["model_type"] == "llama"


def test_qwen3_moe_experts_stack_as_torchtitan_stacks_them(qwen3_moe, tmp_path):
    out = tmp_path / "dcp"
    r = run_cli("--quiet", "convert", qwen3_moe, "--to", "dcp", "-o", out, "--json")
    assert "2 layers' experts stacked" in r.stdout
    loaded = _dcp_load(out)
    assert tuple(loaded["layers.1.moe.routed_experts.inner_experts.w1_EFD"].shape) == (64, 8, 32)
    assert tuple(loaded["layers.1.moe.routed_experts.inner_experts.w2_EDF"].shape) == (64, 32, 8)
    hf = tensors(qwen3_moe)
    expected = _adapter("qwen3", "debugmodel_moe").from_hf(dict(hf))
    assert_identical(loaded, {k: v.contiguous() for k, v in expected.items()})
    assert_identical(_viewed(out), hf)  # read back: one tensor per expert, as Hugging Face names them


def test_a_checkpoint_torchtitan_saved_reads_with_its_training_state_left_out_and_config_assumed(llama, tmp_path):
    """As torchtitan's CheckpointManager saves a step: the model's keys flat at the top level beside the optimizer,
    the scheduler and the train state; written by dcp.save itself, torchtitan 0.2's names, no config.json."""
    hf = tensors(llama)
    titan = _adapter("llama3", "debugmodel").from_hf(dict(hf))
    old = {k.replace("attention.qkv_linear.", "attention.").replace("lm_head.", "output."): v.contiguous()
           for k, v in titan.items()}
    state = {**old, "optimizer": {"state": {"layers.0.feed_forward.w1.weight": {"exp_avg": torch.zeros(3)}}},
             "lr_scheduler": {"last_epoch": 5}, "train_state": {"step": 5}}
    step = tmp_path / "step-5"
    dcp.save(state, checkpoint_id=str(step), no_dist=True)
    r = run_cli("convert", step, "--to", "torch", "-o", tmp_path / "guess")
    assert "training-state key(s) not read as weights" in r.stderr
    assert "assumed head_dim 128" in r.stderr and "--config" in r.stderr  # said, not silent
    guessed = tensors(tmp_path / "guess")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(guessed[q], hf[q])  # 2 heads of 128 assumed, 16 of 16 true: rows in another order
    run_cli("--config", llama / "config.json", "convert", step, "--to", "torch", "-o", tmp_path / "given")
    assert_identical(tensors(tmp_path / "given"), hf)


def test_hf_naming_reads_torchs_own_save_and_writes_what_dcp_load_takes(llama, tmp_path):
    hf = tensors(llama)
    saved = tmp_path / "saved"
    dcp.save({k: v.clone() for k, v in hf.items()}, checkpoint_id=str(saved), no_dist=True)
    shutil.copy(llama / "config.json", saved / "config.json")
    assert_identical(_viewed(saved), hf)
    out = tmp_path / "out"
    run_cli("convert", llama, "--to", "dcp", "--dcp-naming", "hf", "--dcp-ranks", 2, "-o", out)
    assert_identical(_dcp_load(out), hf)


def test_verify_passes_a_conversion_and_fails_gate_and_up_swapped(llama, tmp_path):
    out = tmp_path / "dcp"
    run_cli("convert", llama, "--to", "dcp", "-o", out)
    r = run_cli("verify", llama, out, "--json")
    report = json.loads(r.stdout)
    assert report["passed"] is True
    assert "dcp.load of all 21 keys, 1 GiB at a time" in json.dumps(report["load_check"])
    swapped = tmp_path / "swapped"
    sd = _dcp_load(out)
    sd["layers.1.feed_forward.w1.weight"], sd["layers.1.feed_forward.w3.weight"] = (
        sd["layers.1.feed_forward.w3.weight"], sd["layers.1.feed_forward.w1.weight"])
    dcp.save(sd, checkpoint_id=str(swapped), no_dist=True)
    shutil.copy(out / "config.json", swapped / "config.json")
    r = run_cli("verify", llama, swapped, ok=None)
    assert r.exit_code == 1 and "layer 1" in r.stdout


def test_logits_run_the_dcp_weights_in_transformers(llama, tmp_path):
    out = tmp_path / "dcp"
    run_cli("convert", llama, "--to", "dcp", "-o", out)
    r = run_cli("verify", llama, out, "--logits", "--json")
    report = json.loads(r.stdout)
    assert report["passed"] is True and report["logits"]["client_b"] == "transformers (DCP weights)"
    assert report["logits"]["max_abs"] == 0.0  # the same bits, built as from_pretrained builds them


def test_refusals_say_what_is_wrong(llama, model_dir, tmp_path):
    r = run_cli("convert", llama, "--to", "dcp", "-o", tmp_path / "a", "--max-shard-size", "1MB", ok=False)
    assert "one file per rank" in r.output
    r = run_cli("convert", model_dir("phi3"), "--to", "dcp", "-o", tmp_path / "b", ok=False)
    assert "--dcp-naming hf" in r.output
    run_cli("convert", model_dir("phi3"), "--to", "dcp", "--dcp-naming", "hf", "-o", tmp_path / "b")
    assert_identical(_viewed(tmp_path / "b"), tensors(model_dir("phi3")))
    r = run_cli("convert", llama, "--to", "mlx", "-o", tmp_path / "c", "--dcp-ranks", "2", ok=False)
    assert "--dcp-ranks does not apply to --to mlx" in r.output


def test_a_metadata_that_would_run_code_is_refused(llama, tmp_path):
    out = tmp_path / "dcp"
    run_cli("convert", llama, "--to", "dcp", "-o", out)

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("touch " + str(tmp_path / "ran"),))

    (out / ".metadata").write_bytes(pickle.dumps(Evil()))
    r = run_cli("inspect", out, ok=False)
    assert "posix.system is not something a DCP .metadata holds" in r.output
    assert not (tmp_path / "ran").exists()


def test_a_missing_rank_file_is_named(llama, tmp_path):
    out = tmp_path / "dcp"
    run_cli("convert", llama, "--to", "dcp", "--dcp-ranks", "2", "-o", out)
    (out / "__1_0.distcp").unlink()
    r = run_cli("inspect", out, ok=False)
    assert "__1_0.distcp" in r.output


def test_a_chunk_saved_non_contiguous_reads_as_its_values(llama, tmp_path):
    """A rank may save a transposed view (its storage in another order): its bytes are not the tensor in C order,
    so it is read through torch.load, not copied as bytes."""
    hf = tensors(llama)
    name = "model.layers.0.mlp.down_proj.weight"
    saved = {k: v.clone() for k, v in hf.items()}
    saved[name] = hf[name].T.contiguous().T  # same values, column-major storage
    assert not saved[name].is_contiguous()
    dcp.save(saved, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    shutil.copy(llama / "config.json", tmp_path / "d" / "config.json")
    with open_any(tmp_path / "d") as c:
        assert c.info(name).start is None and c.info("model.layers.0.mlp.up_proj.weight").start is not None
    run_cli("convert", tmp_path / "d", "--to", "torch", "-o", tmp_path / "back")
    assert_identical(tensors(tmp_path / "back"), hf)


@pytest.mark.parametrize("zip64", [False, True])
def test_the_chunk_writer_writes_what_torch_load_reads_and_zip_checks(tmp_path, zip64):
    """DCP chunks are written as torch.save writes them, streamed (converters.dcp.torchsave.write): torch.load with
    weights_only=True reads them back, every CRC-32 checks (zipfile.testzip), zip64 (what a chunk over 4 GiB needs)
    forced here on a small tensor, and the reader finds the bytes in place."""
    import io
    import zipfile

    from ffn_tools.converters.dcp import torchsave

    t = (torch.randn(33, 7) * 100).to(torch.bfloat16)
    data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    path = tmp_path / "chunk"
    with open(path, "wb", buffering=0) as f:
        f.write(b"x" * 37)  # a chunk starts wherever the rank file ends
        torchsave.write(f, "bfloat16", (33, 7), [memoryview(data)[:100], memoryview(data)[100:]], len(data),
                        zip64=zip64)
        end = f.tell()
    raw = path.read_bytes()[37:end]
    assert torch.equal(torch.load(io.BytesIO(raw), weights_only=True), t)
    assert zipfile.ZipFile(io.BytesIO(raw)).testzip() is None
    with open(path, "rb") as f:
        stored = torchsave.locate(f, 37, end - 37, 2, (33, 7))
    assert stored is not None and path.read_bytes()[stored.start: stored.start + stored.nbytes] == data


def test_a_dcp_converts_to_the_gguf_its_source_converts_to(gguf_model, gguf_ref, tmp_path):
    """Every format converts to every other: the GGUF of a DCP (llama.cpp's converter fed from the DCP view) is the
    file llama.cpp's converter writes from the Hugging Face source, byte for byte
    (the DCP named as the source: the converter names a model from its directory)."""
    src = gguf_model("llama")
    run_cli("convert", src, "--to", "dcp", "--dcp-ranks", 2, "-o", tmp_path / "model")
    run_cli("convert", tmp_path / "model", "--to", "gguf", "--outtype", "f32", "-o", tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == gguf_ref("llama", "f32").read_bytes()


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_deepseek_v3_shared_experts_mla_and_router_bias_as_torchtitans_adapter_maps_them(tmp_path, q_lora_rank):
    """DeepSeek-V3 (torchtitan's debugmodel's 8 experts): MLA attention's names, the dense first layer, routed
    experts stacked, the shared expert, the router's score-correction bias as moe.expert_bias_E; with a q LoRA
    (wq_a/q_norm/wq_b) too."""
    torch.manual_seed(3)
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, dtype="bfloat16")
    model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_()  # not zeros: a swap would show
    model.save_pretrained(tmp_path / "src")
    hf = tensors(tmp_path / "src")
    run_cli("convert", tmp_path / "src", "--to", "dcp", "-o", tmp_path / "dcp")
    loaded = _dcp_load(tmp_path / "dcp")
    assert "layers.1.moe.shared_experts.w1.weight" in loaded and "layers.0.feed_forward.w1.weight" in loaded
    assert tuple(loaded["layers.1.moe.routed_experts.inner_experts.w1_EFD"].shape) == (8, 32, 64)
    if q_lora_rank is None:  # torchtitan's debugmodel has no q LoRA: its adapter is the anchor there
        expected = _adapter("deepseek_v3", "debugmodel").from_hf(dict(hf))
        assert_identical(loaded, {k: v.contiguous() for k, v in expected.items()})
    else:
        assert {"layers.0.attention.wq_a.weight", "layers.0.attention.q_norm.weight"} <= set(loaded)
    run_cli("convert", tmp_path / "dcp", "--to", "torch", "-o", tmp_path / "back")
    assert_identical(tensors(tmp_path / "back"), hf)


def test_inspect_and_extract_read_a_dcp_as_any_checkpoint(qwen3_moe, tmp_path):
    run_cli("convert", qwen3_moe, "--to", "dcp", "--dcp-ranks", 2, "-o", tmp_path / "dcp")
    info = json.loads(run_cli("inspect", tmp_path / "dcp", "--json").stdout)
    assert info["format"] == "dcp" and info["routed_experts"] == 64 and len(info["shards"]) == 2  # the rank files
    run_cli("extract", qwen3_moe, "-o", tmp_path / "from-hf.safetensors")
    run_cli("extract", tmp_path / "dcp", "-o", tmp_path / "from-dcp.safetensors")
    assert_identical(tensors(tmp_path / "from-dcp.safetensors"), tensors(tmp_path / "from-hf.safetensors"))


class AppState(Stateful):
    """PyTorch's DCP tutorial's (recipes/distributed_checkpoint_recipe), as written there: the model and its
    optimizer under one key of the state dict ``dcp.save`` is given."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _trained(path):
    """The model at ``path`` after one AdamW step on a batch: its optimizer holds state for all 21 parameters."""
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def _files(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _loads_in_transformers(path) -> None:
    """transformers builds the model from ``path`` with every weight it expects there and none it does not."""
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("recipe", ["tutorial", "fsdp"])
def test_a_training_save_reads_as_its_models_subtree_with_the_optimizer_left_out(llama, tmp_path, recipe):
    """The DCP tutorial's {"app": AppState} (app.model.* beside app.optim.*, the optimizer's state keyed by the
    parameters' names) and an FSDP recipe's {"model": ..., "optimizer": ...} (optimizer.state.0...: keyed by
    number): the model's subtree is taken and said, the optimizer's 63 moments and its param groups left out and
    said; the output holds the 21 weights, none of the DCP's files, loads in transformers, and verify passes it."""
    model, optimizer = _trained(llama)
    if recipe == "tutorial":
        state, subtree, optim = {"app": AppState(model, optimizer)}, "app.model.", "app.optim."
    else:
        state, subtree, optim = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "model.", "optimizer."
    dcp.save(state, checkpoint_id=str(tmp_path / "run"), no_dist=True)
    config = llama / "config.json"
    r = run_cli("--config", config, "convert", tmp_path / "run", "--to", "torch", "-o", tmp_path / "hf")
    assert f"the model is the subtree {subtree}* (its keys read without that prefix)" in r.stderr
    assert f"75 training-state key(s) not read as weights, left out: optimizer state {optim}* (75 keys)" in r.stderr
    assert _files(tmp_path / "hf") == ["config.json", "ffn-tools-receipt.json", "model.safetensors"]
    assert_identical(tensors(tmp_path / "hf"), {k: v.detach() for k, v in model.state_dict().items()})
    _loads_in_transformers(tmp_path / "hf")
    report = json.loads(run_cli("--config", config, "verify", tmp_path / "run", tmp_path / "hf", "--json").stdout)
    assert report["passed"] is True


def _titan_deepseek(tmp_path) -> tuple:
    """A mid-run step of torchtitan's DeepSeek-V3 debugmodel (its first two layers: one dense, one MoE; bf16) as
    torchtitan's own CheckpointManager saves it: the model's keys flat beside AdamW's state (one step taken), the
    LR scheduler and the data loader; the router's load-balancing bias (moe.expert_bias_E) as training leaves it,
    not zeros. Returns the step's directory, a config.json of the same model for transformers, and the model's
    state dict as saved."""
    importlib.import_module("tyro")  # torchtitan's package imports it (see _adapter)
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    spec = importlib.import_module("torchtitan.models.deepseek_v3").model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:2]
    torch.manual_seed(4)
    model = spec.model.build()
    for p in model.parameters():  # bf16 weights, half the bytes; its buffers as torchtitan keeps them (float32, the
        # rotary table complex). build() leaves the weights as allocated (its trainer calls init_weights on the
        # device): seeded values here, or a step holds whatever memory was there (inf/nan, one run in several)
        p.data = (torch.randn(p.shape) * 0.02).to(torch.bfloat16)
    optimizers = OptimizersContainer(OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop"), model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizers.step()
    schedulers.step()
    with torch.no_grad():
        model.layers["1"].moe.expert_bias_E.normal_()
    manager = CheckpointManager(CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0),
                                dataloader=None, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=schedulers, states={}, sd_adapter=None, base_folder=str(tmp_path))
    manager.save(curr_step=1)
    manager.close()
    hf = transformers.DeepseekV3Config(
        vocab_size=2048, hidden_size=256, intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=3, n_group=1, topk_group=1, first_k_dense_replace=1,
        num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, dtype="bfloat16")
    hf.save_pretrained(tmp_path / "hf-config")
    return (tmp_path / "checkpoint" / "step-1", tmp_path / "hf-config" / "config.json",
            {k: v.detach().clone() for k, v in model.state_dict().items()})


@pytest.fixture(scope="module")
def titan_step(tmp_path_factory):
    return _titan_deepseek(tmp_path_factory.mktemp("titan"))


def test_a_torchtitan_step_converts_without_its_training_state_and_back_to_a_dcp_torch_loads(titan_step, tmp_path):
    """torchtitan step -> Hugging Face: the model's weights only (the router's bias as e_score_correction_bias), no
    rank file of the step beside them; it loads in transformers and verify passes it against the step. Back
    -> DCP: the rank file is the one written (none carried over it), and dcp.load reads the step's model."""
    step, config, saved = titan_step
    r = run_cli("--config", config, "convert", step, "--to", "torch", "-o", tmp_path / "hf")
    assert "left out: optimizer state optimizer.* (" in r.stderr and "lr_scheduler.* (1 key)" in r.stderr
    assert _files(tmp_path / "hf") == ["config.json", "ffn-tools-receipt.json", "model.safetensors"]
    hf = tensors(tmp_path / "hf")
    assert not [n for n in hf if "exp_avg" in n or "optimizer" in n]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(hf[bias], saved["layers.1.moe.expert_bias_E"])
    _loads_in_transformers(tmp_path / "hf")
    report = json.loads(run_cli("--config", config, "verify", step, tmp_path / "hf", "--json").stdout)
    assert report["passed"] is True
    run_cli("convert", tmp_path / "hf", "--to", "dcp", "-o", tmp_path / "dcp")
    assert _files(tmp_path / "dcp") == [".metadata", "__0_0.distcp", "config.json", "ffn-tools-receipt.json"]
    assert_identical(_dcp_load(tmp_path / "dcp"), saved)  # torch's own reader, the step's model bit for bit


def test_a_torchtitan_0_2_deepseek_keeps_its_router_bias(titan_step, tmp_path):
    """torchtitan 0.2 named the router's load-balancing bias moe.expert_bias (its adapter: e_score_correction_bias
    <-> layers.{}.moe.expert_bias), its experts moe.experts.w1/w3/w2 and the unembedding output: read as the
    router's bias, not as training state."""
    step, config, saved = titan_step
    old = {"moe.routed_experts.inner_experts.w1_EFD": "moe.experts.w1", "moe.routed_experts.inner_experts.w3_EFD":
           "moe.experts.w3", "moe.routed_experts.inner_experts.w2_EDF": "moe.experts.w2",
           "moe.expert_bias_E": "moe.expert_bias", "lm_head.weight": "output.weight"}
    renamed = {next((k.replace(a, b) for a, b in old.items() if a in k), k): v.clone() for k, v in saved.items()}
    assert "layers.1.moe.expert_bias" in renamed
    dcp.save({**renamed, "lr_scheduler": {"last_epoch": 1}}, checkpoint_id=str(tmp_path / "step"), no_dist=True)
    r = run_cli("--config", config, "convert", tmp_path / "step", "--to", "torch", "-o", tmp_path / "hf")
    assert "1 training-state key(s) not read as weights, left out: lr_scheduler.* (1 key)" in r.stderr
    hf = tensors(tmp_path / "hf")
    assert torch.equal(hf["model.layers.1.mlp.gate.e_score_correction_bias"], saved["layers.1.moe.expert_bias_E"])
    _loads_in_transformers(tmp_path / "hf")


def test_a_deepseek_step_without_a_router_bias_says_so(titan_step, tmp_path):
    """torchtitan registers moe.expert_bias_E only where load balancing is on: without it no
    e_score_correction_bias is written, and that is said (transformers starts it at zeros)."""
    step, config, saved = titan_step
    dcp.save({k: v for k, v in saved.items() if "expert_bias" not in k}, checkpoint_id=str(tmp_path / "step"),
             no_dist=True)
    r = run_cli("--config", config, "convert", tmp_path / "step", "--to", "torch", "-o", tmp_path / "hf")
    assert ("1 MoE layer(s) have no router bias here (torchtitan's moe.expert_bias_E: load balancing off), so no "
            "e_score_correction_bias is written for them") in r.stderr
    assert not [n for n in tensors(tmp_path / "hf") if "e_score_correction_bias" in n]


def test_dcp_to_dcp_writes_its_own_rank_files_not_the_inputs(llama, tmp_path):
    """A DCP's own files never travel as side files (formats.owner_of): a DCP in Hugging Face names written again in
    torchtitan's keeps the rank file and .metadata the writer wrote, so torch's own reader reads the new names."""
    run_cli("convert", llama, "--to", "dcp", "--dcp-naming", "hf", "-o", tmp_path / "hf-names")
    run_cli("convert", tmp_path / "hf-names", "--to", "dcp", "-o", tmp_path / "titan")
    expected = _adapter("llama3", "debugmodel").from_hf(dict(tensors(llama)))
    assert_identical(_dcp_load(tmp_path / "titan"), {k: v.contiguous() for k, v in expected.items()})


@pytest.mark.parametrize("rows,heads", [(64, 4), (96, 3), (8, 1)])
def test_torchtitan_rotary_order_is_unpermute_as_a_permute_op(rows, heads):
    """The torchtitan export's q/k rows are a ``Permute`` op (data, reversible) of the order ``native.layout.unpermute``
    computes, and its reverse is ``permute``: both bit for bit."""
    from ffn_tools.converters.dcp.export import _rotary_order
    from ffn_tools.converters.native.layout import permute, unpermute
    from ffn_tools.ops import Permute

    w = torch.randn(rows, 5, dtype=torch.bfloat16)
    op = Permute(_rotary_order(rows, heads))
    (out,) = op.apply([w])
    assert torch.equal(out, unpermute(w, heads)) and not (rows > 2 and torch.equal(out, w))
    (back,) = op.reverse().apply([out])
    assert torch.equal(back, w) and torch.equal(permute(out, heads), w)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("stored", ["stack", "fused"])
def test_torchtitan_experts_from_a_stored_stack_are_its_ops_reversed(stored, dtype, tmp_path):
    """A transformers-5 Qwen3-MoE (``experts.gate_up_proj`` (E, 2I, H)), or one with a fused gate_up per expert,
    written in torchtitan's names: each expert stack is ops (the stored stack's reversed; each expert's split), no
    closure, the stacked canonical weights bit for bit, and a byte copy where nothing is cast."""
    from tiny_models import build, make_model

    from ffn_tools.api import fuse_gateup
    from ffn_tools.converters.dcp.export import build_plan
    from ffn_tools.detect import find_ffns
    from ffn_tools.ffn import canonical_weights

    if stored == "stack":
        make_model("qwen3_moe").save_pretrained(tmp_path / "src", save_original_format=False)
    else:
        build("qwen3_moe", tmp_path / "hf")
        fuse_gateup(tmp_path / "hf", tmp_path / "src")
    ckpt = open_any(tmp_path / "src")
    experts = [e for e in build_plan(ckpt, "torchtitan", dtype).entries if ".inner_experts." in e.name]
    ffns = sorted((f for f in find_ffns(ckpt).ffns if f.ref.kind == "expert"), key=lambda f: f.ref.expert)
    assert len(experts) == 6 and all(pickle.loads(pickle.dumps(e.ops)) == e.ops for e in experts)
    for e in experts:
        layer = int(e.name.split(".")[1])
        role = {"w1": "gate", "w3": "up", "w2": "down"}[e.name.rsplit(".", 1)[1][:2]]
        want = torch.stack([canonical_weights(ckpt, f)[role] for f in ffns if f.ref.layer == layer])
        assert torch.equal(e.apply([ckpt[n] for n in e.inputs]), want if dtype is None else want.to(dtype))
        assert (e.pieces is not None) == (dtype is None)


class _Stored(dict):
    """Tensors by name, with ``info(name).shape`` as a checkpoint gives it."""

    def info(self, name):
        from types import SimpleNamespace

        return SimpleNamespace(shape=tuple(self[name].shape))


@pytest.mark.parametrize("stored", ["turned-fused-per-expert", "partial-stack", "flat-partial-stack"])
def test_torchtitan_experts_from_every_stored_form_are_ops(stored):
    """The forms that once kept a closure over canonical_weights (a fused gate_up per expert stored (in, out); a
    stack or flattened stack some of whose experts are not written, or are in another order) are ops too: plain
    pickle carries them, and they give each role's stack of canonical weights bit for bit."""
    from types import SimpleNamespace

    from ffn_tools.converters.dcp.export import _stack_ops
    from ffn_tools.ffn import canonical_weights
    from ffn_tools.layouts import GateUpLayout
    from ffn_tools.ops import run
    from ffn_tools.registry import Form

    h, i = 4, 3
    g = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if stored == "turned-fused-per-expert":
        form = Form(gate_up="e{expert}.gate_up", down="e{expert}.down", transposed=True)
        layout = GateUpLayout(arrangement="interleaved").oriented(True)
        ckpt = _Stored({f"e{k}.{r}": rand(h, 2 * i) if r == "gate_up" else rand(i, h)
                        for k in range(3) for r in ("gate_up", "down")})
        ffns = [({"gate_up": f"e{k}.gate_up", "down": f"e{k}.down"}, None) for k in range(3)]
    elif stored == "partial-stack":
        form = Form(gate_up="gu", down="d", stacked=True)
        layout = GateUpLayout()
        ckpt = _Stored({"gu": rand(4, 2 * i, h), "d": rand(4, h, i)})
        ffns = [({"gate_up": "gu", "down": "d"}, k) for k in (3, 0, 2)]
    else:
        form = Form(gate="w1", up="v1", down="w2", flat=True, turned=("down",))
        layout = GateUpLayout()
        ckpt = _Stored({"w1": rand(4 * i, h), "v1": rand(4 * i, h), "w2": rand(4 * i, h)})
        ffns = [({"gate": "w1", "up": "v1", "down": "w2"}, k) for k in (1, 3)]
    experts = [SimpleNamespace(form=form, layout=layout, names=names, index=index, d_model=h, d_ffn=i,
                               ref=SimpleNamespace(layer=0)) for names, index in ffns]
    for role in ("gate", "up", "down"):
        inputs, ops = _stack_ops(ckpt, experts, role)
        ops = pickle.loads(pickle.dumps(ops))
        [got] = run(ops, [ckpt[n] for n in inputs])
        want = torch.stack([canonical_weights(ckpt, f)[role] for f in experts])
        assert torch.equal(got, want), (stored, role)
