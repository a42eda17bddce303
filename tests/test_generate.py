"""``verify --generate``: both models run on prompts by their own clients, token by token, against a noise floor
measured in the same run (``verification.generate``, ``checks.agreement``).

A tiny bf16 Llama with a real sentencepiece tokenizer and a chat template (``chatty``) is A. Correct conversions
(MLX bf16, 4-bit MLX, GGUF q8_0) must pass within their floors; six planted model-level defects must fail, each
named by the statistic that caught it. The floors are real: the MLX and GGUF ones are A re-derived in B's form
and run by B's client (non-zero: mlx_lm and llama.cpp compute otherwise than transformers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ffn_tools import api
from ffn_tools.checks.agreement import PROFILES, judge
from ffn_tools.checks.prompts import PROMPTS, load_prompts
from ffn_tools.errors import FFNToolsError
from helpers import run_cli

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def chatty(gguf_model, tmp_path_factory) -> Path:
    """A tiny bf16 Llama with a real tokenizer and a chat template."""
    a = tmp_path_factory.mktemp("gen") / "a"
    shutil.copytree(gguf_model("llama", torch.bfloat16), a)
    cfg = json.loads((a / "tokenizer_config.json").read_text())
    (a / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return a


def _copy(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit:
        for f in dst.glob("*.safetensors"):
            sd = load_file(f)
            edit(sd)
            save_file(sd, f, metadata={"format": "pt" if not (dst / "config.json").exists() or "mlx" not in f.name
                                       else "mlx"})
    return dst


def _json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _gen(report) -> dict:
    g = report.as_dict()["generation"]
    assert g is not None and not g["skipped"], report.lines()
    return g


def _failed(g: dict) -> set[str]:
    return {j["statistic"] for j in g["judged"] if not j["passed"]}


@pytest.mark.parametrize("to,options,floor", [
    ("mlx", {}, "(mlx, dtype bfloat16)"),
    ("mlx", {"quantize": True}, "(mlx, q_bits 4, q_group_size 64, q_mode affine)"),
    ("gguf", {"outtype": "q8_0"}, "(gguf, outtype q8_0)"),
    ("flax", {"dtype": "float32"}, "(flax, dtype float32)"),
])
def test_correct_conversions_are_within_their_measured_floor(chatty, tmp_path, to, options, floor):
    b = tmp_path / ("b.gguf" if to == "gguf" else "b")
    api.convert(chatty, to, b, **options)
    report = api.verify(chatty, b, generate=True, new_tokens=8)
    g = _gen(report)
    assert report.passed, "\n".join(report.lines())
    s, f = g["statistics"], g["floor_statistics"]
    if options.get("quantize"):  # 4 bits move a tiny random model far; within its floor only because the floor is
        assert s["kl_ab_mean"] > 1e-4 and s["top1_disagreement"] > 0.05  # the same quantization re-derived
        assert abs(s["kl_ab_mean"] - f["kl_ab_mean"]) <= 1e-3 * f["kl_ab_mean"]
    client = {"gguf": "llama.cpp", "mlx": "mlx_lm", "flax": "transformers (Flax weights)"}[to]
    assert floor in g["floor"] and g["floor_client"] == client
    # the floor is measured, not zero: another client, or another dtype, computes otherwise than A's bf16
    assert 0 < g["floor_statistics"]["kl_ab_mean"] and g["statistics"]["kl_ab_mean"] > 0
    assert g["prompts"] and len(g["prompts"]) == len(PROMPTS) and g["positions"] > 100
    assert all(p["tokens_same"] and p["stops_same"] for p in g["prompts"])
    assert "within the floor" in report.generation.line() and "generation within its noise floor" in report.verdict
    d = g["direct"]  # B and A' hold the same bytes in the same client: the same logits, no noise to measure
    assert d["passed"] and not any(d["statistics"].values()) and "bit-identical logits" in d["noise_words"], d


# --- six planted model-level defects, each failing with the statistic that caught it ---

def test_swapped_tokens_fail_as_prompt_tokens(chatty, tmp_path):
    b = _copy(chatty, tmp_path / "b")
    tok = json.loads((b / "tokenizer.json").read_text())
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(chatty)(PROMPTS[0])["input_ids"]
    vocab = tok["model"]["vocab"]
    by_id = {v: k for k, v in vocab.items()}
    x, y = by_id[ids[2]], by_id[ids[3]]  # two pieces of the first prompt, their ids exchanged
    vocab[x], vocab[y] = vocab[y], vocab[x]
    (b / "tokenizer.json").write_text(json.dumps(tok))
    (b / "tokenizer.model").unlink()  # the fast tokenizer is what transformers loads; no stale twin beside it
    report = api.verify(chatty, b, generate=True)
    g = _gen(report)
    assert not report.passed and "prompts_tokenized_otherwise" in _failed(g)
    assert any("prompts tokenized otherwise" in f and "in A" in f for f in report.failures())


def test_chat_template_removed_fails_as_prompt_tokens(chatty, tmp_path):
    b = tmp_path / "b"
    api.convert(chatty, "mlx", b)
    _json(b / "tokenizer_config.json", lambda c: c.pop("chat_template", None))
    for f in b.glob("chat_template.jinja"):
        f.unlink()
    report = api.verify(chatty, b, generate=True)
    g = _gen(report)
    assert _failed(g) >= {"prompts_tokenized_otherwise"}
    assert any("A applies a chat template, B has none" in f for f in report.failures())


def test_a_swapped_ffn_is_named_before_the_generation_statistics(chatty, tmp_path):
    """Causes first, symptoms after: layer 1's gate and up swapped fail the FFN check and, end to end, eight
    statistics over A run again (a zero floor); the failures and the verdict name the swap first, and a
    statistic over a zero floor reads as a sentence."""
    def swap(sd):
        g, u = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
        sd[g], sd[u] = sd[u], sd[g]

    b = _copy(chatty, tmp_path / "b", swap)
    report = api.verify(chatty, b, generate=True, new_tokens=4)
    failures = report.failures()
    assert failures[0].startswith("layer 1: not bit-identical") and "gate and up are swapped" in failures[0]
    generation = [i for i, f in enumerate(failures) if f.startswith("generation: ")]
    assert generation and generation[0] > max(i for i, f in enumerate(failures) if not f.startswith("generation: "))
    assert report.verdict.startswith("FAIL: 1 of 2 FFNs differ, generation differs; first: layer 1: not bit-identical")
    text = "\n".join(report.lines())
    assert "the floor the floor" not in text and "zero floor" not in text
    assert ("generation: KL(A||B) mean " in text and " is above the floor of 0; standard allows 1e-07; worst prompt"
            in text)
    assert "verdict: 8 failures: KL(A||B) mean " in text


def test_a_defect_below_the_cross_client_floor_fails_against_a_prime(chatty, tmp_path):
    """4-bit MLX with the final norm scaled by 1.01: against A (transformers) the statistics are within the floor
    (mlx_lm's 4-bit A' is as far from A), but B and A' run in one client on one form, which computes alike to its
    run-to-run noise (0): B against A' fails."""
    b = tmp_path / "b"
    api.convert(chatty, "mlx", b, quantize=True)
    for f in b.glob("*.safetensors"):
        sd = load_file(f)
        sd["model.norm.weight"] = (sd["model.norm.weight"].float() * 1.01).to(sd["model.norm.weight"].dtype)
        save_file(sd, f, metadata={"format": "mlx"})
    report = api.verify(chatty, b, generate=True, new_tokens=8)
    g = _gen(report)
    assert _failed(g) == set(), g["judged"]  # the floor between transformers and mlx_lm hides it
    d = g["direct"]
    assert d["client"] == "mlx_lm" and not d["passed"] and d["statistics"]["kl_ab_mean"] > 1e-7
    assert d["noise"]["kl_ab_mean"] == 0 and d["noise_words"] == "0: B run again by mlx_lm gives the same logits"
    first = next(f for f in report.failures() if f.startswith("generation: "))
    assert first.startswith("generation: B against A' (A in B's form, both run by mlx_lm): KL(A'||B) mean ")
    assert "above the client's run-to-run noise (0: B run again by mlx_lm gives the same logits" in first
    assert not g["passed"] and "B against A' (both run by mlx_lm)" in report.generation.line()


def _stopping(chatty, tmp_path) -> tuple[Path, int, list[int]]:
    """A copy of ``chatty`` whose stop id is a token its greedy decoding of the first prompt reaches (not one of
    the prompt's), with that continuation."""
    from ffn_tools.converters.pytorch.client import Transformers

    a = _copy(chatty, tmp_path / "a")
    seq = Transformers().generate(a, [PROMPTS[0]], 8).sequences[0]
    stop = next(t for t in seq[-6:] if t not in seq[:-6])  # a token A generates, not in its prompt
    _json(a / "generation_config.json", lambda c: c.update(eos_token_id=stop))
    _json(a / "config.json", lambda c: c.update(eos_token_id=stop))
    return a, stop, seq


def test_a_weight_defect_at_the_stop_token_is_no_stop_difference(chatty, tmp_path):
    """B's stop ids are A's, but its lm_head row of A's stop token is negated: B predicts another token where A
    stops. That is the statistics' (top-1, KL), not "prompts that stop otherwise", which judges stop ids; a stop
    id of B's that A generates and goes on after is one."""
    a, stop, seq = _stopping(chatty, tmp_path)

    def negate(sd):
        sd["lm_head.weight"][stop] = -sd["lm_head.weight"][stop]

    b = _copy(a, tmp_path / "b", negate)
    report = api.verify(a, b, generate=True, new_tokens=8)
    g = _gen(report)
    assert {"top1_disagreement", "kl_ab_max"} <= _failed(g) and "prompts_stopping_otherwise" not in _failed(g)
    assert all(p["stops_same"] for p in g["prompts"]) and any(p["stop_a"] is not None for p in g["prompts"])
    assert not any("stop otherwise" in f for f in report.failures())
    c = _copy(a, tmp_path / "c")
    mid = seq[len(seq) - 8]  # A's first new token: before its stop token (not among the first two), it goes on
    _json(c / "generation_config.json", lambda x: x.update(eos_token_id=[stop, mid]))
    report = api.verify(a, c, generate=True, new_tokens=8)
    g = _gen(report)
    assert _failed(g) == {"prompts_stopping_otherwise"}, _failed(g)
    first = next(p for p in g["prompts"] if not p["stops_same"])
    assert f"(id {mid})" in first["why_stops"] and "it is a stop id of B's, so B would stop there" in first["why_stops"]


def test_missing_eos_in_generation_config_fails_as_stops(chatty, tmp_path):
    """A stops at a token its greedy decoding reaches (its generation_config says so); B's generation_config
    has no eos_token_id: transformers runs B past it."""
    from ffn_tools.converters.pytorch.client import Transformers

    a = _copy(chatty, tmp_path / "a")
    seq = Transformers().generate(a, [PROMPTS[0]], 8).sequences[0]
    stop = next(t for t in seq[-6:] if t not in seq[:-6])  # a token A generates, not in its prompt
    _json(a / "generation_config.json", lambda c: c.update(eos_token_id=stop))
    _json(a / "config.json", lambda c: c.update(eos_token_id=stop))
    b = _copy(a, tmp_path / "b")
    _json(b / "generation_config.json", lambda c: c.pop("eos_token_id"))
    _json(b / "config.json", lambda c: c.pop("eos_token_id"))
    report = api.verify(a, b, generate=True, allow_config=["eos_token_id"])
    g = _gen(report)
    assert _failed(g) == {"prompts_stopping_otherwise"}, _failed(g)
    first = next(p for p in g["prompts"] if not p["stops_same"])
    assert "A stops at new token" in first["why_stops"] and "it is not a stop id of B's, so B does not stop at it" in \
        first["why_stops"]


def test_dropped_rope_scaling_fails_as_kl(chatty, tmp_path):
    a = _copy(chatty, tmp_path / "a")
    _json(a / "config.json", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 4.0},
                                                  rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                                   "rope_theta": c.get("rope_theta", 10000.0)}))
    b = _copy(a, tmp_path / "b")
    _json(b / "config.json", lambda c: (c.pop("rope_scaling"), c.update(
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_parameters"]["rope_theta"]})))
    report = api.verify(a, b, generate=True, allow_config=["rope_parameters", "rope_scaling"])
    g = _gen(report)
    assert {"kl_ab_mean", "kl_ab_max"} <= _failed(g), g["statistics"]
    assert g["floor_statistics"]["kl_ab_max"] == 0  # A run again by transformers: deterministic


def test_norm_plus_one_fails_as_kl(chatty, tmp_path):
    b = tmp_path / "b"
    api.convert(chatty, "mlx", b)

    def shift(sd):
        sd["model.norm.weight"] = sd["model.norm.weight"] + 1

    for f in b.glob("*.safetensors"):
        sd = load_file(f)
        shift(sd)
        save_file(sd, f, metadata={"format": "mlx"})
    report = api.verify(chatty, b, generate=True)
    g = _gen(report)
    assert {"kl_ab_mean", "kl_ab_max", "kl_ba_mean"} <= _failed(g)


def test_zeroed_shared_expert_fails_as_kl(gguf_model, chatty, tmp_path):
    import transformers

    import tiny_models

    a = tmp_path / "a"
    _, _, extra = tiny_models.ARCHS["qwen2_moe"]
    vocab = json.loads((chatty / "config.json").read_text())["vocab_size"]
    config = transformers.Qwen2MoeConfig(**{**tiny_models.COMMON, **extra, "vocab_size": vocab})
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(a)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (chatty / f).exists():
            shutil.copy(chatty / f, a / f)

    def zero(sd):
        for k in sd:
            if ".shared_expert." in k:
                sd[k] = torch.zeros_like(sd[k])

    b = _copy(a, tmp_path / "b", zero)
    report = api.verify(a, b, generate=True)
    g = _gen(report)
    assert {"kl_ab_mean", "kl_ab_max"} <= _failed(g), g["statistics"]


# --- the parts ---

def test_profiles_hold_a_statistic_against_its_floor():
    assert judge(2e-4, 1e-4, "kl", PROFILES["standard"], 100)[1]
    assert not judge(2.1e-4, 1e-4, "kl", PROFILES["standard"], 100)[1]
    assert judge(1e-7, 0.0, "kl", PROFILES["standard"], 100)[1] and not judge(1e-7, 0.0, "kl", PROFILES["strict"], 100)[1]
    assert not judge(1.0001e-4, 1e-4, "kl", PROFILES["strict"], 100)[1]
    assert judge(4.9e-4, 1e-4, "kl", PROFILES["relaxed"], 100)[1]
    assert judge(0.01, 0.0, "rate", PROFILES["standard"], 100)[1]  # one position of 100 over a zero floor
    assert not judge(0.02, 0.0, "rate", PROFILES["standard"], 100)[1]
    assert not judge(1, 0, "count", PROFILES["relaxed"], 100)[1]  # counts: never above the floor's


def test_prompts_file_forms(tmp_path):
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    (tmp_path / "p.json").write_text('["one", "two"]')
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n{"text": "two"}\n')
    for f in ("p.txt", "p.json", "p.jsonl"):
        assert load_prompts(tmp_path / f) == ["one", "two"]
    (tmp_path / "bad.json").write_text('["one", 2]')
    with pytest.raises(FFNToolsError, match="entry 2"):
        load_prompts(tmp_path / "bad.json")
    assert load_prompts(None) == list(PROMPTS)


def test_cli_generate_json_and_prompts(chatty, tmp_path):
    (tmp_path / "p.txt").write_text("Hello there\nHow are you?\n")
    r = run_cli("verify", chatty, chatty, "--generate", "--prompts", tmp_path / "p.txt", "--new-tokens", "4",
                "--profile", "strict", "--json")
    g = json.loads(r.stdout)["generation"]
    assert "--generate: 2 prompts, up to 4 new tokens each" in r.stderr  # the cost, said before it starts
    assert len(g["prompts"]) == 2 and g["profile"] == "strict" and g["new_tokens"] == 4
    assert g["statistics"]["kl_ab_max"] == 0 and g["passed"]
    assert all(len(p["continuation"]) <= 4 for p in g["prompts"])
    assert g["cost"]["forward_passes"] == 2 * (4 + 3) and "2 prompts, up to 4 new tokens each" in g["cost"]["words"]
    out = run_cli("verify", chatty, chatty, "--generate", "--new-tokens", "2").output
    assert "verdict: within the floor" in out and out.count("  prompt ") == len(PROMPTS)


def test_generate_names_what_it_cannot_judge(chatty, tmp_path):
    """A Flax B of the linen layout (FFNs only) is no model: --generate says it did not run (exit 2); a B whose
    form ffn-tools cannot re-derive (4-bit MLX with a per-layer recipe) is reported and not judged (exit 2)."""
    b = tmp_path / "b"
    api.convert(chatty, "flax", b, flax_layout="linen")
    r = run_cli("verify", chatty, b, "--generate", "--ffn-only", ok=None)
    assert r.exit_code == 2 and "INCOMPLETE" in r.output and "no client here runs it" in r.output
    q = tmp_path / "q"
    api.convert(chatty, "mlx", q, quantize=True)
    _json(q / "config.json", lambda c: c["quantization"].update({"model.layers.0.self_attn.q_proj": {
        "bits": 4, "group_size": 64}}))
    report = api.verify(chatty, q, generate=True)
    g = report.as_dict()["generation"]
    assert report.exit_status == 2 and g["not_judged"] and "cannot be re-derived" in g["not_judged"]
    assert g["statistics"]["kl_ab_mean"] > 0 and "not judged" in report.generation.line()


def test_cli_profiles_are_the_checks():
    from ffn_tools.cli.verify import PROFILE_NAMES

    assert set(PROFILE_NAMES) == set(PROFILES)


def test_a_dtype_change_is_held_against_a_in_that_dtype(chatty, tmp_path):
    b = tmp_path / "b"
    api.convert(chatty, "torch", b, dtype="float32")
    report = api.verify(chatty, b, generate=True, new_tokens=4)
    g = _gen(report)
    assert report.passed and g["floor"] == "A computed in B's dtype float32 by transformers"
    assert g["statistics"]["kl_ab_mean"] == pytest.approx(g["floor_statistics"]["kl_ab_mean"], rel=1e-6)
    assert g["direct"]["client"] == "transformers" and not any(g["direct"]["statistics"].values())  # B is A'


def test_a_generation_that_did_not_run_is_never_passed(chatty, tmp_path):
    """An MLX Gemma-2 whose config.json says ``final_logit_softcapping: null``: mlx_lm cannot run it (it divides
    by None) while another check (the config) fails. The generation's line says why it did not run, the report
    says it under the failures, and its JSON is no pass."""
    import transformers

    import tiny_models

    a, b = tmp_path / "a", tmp_path / "b"
    _, _, extra = tiny_models.ARCHS["gemma2"]
    vocab = json.loads((chatty / "config.json").read_text())["vocab_size"]
    config = transformers.Gemma2Config(**{**tiny_models.COMMON, **extra, "vocab_size": vocab})
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(config).to(torch.bfloat16).save_pretrained(a)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chatty / f, a / f)
    api.convert(a, "mlx", b)  # mlx_lm's Gemma 2 has no window: the same function up to 6 tokens (issue 60 item 22)
    _json(b / "config.json", lambda c: c.update(final_logit_softcapping=None))
    report = api.verify(a, b, generate=True, new_tokens=2)
    g = report.as_dict()["generation"]
    assert [(x["key"], x["tokens"]) for x in report.as_dict()["config"]["bounded"]] == [("sliding_window", 6)]
    assert report.exit_status == 1 and g["passed"] is None and g["ran"] is False
    assert g["skipped"].startswith("--generate: mlx_lm could not run B (") and "Invoked with types" in g["skipped"]
    text = "\n".join(report.lines())
    assert f"generation: not run ({g['skipped']})" in text and "see above" not in text
    assert f"  not run: {g['skipped']}" in text and report.verdict.startswith("FAIL: config differs")


def test_a_bounded_window_difference_is_still_judged_past_its_bound(chatty, tmp_path):
    """issue 60 item 22: a Mistral sliding a 4-token window converts to MLX (mlx_lm attends to every token: the
    same function up to 4 tokens). The prompts run past the bound: the generation is still judged (against A
    converted to B's form, which mlx_lm runs as it runs B), the report says what that judges there, and the
    verdict says the bound."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(chatty, a)
    _json(a / "config.json", lambda c: c.update(model_type="mistral", architectures=["MistralForCausalLM"],
                                                sliding_window=4))
    api.convert(a, "mlx", b)
    report = api.verify(a, b, generate=True, new_tokens=2)
    g = report.generation
    assert g is not None and g.decided and report.passed, report.failures()
    assert report.as_dict()["equivalent_up_to"] == 4 and "equivalent up to 4 tokens" in report.verdict
    assert any(n.startswith("generation: on sequences past 4 tokens A's and B's clients compute otherwise")
               for n in report.notes), report.notes
