"""LoRA adapters: PEFT, mlx_lm and llama.cpp's GGUF LoRA read and written, re-laid out exactly, merged, verified.

Every adapter here is PEFT's own (``get_peft_model(...).save_pretrained``) on a tiny transformers model, with
non-zero B; every output is loaded by its real client (PeftModel, mlx_lm's load_adapters, llama.cpp's lora_path)
and its logits held against PeftModel's on the original adapter.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from helpers import run_cli, tree_digest

from ffn_tools.adapters import formats, relayout

TOKENS = torch.arange(3, 19).reshape(2, 8)
FFN = ["gate_proj", "up_proj", "down_proj"]
STACKED = dict(target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def peft_adapter(model, path: Path, seed: int = 1, **lora) -> Path:
    """PEFT's own adapter of ``model`` saved at ``path``: r 4, alpha 8 unless ``lora`` says otherwise, every factor
    random (B non-zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(**{"r": 4, "lora_alpha": 8, "init_lora_weights": False, **lora})
    get_peft_model(copy.deepcopy(model), cfg).save_pretrained(path)
    return path


def peft_logits(model, adapter: Path) -> torch.Tensor:
    from peft import PeftModel

    pm = PeftModel.from_pretrained(copy.deepcopy(model), adapter).eval()
    with torch.no_grad():
        return pm(TOKENS).logits


def deltas(adapter) -> dict[str, torch.Tensor]:
    return {t: x.delta(torch.float64) for t, x in adapter.loras.items()}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """``base(arch) -> (model, dir)``: a tiny transformers model and its save_pretrained checkpoint."""
    made = {}

    def get(arch: str):
        if arch not in made:
            path = tiny_models.build(arch, tmp_path_factory.mktemp(arch) / "model")
            made[arch] = (tiny_models.make_model(arch), path)
        return made[arch]

    return get


@pytest.mark.parametrize("arch,lora", [
    ("llama", dict(target_modules=[*FFN, "q_proj"], rank_pattern={"down_proj": 2}, alpha_pattern={"up_proj": 16})),
    ("llama", dict(target_modules=FFN, use_rslora=True, r=8)),
    ("phi3", dict(target_modules=["gate_up_proj", "down_proj"])),
    ("mixtral", STACKED),
    ("qwen3_moe", dict(STACKED, rank_pattern={"experts.down_proj": 2})),
    ("qwen2_moe", dict(target_modules=FFN)),  # PEFT >= 0.22: the stacked experts too, as bare target_parameters
])
def test_peft_reads_as_peft_merges_and_writes_back_bit_exact(arch, lora, base, tmp_path):
    """The delta read from PEFT's files is what PEFT's merge_and_unload adds (rank/alpha patterns, rsLoRA, v5
    stacked experts with their interleaved lora_B); written back, every factor is the same bytes."""
    from peft import PeftModel

    model, _ = base(arch)
    src = peft_adapter(model, tmp_path / "lora", **lora)
    adapter = formats.read(src, model.config.to_dict())
    merged = PeftModel.from_pretrained(copy.deepcopy(model), src).merge_and_unload().state_dict()
    own = model.state_dict()
    for target, d in deltas(adapter).items():
        torch.testing.assert_close(merged[target].double() - own[target].double(), d, rtol=1e-5, atol=1e-6)
    formats.get("peft").write(adapter, tmp_path / "back")
    a, b = load_file(src / "adapter_model.safetensors"), load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(peft_logits(model, tmp_path / "back"), peft_logits(model, src))


@pytest.mark.parametrize("arch,lora,first,then", [
    ("phi3", dict(target_modules=["gate_up_proj", "down_proj"]), "split-gateup", "fuse-gateup"),
    ("llama", dict(target_modules=FFN), "fuse-gateup", "split-gateup"),
    ("mixtral", STACKED, "split-gateup", "fuse-gateup"),
])
def test_relayout_is_exact_both_ways(arch, lora, first, then, base, tmp_path):
    """fused <-> separate and stacked <-> per-expert: every projection's delta bit-identical (verify says so);
    back in the original layout, PEFT loads it and computes the same logits, bit for bit."""
    model, _ = base(arch)
    src = peft_adapter(model, tmp_path / "lora", **lora)
    before = tree_digest(src)
    run_cli(first, src, "-o", tmp_path / "one")
    r = run_cli("verify", src, tmp_path / "one", "--json")
    report = json.loads(r.output)
    assert report["passed"] and "bit-identical" in report["checks"][0]["line"]
    extra = ["--stack-experts"] if arch == "mixtral" else []
    run_cli(then, tmp_path / "one", "-o", tmp_path / "two", *extra)
    assert tree_digest(src) == before  # the input is never modified
    one, two = formats.read(tmp_path / "one"), formats.read(tmp_path / "two")
    assert set(one.loras) != set(formats.read(src).loras)
    assert {t: d for t, d in deltas(two).items()}.keys() == formats.read(src).loras.keys()
    for t, d in deltas(formats.read(src)).items():
        assert torch.equal(deltas(two)[t], d), t
    assert torch.equal(peft_logits(model, tmp_path / "two"), peft_logits(model, src))


def test_fusing_gate_and_up_with_different_a_is_a_block_structure():
    """Two LoRAs whose A differ fuse into rank r_gate + r_up, A stacked, B block-diagonal: the same deltas."""
    from ffn_tools.adapters.model import Adapter, AdapterError, Lora

    torch.manual_seed(0)
    names = [f"model.layers.0.mlp.{p}.weight" for p in FFN]
    loras = {n: Lora(n, torch.randn(r, 8 if "down" not in n else 12), torch.randn(12 if "down" not in n else 8, r), 0.5)
             for n, r in zip(names, (2, 3, 2))}
    fused, changes = relayout.fuse(Adapter(Path("x"), "peft", loras))
    gu = fused.loras["model.layers.0.mlp.gate_up_proj.weight"]
    assert gu.rank == 5 and "block structure" in " ".join(changes)
    assert torch.equal(gu.delta(torch.float64)[:12], loras[names[0]].delta(torch.float64))
    assert torch.equal(gu.delta(torch.float64)[12:], loras[names[1]].delta(torch.float64))
    with pytest.raises(AdapterError, match="different scales"):
        relayout.fuse(Adapter(Path("x"), "peft", {**loras, names[1]: Lora(names[1], loras[names[1]].a,
                                                                          loras[names[1]].b, 0.25)}))


@pytest.mark.parametrize("arch,lora,dtype", [("llama", dict(target_modules=[*FFN, "v_proj"]), torch.bfloat16),
                                             ("mixtral", STACKED, torch.float32)])
def test_merge_matches_peft_merge_and_unload(arch, lora, dtype, tmp_path):
    """merge: every merged tensor within one rounding of the base dtype of PEFT's merge_and_unload, every other
    tensor the base's bytes; transformers runs it as PeftModel runs base + adapter; verify proves it. A v5
    stacked-expert adapter lands on the base's per-expert tensors (transformers saves experts one by one)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tiny_models.build(arch, tmp_path / "base", dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    src = peft_adapter(model, tmp_path / "lora", **lora)
    r = run_cli("merge", path, src, "-o", tmp_path / "merged", "--json")
    assert json.loads(r.output)["merged"] > 0
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=dtype).eval().state_dict()
    theirs = PeftModel.from_pretrained(copy.deepcopy(model), src).merge_and_unload().state_dict()
    eps = torch.finfo(dtype).eps
    for n, t in theirs.items():
        diff = (ours[n].double() - t.double()).abs()
        assert bool((diff <= t.double().abs() * eps + 1e-30).all()), n  # one rounding (a unit in the last place)
    base_t, merged_t = load_file(path / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
    untouched = [n for n in base_t if "mlp" not in n and "experts" not in n and "v_proj" not in n]
    assert untouched and all(torch.equal(base_t[n], merged_t[n]) for n in untouched)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=dtype).eval()(TOKENS).logits
    want = peft_logits(model, src)
    assert (got.float() - want.float()).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-5)
    r = json.loads(run_cli("verify", f"{path}+{src}", tmp_path / "merged", "--json").output)
    assert r["passed"] and r["checks"][-1]["not_run"]  # the kernels that did not run, said
    if dtype == torch.bfloat16:  # the adapter live in bf16 on Triton's kernel (its interpreter here)
        r = json.loads(run_cli("verify", f"{path}+{src}", tmp_path / "merged", "--backend", "triton", "--json").output)
        assert r["passed"] and "in the weights dtype on triton" in r["checks"][-1]["line"], r


def _swap_gate_up(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    t = load_file(dst / "adapter_model.safetensors")
    for k in [k for k in t if ".gate_proj." in k]:
        u = k.replace(".gate_proj.", ".up_proj.")
        t[k], t[u] = t[u], t[k]
    save_file(t, dst / "adapter_model.safetensors")
    return dst


def _rslora(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": True}))
    return dst


def _drop_expert(src: Path, dst: Path, expert: int = 3) -> Path:
    shutil.copytree(src, dst)
    t = load_file(dst / "adapter_model.safetensors")
    save_file({k: v for k, v in t.items() if f".experts.{expert}." not in k}, dst / "adapter_model.safetensors")
    return dst


def test_verify_catches_swapped_halves_wrong_scale_and_a_missing_expert(base, tmp_path):
    """verify BASE+ADAPTER MERGED and verify ADAPTER ADAPTER2 fail, naming what is wrong, on an adapter whose gate
    and up are swapped, one scaled alpha/sqrt(r) for alpha/r, and one that lost an expert."""
    model, path = base("llama")
    good = peft_adapter(model, tmp_path / "lora", target_modules=FFN)
    run_cli("merge", path, good, "-o", tmp_path / "merged")
    for bad, names in ((_swap_gate_up(good, tmp_path / "swapped"), ("gate", "up")),
                       (_rslora(good, tmp_path / "rslora"), ("gate", "up", "down"))):
        r = run_cli("verify", f"{path}+{bad}", tmp_path / "merged", "--backend", "reference", "--backend", "triton",
                    ok=None)
        assert r.exit_code == 1 and "FAIL weights" in r.output and "FAIL ffns" in r.output, r.output
        assert "layer 0: live on triton differ from base + adapter live" not in r.output  # the adapter is the same
        assert "layer 0: merged weights differ from base + adapter live" in r.output
        assert all(f"layer 0 {n})" in r.output for n in names), r.output
        r = run_cli("verify", good, bad, ok=None)
        assert r.exit_code == 1 and "layer 1 gate: deltas differ" in r.output, r.output
    moe, moe_path = base("mixtral")
    stacked = peft_adapter(moe, tmp_path / "moe", **STACKED)
    run_cli("split-gateup", stacked, "-o", tmp_path / "per-expert")
    lost = _drop_expert(tmp_path / "per-expert", tmp_path / "lost")
    r = run_cli("verify", stacked, lost, ok=None)
    assert r.exit_code == 1 and "layer 0 expert 3 gate: has factors in A only" in r.output, r.output
    run_cli("merge", moe_path, stacked, "-o", tmp_path / "moe-merged")
    r = run_cli("verify", f"{moe_path}+{lost}", tmp_path / "moe-merged", ok=None)
    assert r.exit_code == 1 and "experts.3.w1.weight (layer 0 expert 3 gate)" in r.output, r.output


def _peft_merge(model, adapter: Path, out: Path) -> Path:
    """PEFT's own merge: merge_and_unload, then transformers' save_pretrained."""
    from peft import PeftModel

    PeftModel.from_pretrained(copy.deepcopy(model), adapter).merge_and_unload().save_pretrained(out)
    return out


def _planted(src: Path, dst: Path, defect: str) -> Path:
    """PEFT's stacked-expert adapter with a delta defect planted, for PEFT to merge as it is: its delta scaled
    (alpha doubled), lora_B's experts laid out as lora_A's (blocks, not interleaved), each expert given the next
    one's factors."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    t = load_file(dst / "adapter_model.safetensors")
    r = cfg["r"]
    for key in [k for k in t if k.endswith("lora_B.weight")]:
        b, a_key = t[key], key.replace("lora_B", "lora_A")
        e = b.shape[1] // r
        if defect == "B in A's layout":  # PEFT reads expert x's rank j at column j·E + x: put column x·r + j there
            t[key] = b[:, [x * r + j for j in range(r) for x in range(e)]].contiguous()
        elif defect == "wrong expert":  # expert x gets expert x+1's A rows and B columns
            t[a_key] = t[a_key].roll(-r, 0).contiguous()
            t[key] = b.reshape(b.shape[0], r, e).roll(-1, 2).reshape(b.shape).contiguous()
    save_file(t, dst / "adapter_model.safetensors")
    if defect == "scaled":
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 2 * cfg["lora_alpha"]}))
    return dst


@pytest.mark.parametrize("arch,lora", [("llama", dict(target_modules=FFN)),
                                       ("phi3", dict(target_modules=["gate_up_proj", "down_proj"])),
                                       ("qwen3_moe", STACKED), ("mixtral", STACKED)])
def test_verify_passes_peft_own_bf16_merge_and_fails_a_wrong_delta(arch, lora, tmp_path):
    """verify BASE+ADAPTER MERGED passes PEFT's own merge (merge_and_unload + save_pretrained) of a bfloat16 base:
    a target_parameters delta PEFT rounds to bfloat16 before adding it (two roundings, as its live forward runs it)
    is no defect. PEFT's merges of the same stacked adapter with its delta scaled, lora_B's experts in lora_A's
    layout, or each expert given the next one's factors all fail, naming the tensors."""
    from transformers import AutoModelForCausalLM

    path = tiny_models.build(arch, tmp_path / "base", dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    src = peft_adapter(model, tmp_path / "lora", **lora)
    r = run_cli("verify", f"{path}+{src}", _peft_merge(model, src, tmp_path / "merged"), "--json", ok=None)
    report = json.loads(r.output)
    assert r.exit_code == 0 and report["passed"], r.output
    weights = next(c for c in report["checks"] if c["check"] == "weights")
    assert ("one of the delta first: PEFT casts a target_parameters delta" in weights["line"]) == (lora is STACKED)
    if lora is not STACKED:
        return
    for defect in ("scaled", "B in A's layout", "wrong expert"):
        bad = _planted(src, tmp_path / defect, defect)
        r = run_cli("verify", f"{path}+{src}", _peft_merge(model, bad, tmp_path / f"merged {defect}"), ok=None)
        assert r.exit_code == 1 and "FAIL weights" in r.output and "FAIL ffns" in r.output, (defect, r.output)
        assert "(layer 0 expert 0 gate): off base + scale·B·A by up to" in r.output, (defect, r.output)


def test_inspect_says_what_each_lora_targets_and_which_ffns_get_none(base, tmp_path):
    model, path = base("qwen2_moe")
    src = peft_adapter(model, tmp_path / "lora", target_modules=["shared_expert.gate_proj", "shared_expert.up_proj"],
                       layers_to_transform=[1])
    r = json.loads(run_cli("inspect", src, "--base", path, "--json").output)
    rows = r["targets"]
    assert {(x["layer"], x["role"], x["kind"]) for x in rows} == {(1, "gate", "shared"), (1, "up", "shared")}
    assert all(x["rank"] == 4 and x["scale"] == 2.0 for x in rows)
    without = r["base"]["without"]
    assert "layer 0 shared expert" in without and "layer 1 expert 0" in without
    assert r["base"]["partial"] == ["layer 1 shared expert (gate/up only)"]
    text = run_cli("inspect", src, "--base", path).output
    assert "layer 1 shared expert: gate r4 x2, up r4 x2" in text and "no factors: layer 0 shared expert" in text
    untrained = peft_adapter(model, tmp_path / "untrained", target_modules=FFN, init_lora_weights=True)  # B = 0
    r = json.loads(run_cli("inspect", untrained, "--base", path, "--json").output)
    assert r["base"]["with_factors"] == 0 and len(r["base"]["without"]) == r["base"]["ffns"] > 0


def test_refusals_say_why_and_write_nothing(base, tmp_path):
    model, path = base("llama")
    dora = peft_adapter(model, tmp_path / "dora", target_modules=FFN, use_dora=True)
    r = run_cli("merge", path, dora, "-o", tmp_path / "out", ok=False)
    assert "DoRA" in r.output and not (tmp_path / "out").exists()
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(**{**tiny_models.COMMON, "intermediate_size": 128}))
    wrong = peft_adapter(other, tmp_path / "other-lora", target_modules=FFN)
    r = run_cli("merge", path, wrong, "-o", tmp_path / "out", ok=False)
    assert "do not fit the base" in r.output and not (tmp_path / "out").exists()
    good = peft_adapter(model, tmp_path / "lora", target_modules=FFN)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    r = run_cli("merge", path, good, "-o", tmp_path / "taken", ok=False)
    assert "already exists" in r.output and "--force" in r.output
    r = run_cli("convert", good, "--to", "mlx", "-o", tmp_path / "mlx", ok=False)
    assert "--base" in r.output
    r = run_cli("convert", good, "--to", "mlx", "--base", path, "-q", "-o", tmp_path / "mlx", ok=False)
    assert "--quantize do not apply to convert of a LoRA adapter" in r.output and not (tmp_path / "mlx").exists()
    r = run_cli("verify", f"{path}+{good}", tmp_path / "taken", "--logits", ok=False)
    assert "--logits do not apply to verifying LoRA adapters" in r.output


def test_merge_refuses_a_quantized_base(base, tmp_path):
    """Merging into FP8 codes would re-quantize every weight of each tensor: refused, saying so."""
    from test_fp8 import quantize_fp8

    model, path = base("llama")
    fp8 = quantize_fp8(path, tmp_path / "fp8")
    good = peft_adapter(model, tmp_path / "lora", target_modules=FFN)
    r = run_cli("merge", fp8, good, "-o", tmp_path / "out", ok=False)
    assert "quantized base" in r.output and not (tmp_path / "out").exists()


def test_mlx_adapter_runs_in_mlx_lm_as_peft_runs_the_original(tmp_path, base):
    """--to mlx: mlx_lm's load_adapters accepts it on mlx_lm's model of the base, whose logits equal PeftModel's
    on the original adapter; read back, every delta is the original's, bit for bit (dense and SwitchGLU experts)."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    for arch, lora in (("llama", dict(target_modules=[*FFN, "q_proj"], layers_to_transform=[1])),
                       ("qwen3_moe", STACKED)):
        model, path = base(arch)
        src = peft_adapter(model, tmp_path / f"{arch}-lora", **lora)
        run_cli("convert", src, "--to", "mlx", "--base", path, "-o", tmp_path / f"{arch}-mlx-lora")
        run_cli("convert", path, "--to", "mlx", "-o", tmp_path / f"{arch}-mlx")
        cfg = json.loads((tmp_path / f"{arch}-mlx-lora" / "adapter_config.json").read_text())
        assert cfg["num_layers"] == (1 if arch == "llama" else 2) and cfg["lora_parameters"]["scale"] == 2.0
        mlx_model, _ = load_model(tmp_path / f"{arch}-mlx")
        load_adapters(mlx_model, str(tmp_path / f"{arch}-mlx-lora"))
        got = torch.tensor(np.array(mlx_model(mx.array(TOKENS.numpy())).astype(mx.float32)))
        want = peft_logits(model, src)
        assert (got - want).abs().max() < 1e-5, arch
        assert (want - tiny_models.logits(path, arch)).abs().max() > 0.1  # the adapter does something
        back = formats.read(tmp_path / f"{arch}-mlx-lora", json.loads((path / "config.json").read_text()))
        ours = formats.read(src, model.config.to_dict())
        assert json.loads(run_cli("verify", src, tmp_path / f"{arch}-mlx-lora", "--json").output)["passed"]
        assert len(back.loras) >= len(ours.loras)
        if arch == "llama":  # and back to PEFT: PeftModel runs it as the original
            run_cli("convert", tmp_path / f"{arch}-mlx-lora", "--to", "torch", "-o", tmp_path / f"{arch}-peft-again")
            torch.testing.assert_close(peft_logits(model, tmp_path / f"{arch}-peft-again"), want, rtol=0, atol=1e-6)


def test_a_peft_adapter_finds_its_base_in_the_working_directory_as_peft_does(tmp_path, monkeypatch):
    """PEFT records base_model_name_or_path as the base was loaded ("tiny", from the working directory) and
    AutoPeftModel loads it from there again: --to mlx finds the base there too. Where it is not found, the refusal
    says what is missing, the paths tried and how to give it, and writes nothing."""
    pytest.importorskip("mlx.core")
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    tiny_models.build("llama", Path("tiny"))
    src = peft_adapter(AutoModelForCausalLM.from_pretrained("tiny"), Path("lora"), target_modules=FFN)
    assert json.loads((src / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
    AutoPeftModelForCausalLM.from_pretrained("lora")  # PEFT itself reloads the base from the working directory
    run_cli("convert", "lora", "--to", "mlx", "-o", "mlx-lora")
    assert json.loads(Path("mlx-lora/adapter_config.json").read_text())["model"] == str(tmp_path / "tiny")
    assert json.loads(run_cli("verify", "lora", "mlx-lora", "--json").output)["passed"]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = run_cli("convert", "../lora", "--to", "mlx", "-o", "out", ok=False)
    assert (f"Error: ../lora: converting to mlx needs the base model's config.json (mlx adapters name the base's "
            f"tensors as their runtime does), and its base_model_name_or_path 'tiny' is no directory here (tried "
            f"{tmp_path / 'elsewhere' / 'tiny'} and {tmp_path / 'lora' / 'tiny'}): give the base model's directory "
            "with --base") in r.output, r.output
    assert not Path("out").exists()


def test_the_library_functions_take_adapters_as_the_commands_do(base, tmp_path):
    import ffn_tools

    model, path = base("phi3")
    src = peft_adapter(model, tmp_path / "lora", target_modules=["gate_up_proj", "down_proj"])
    assert ffn_tools.inspect(src)["format"] == "peft"
    r = ffn_tools.split_gateup(src, tmp_path / "split")
    assert any("split into gate and up" in c for c in r["changes"])
    assert ffn_tools.merge(path, tmp_path / "split", tmp_path / "merged")["merged"] == 4  # the split LoRA, re-fused
    assert ffn_tools.verify(f"{path}+{src}", tmp_path / "merged").passed
    assert ffn_tools.verify(src, tmp_path / "split").passed
    with pytest.raises(ffn_tools.FFNToolsError, match="max_shard_size= do not apply"):
        ffn_tools.split_gateup(src, tmp_path / "x", max_shard_size=1000)
    with pytest.raises(ffn_tools.FFNToolsError, match="logits= do not apply"):
        ffn_tools.verify(src, tmp_path / "split", logits=True)


def test_a_gguf_says_whether_it_is_an_adapter_from_its_first_keys(gguf_model, tmp_path):
    """Every GGUF a command opens is asked whether it is a LoRA: the answer is general.type as gguf-py reads it
    (through header.Reader, which tests/test_gguf.py holds to gguf-py's GGUFReader field by field and is 20x faster
    on these vocabularies), from a walk of the header that skips arrays instead of parsing them (a Llama-3
    vocabulary: 0.05 s, not 7.6 s)."""
    import sys

    from ffn_tools.converters.gguf.header import Reader as GGUFReader
    from ffn_tools.converters.gguf.header import string_field

    files = [*sorted((Path(sys.prefix) / "llama.cpp" / "models").glob("ggml-vocab-*.gguf"))[:6]]
    from transformers import AutoModelForCausalLM

    base = gguf_model("llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    src = peft_adapter(model, tmp_path / "lora", target_modules=FFN)
    run_cli("convert", src, "--to", "gguf", "--base", base, "-o", tmp_path / "lora.gguf")
    files.append(tmp_path / "lora.gguf")
    for f in files:
        reader = GGUFReader(f)
        for key in ("general.type", "general.architecture", "tokenizer.ggml.model"):
            field = reader.get_field(key)
            assert string_field(f, key) == (None if field is None else bytes(field.parts[-1]).decode()), (f, key)
    assert string_field(tmp_path / "lora.gguf", "general.type") == "adapter"
    assert formats.is_adapter(tmp_path / "lora.gguf") and not formats.is_adapter(files[0])
    assert string_field(base / "config.json", "general.type") is None


def _llama_cpp_logits(model: Path, ids: list[int], lora: Path | None = None) -> np.ndarray:
    """llama.cpp's logits of ``ids``, float32 KV cache; ``lora``: applied with lora_path (llama-cpp-python 0.3.36
    does not raise on an adapter that fails to load, it crashes later: asserted loaded first)."""
    import llama_cpp

    kw = {"lora_path": str(lora)} if lora else {}
    llm = llama_cpp.Llama(model_path=str(model), logits_all=True, n_ctx=64, n_batch=64, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, **kw)
    assert not lora or llm._lora_adapter, f"llama.cpp did not load {lora}"
    llm.eval(ids)
    out = np.array(llm.scores[:len(ids)], dtype=np.float64)
    llm.close()
    return out


def _convert_lora_reference(base: Path, adapter: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's own convert_lora_to_gguf.py on ``adapter``, run by the converter server (``gguf_models``: a fork of
    the process that imported its modules once, the script run as ``__main__``)."""
    import gguf_models

    log = out.with_name(out.name + ".log")
    script = gguf_models.require_llama_cpp() / "convert_lora_to_gguf.py"
    code = gguf_models._server().convert(["--base", str(base), "--outtype", outtype, "--outfile", str(out),
                                          str(adapter)], log, script)
    assert code == 0, log.read_text()[-2000:]
    log.unlink()
    return out


IDS = [1, 17, 42, 99, 150, 200, 260, 300, 333, 5]


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_gguf_lora_is_llama_cpps_own_bytes_and_runs_in_llama_cpp(gguf_model, gguf_ref, outtype, tmp_path):
    """--to gguf on a PEFT adapter: the bytes convert_lora_to_gguf.py writes; llama.cpp with lora_path computes
    PeftModel's logits; read back, the deltas are the adapter's (bit for bit in f32)."""
    from transformers import AutoModelForCausalLM

    base = gguf_model("llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    src = peft_adapter(model, tmp_path / "lora", target_modules=[*FFN, "q_proj", "k_proj"])
    run_cli("convert", src, "--to", "gguf", "--base", base, "--outtype", outtype, "-o", tmp_path / "ours.gguf")
    ref = _convert_lora_reference(base, src, tmp_path / "ref.gguf", outtype)
    assert (tmp_path / "ours.gguf").read_bytes() == ref.read_bytes()
    if outtype != "f32":
        return
    from peft import PeftModel

    with torch.no_grad():
        want = PeftModel.from_pretrained(model, src).eval()(torch.tensor([IDS])).logits[0].double().numpy()
    got = _llama_cpp_logits(gguf_ref("llama", "f32"), IDS, tmp_path / "ours.gguf")
    assert np.abs(got - want).max() < 1e-4
    back = formats.read(tmp_path / "ours.gguf", json.loads((base / "config.json").read_text()))
    for t, d in deltas(formats.read(src)).items():
        assert torch.equal(deltas(back)[t], d), t
    r = json.loads(run_cli("verify", src, tmp_path / "ours.gguf", "--json").output)
    assert r["passed"] and "bit-identical" in r["checks"][0]["line"]
    # mlx_lm's adapter to llama.cpp: the same function again
    run_cli("convert", src, "--to", "mlx", "--base", base, "-o", tmp_path / "mlx")
    run_cli("convert", tmp_path / "mlx", "--to", "gguf", "--base", base, "-o", tmp_path / "from-mlx.gguf")
    assert np.abs(_llama_cpp_logits(gguf_ref("llama", "f32"), IDS, tmp_path / "from-mlx.gguf") - want).max() < 1e-4


def test_gguf_lora_of_stacked_experts_and_rslora_run_as_peft_runs_them(gguf_model, gguf_ref, tmp_path):
    """What llama.cpp's converter refuses (v5 stacked experts through target_parameters) or writes with the wrong
    scale without a word (rsLoRA: llama.cpp divides alpha by r, not sqrt(r)): ffn-tools writes, through that same
    converter, a file llama.cpp runs as PeftModel runs the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for arch, lora in (("qwen3_moe", STACKED), ("llama", dict(target_modules=FFN, use_rslora=True, r=8))):
        base = gguf_model(arch)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        src = peft_adapter(model, tmp_path / f"{arch}-lora", **lora)
        run_cli("convert", src, "--to", "gguf", "--base", base, "-o", tmp_path / f"{arch}.gguf")
        with torch.no_grad():
            want = PeftModel.from_pretrained(model, src).eval()(torch.tensor([IDS])).logits[0].double().numpy()
        got = _llama_cpp_logits(gguf_ref(arch, "f32"), IDS, tmp_path / f"{arch}.gguf")
        plain = _llama_cpp_logits(gguf_ref(arch, "f32"), IDS)
        assert np.abs(got - want).max() < 1e-4 < np.abs(plain - want).max(), arch


def test_merge_takes_pytorch_weights_as_stored_and_convert_only_the_target_formats_options(base, tmp_path):
    """merge refuses a base that is not Hugging Face PyTorch weights as stored (the checkpoint's declared
    ``rewritable``, not its format's name), naming what it is; an adapter conversion takes only the options its
    target format declares (``AdapterFormat.options``: GGUF's outtype), refused by name for any other."""
    from ffn_tools.adapters import api as adapters
    from ffn_tools.adapters.model import AdapterError
    from ffn_tools.converters import convert

    model, path = base("llama")
    good = peft_adapter(model, tmp_path / "lora", target_modules=FFN)
    convert(path, "flax", tmp_path / "flax")
    with pytest.raises(AdapterError, match="this is a Flax checkpoint: convert it to torch first"):
        adapters.merge(tmp_path / "flax", good, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert formats.get("gguf").options == {"outtype"} and formats.get("peft").options == frozenset()
    for to in ("torch", "mlx"):
        with pytest.raises(AdapterError, match=f"outtype do not apply to converting an adapter to {to}"):
            adapters.convert(good, to, tmp_path / to, base=path, outtype="q8_0")
        assert not (tmp_path / to).exists()
    assert adapters.convert(good, "torch", tmp_path / "peft")["format"] == "peft"
