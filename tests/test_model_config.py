"""verify compares the model, not only its tensors: configs as their clients read them, B's dtype against its
weights, tied heads, a client that refuses B, and logits exact where the same client runs the same bits.

Each defect is planted in a copy of a tiny real checkpoint (transformers' ``save_pretrained``; MLX exports
by ``convert --to mlx``) and must fail with exit 1 naming the key; each correct conversion must pass.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import plant, run_cli
from safetensors.torch import load_file

from ffn_tools.checks.config import differences, transformers_view

REF = ("--backend", "reference", "--tokens", "4")


def verify_json(a, b, *extra):
    r = run_cli("verify", a, b, *REF, "--json", *extra, ok=None)
    return r.exit_code, json.loads(r.stdout)


def set_key(path: str, value):
    """A config edit setting the dotted key ``path``."""
    def edit(cfg):
        *head, last = path.split(".")
        node = cfg
        for k in head:
            node = node.setdefault(k, {})
        if value is DROP:
            node.pop(last, None)
        else:
            node[last] = value
    return edit


DROP = object()

CASES = {  # name -> (arch, config edit, the key the failure names)
    "rope_theta x50": ("llama", set_key("rope_parameters.rope_theta", 500000.0), "rope_parameters.rope_theta"),
    "rms_norm_eps": ("llama", set_key("rms_norm_eps", 1e-5), "rms_norm_eps"),
    "heads re-split": ("llama", lambda c: c.update(num_attention_heads=8, num_key_value_heads=4, head_dim=8),
                       "head_dim"),
    "sliding_window dropped": ("mistral", set_key("sliding_window", None), "sliding_window"),
    "norm_topk_prob flipped": ("qwen3_moe", lambda c: c.update(norm_topk_prob=not c.get("norm_topk_prob", False)),
                               "norm_topk_prob"),
    "tie flipped": ("llama", set_key("tie_word_embeddings", True), "tie_word_embeddings"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_defects_fail_naming_the_key(model_dir, tmp_path, case):
    arch, edit, key = CASES[case]
    a = model_dir(arch)
    b = plant(a, tmp_path / "b", config=edit)
    code, rep = verify_json(a, b)
    assert code == 1, rep["verdict"]
    assert rep["config"]["passed"] is False
    assert any(f.startswith(f"config: {key}: A ") for f in rep["failures"]), rep["failures"]
    assert rep["ffns"] and all(f["exact"] == "identical" for f in rep["ffns"])  # the weights are the same bits
    allow = [x for p in rep["config"]["problems"] for x in ("--allow-config", p.split(":")[0])]
    code, rep = verify_json(a, b, *allow, "--no-load-check")
    assert code == 0, rep["failures"]
    assert rep["config"]["allowed"]


def test_rope_scaling_dropped_fails(model_dir, tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    a = plant(model_dir("llama"), tmp_path / "a", config=set_key("rope_parameters", rope))
    b = plant(a, tmp_path / "b", config=set_key("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0}))
    code, rep = verify_json(a, b)
    assert code == 1
    assert any("rope_parameters.rope_type: A 'llama3', B 'default'" in f for f in rep["failures"]), rep["failures"]


def test_gemma2_softcapping_dropped_fails(tmp_path):
    import transformers

    cfg = transformers.Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(cfg).save_pretrained(tmp_path / "a")
    b = plant(tmp_path / "a", tmp_path / "b", config=set_key("final_logit_softcapping", None))
    code, rep = verify_json(tmp_path / "a", b)
    assert code == 1
    assert any(f.startswith("config: final_logit_softcapping: A 30.0, B None") for f in rep["failures"])


def test_config_dtype_narrower_than_the_weights_fails_and_a_cast_passes(model_dir, tmp_path):
    a = model_dir("llama")
    b = plant(a, tmp_path / "b", config=set_key("dtype", "bfloat16"))
    code, rep = verify_json(a, b)
    assert code == 1
    assert any("dtype: B's config.json says bfloat16, but its weights are stored in float32" in f
               for f in rep["failures"]), rep["failures"]
    run_cli("convert", a, "--to", "torch", "-o", tmp_path / "bf16", "--dtype", "bfloat16")
    code, rep = verify_json(a, tmp_path / "bf16")
    assert code == 0, rep["failures"]


def test_config_missing_in_b_fails(model_dir, tmp_path):
    b = plant(model_dir("llama"), tmp_path / "b")
    (b / "config.json").unlink()
    code, rep = verify_json(model_dir("llama"), b)
    assert code == 1
    assert any("B has none naming a model_type" in f for f in rep["failures"])


def test_a_config_the_client_refuses_fails_and_logits_say_why_not(model_dir, tmp_path):
    a = model_dir("llama")
    b = plant(a, tmp_path / "b", config=set_key("num_attention_heads", 5))
    code, rep = verify_json(a, b, "--logits")
    assert code == 1
    assert any("refuses it" in f and "attention heads (5)" in f for f in rep["failures"]), rep["failures"]
    assert rep["load_check"]["refused"] and rep["logits"] is None
    assert any(n.startswith("logits not run (B's client cannot build B") for n in rep["not_run"])


def test_logits_are_exact_for_the_same_client_on_the_same_bits(model_dir, tmp_path):
    a = model_dir("llama")
    b = plant(a, tmp_path / "b", config=set_key("rope_parameters.rope_theta", 500000.0))
    code, rep = verify_json(a, b, "--logits", "--allow-config", "rope_parameters")
    assert code == 1  # only the logits can fail: the config difference is allowed
    assert rep["logits"]["tolerance"]["row"].startswith("exact")
    assert rep["failures"] == [f for f in rep["failures"] if f.startswith("logits: the same client on bit-identical")]
    code, rep = verify_json(a, plant(a, tmp_path / "same"), "--logits")
    assert code == 0 and rep["logits"]["max_abs"] == 0.0


def test_every_report_says_what_did_not_run(model_dir):
    a = model_dir("llama")
    r = run_cli("verify", a, a, *REF)
    verdict = r.stdout.strip().splitlines()[-1]
    assert verdict.startswith("PASS") and "logits not run (--logits runs both whole models" in verdict


def test_v4_and_v5_spellings_read_the_same():
    v4, _ = transformers_view({"model_type": "llama", "rope_theta": 500000.0, "torch_dtype": "bfloat16"})
    v5, _ = transformers_view({"model_type": "llama", "rope_parameters": {"rope_type": "default",
                                                                           "rope_theta": 500000.0},
                               "dtype": "bfloat16"})
    assert differences(v4, v5) == []
    diff = differences({"a": {"b": 1}}, {"a": {"b": 2}, "c": True})
    assert [(k, va, vb) for k, va, vb in diff if k == "a.b"] == [("a.b", 1, 2)]
    assert [k for k, *_ in diff] == ["a.b", "c"] and repr(diff[1][1]) == "<absent>"
    assert differences({"x": 1}, {"x": True}) == [("x", 1, True)]  # a bool is not a number in a config


def _gemma(tmp_path):
    import transformers

    cfg = transformers.GemmaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    transformers.GemmaForCausalLM(cfg).save_pretrained(tmp_path / "a")  # tied: no lm_head.weight written
    return tmp_path / "a"


def test_a_tied_head_written_out_passes_and_a_different_one_fails(tmp_path):
    a = _gemma(tmp_path)
    assert "lm_head.weight" not in load_file(a / "model.safetensors")

    def head(value):
        def edit(sd):
            sd["lm_head.weight"] = value(sd["model.embed_tokens.weight"]).clone()
        return edit

    b = plant(a, tmp_path / "b", edit=head(lambda e: e))
    code, rep = verify_json(a, b)
    assert code == 0, rep["failures"]
    assert any("B stores lm_head.weight, bit-identical to its model.embed_tokens.weight" in n for n in rep["notes"])
    code, rep = verify_json(b, a)  # saved twice as A, once as B
    assert code == 0, rep["failures"]
    c = plant(a, tmp_path / "c", edit=head(lambda e: e * 2))
    code, rep = verify_json(a, c)
    assert code == 1
    assert any("lm_head.weight: B stores one that differs from its embedding" in f for f in rep["failures"])


mlx = pytest.importorskip("mlx.core")


def test_mlx_config_as_mlx_lm_reads_it(hf, tmp_path):
    a = hf("llama")
    m = tmp_path / "mlx"
    run_cli("convert", a, "--to", "mlx", "-o", m)
    code, rep = verify_json(a, m)
    assert code == 0, rep["failures"]
    assert any(r.startswith("mlx_lm's llama ModelArgs") for r in rep["config"]["readers"])
    for key, value in (("rope_theta", 500000.0), ("tie_word_embeddings", True)):
        b = tmp_path / key
        shutil.copytree(m, b)
        cfg = json.loads((b / "config.json").read_text())
        cfg[key] = value
        (b / "config.json").write_text(json.dumps(cfg))
        code, rep = verify_json(a, b)
        assert code == 1, key
        assert any(f.startswith(f"config: {key}: A ") for f in rep["failures"]), rep["failures"]
