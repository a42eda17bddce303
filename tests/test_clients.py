"""Outputs whose client runs the same weights as another function (issue 37, item 3): each client says how it
runs the settings clients read differently (``ffn_tools.checks.semantics``), read from its own code; convert
refuses such an output unless told (``--allow-config KEY``), and verify fails naming the setting and both
behaviours, with the real clients in the loop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_cli

pytest.importorskip("mlx_lm")


def _with(src, tmp_path, name: str, **config):
    """A copy of checkpoint ``src`` whose config.json says ``config`` too."""
    out = tmp_path / name
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **config}))
    return out


def _last_logits(src, mlx_out, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of every position of ``tokens`` as transformers runs ``src`` and as mlx_lm runs ``mlx_out``."""
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([tokens])).logits[0]
    mlx_model, _ = mlx_lm.load(str(mlx_out))
    ours = mlx_model(mx.array([tokens]))[0].astype(mx.float32)
    return theirs, torch.from_numpy(np.array(ours))


def test_mistral_sliding_window_to_mlx_is_written_with_its_bound(hf, tmp_path):
    """issue 60 item 22: mlx_lm attends to every token where transformers' Mistral slides its window: the two
    compute the same on every sequence of up to the window's length, and differ past it (run here through both
    real clients). convert writes it saying the bound in one line; verify passes saying it; --unbounded refuses
    and fails it as any other difference."""
    src = _with(hf("mistral", torch.float32), tmp_path, "src", sliding_window=8)  # 8 < max_position_embeddings
    out = tmp_path / "mlx"
    line = ("sliding_window: the input's client (transformers) runs a 8-token window on every layer of 2; the "
            "output's client (mlx_lm) would run full attention on every layer (2) (mlx_lm's llama model slides only "
            "the layers its layer_types mark sliding_attention: none here): the two agree on sequences of up to 8 "
            "tokens")
    r = run_cli("convert", str(src), "--to", "mlx", "-o", str(out), "--unbounded", ok=False)
    assert r.exit_code == 2 and not out.exists(), r.output
    assert line in r.output and "--allow-config sliding_window writes it anyway (without --unbounded: the two " \
        "agree on sequences of up to 8 tokens)" in r.output and "Traceback" not in r.output, r.output
    r = run_cli("convert", str(src), "--to", "mlx", "-o", str(out), "--json")
    assert r.stderr.strip().splitlines()[-1] == f"warning: {line} (--unbounded refuses it)", r.stderr
    data = json.loads(r.stdout)
    assert data["bounded"] == [{"key": "sliding_window", "tokens": 8, "line": line}]
    assert f"{line} (--unbounded refuses it)" in data["warnings"]
    r = run_cli("convert", str(src), "--to", "mlx", "-o", str(tmp_path / "q4"), "-q")  # quantized alike
    assert f"warning: {line} (--unbounded refuses it)" in r.stderr, r.stderr
    # the bound is the clients' own: the same logits on 8 tokens, and past the window only the positions past it
    # differ (transformers' token 8 no longer sees token 0; mlx_lm's does)
    theirs, ours = _last_logits(src, out, [5, 17, 3, 42, 9, 77, 23, 11, 60, 31, 8, 50])
    assert torch.allclose(theirs[:8], ours[:8], atol=1e-4), (theirs[:8] - ours[:8]).abs().max()
    assert (theirs[8:] - ours[8:]).abs().amax(dim=-1).min() > 1e-2
    short_theirs, short_ours = _last_logits(src, out, [5, 17, 3, 42, 9, 77, 23, 11])
    assert torch.allclose(short_theirs, short_ours, atol=1e-4)
    verified = line.replace("the input's client (transformers)", "A's client (transformers)").replace(
        "the output's client (mlx_lm) would run", "B's client (mlx_lm) runs")
    r = run_cli("verify", str(src), str(out), "--backend", "reference", "--json")
    data = json.loads(r.stdout)
    assert data["passed"] and data["equivalent_up_to"] == 8, data["verdict"]
    assert data["config"]["bounded"] == [{"key": "sliding_window", "tokens": 8, "line": verified}]
    assert data["config"]["problems"] == [] and data["config"]["passed"]
    assert data["verdict"].startswith("PASS: ") and "; equivalent up to 8 tokens (sliding_window differs past that, " \
        "see the config line; --unbounded fails it)" in data["verdict"], data["verdict"]
    r = run_cli("verify", str(src), str(out), "--backend", "reference")
    assert f"; bounded: {verified}" in r.output and "equivalent up to 8 tokens" in r.output.splitlines()[-1]
    r = run_cli("verify", str(src), str(out), "--backend", "reference", "--unbounded", ok=None)
    assert r.exit_code == 1 and f"FAIL: config differs; first: config: {verified} (--unbounded)" in r.output, r.output
    # --logits runs past the window: the logits differ there, and the bound is named as their cause
    r = run_cli("verify", str(src), str(out), "--backend", "reference", "--logits", ok=None)
    assert r.exit_code == 1 and f"likely cause, from the config check: {verified}" in r.output, r.output
    r = run_cli("verify", str(src), str(out), "--backend", "reference", "--allow-config", "sliding_window")
    assert "PASS" in r.output and "equivalent up to" not in r.output  # a difference accepted on purpose


def test_a_window_no_shorter_than_the_context_is_no_difference(hf, tmp_path):
    src = _with(hf("mistral", torch.float32), tmp_path, "src", sliding_window=128)  # = max_position_embeddings
    run_cli("convert", str(src), "--to", "mlx", "-o", str(tmp_path / "mlx"))
    assert "PASS" in run_cli("verify", str(src), str(tmp_path / "mlx"), "--backend", "reference").output


def test_mlx_lm_without_a_sliding_window_is_named(hf, tmp_path):
    """Gemma 2's mlx_lm model has no sliding window at all (its ModelArgs has none): every other layer of
    transformers' Gemma 2 slides."""
    r = run_cli("convert", str(hf("gemma2", torch.float32)), "--to", "mlx", "-o", str(tmp_path / "mlx"),
                "--unbounded", ok=False)
    assert r.exit_code == 2 and "a 6-token window on layer 0 of 2" in r.output
    assert "(mlx_lm's gemma2 model has no sliding window)" in r.output
    # only layer 0 slides, at 6 tokens: the same bound as Mistral's (issue 60 item 22), written saying it
    r = run_cli("convert", str(hf("gemma2", torch.float32)), "--to", "mlx", "-o", str(tmp_path / "mlx"))
    assert "(mlx_lm's gemma2 model has no sliding window): the two agree on sequences of up to 6 tokens " \
        "(--unbounded refuses it)" in r.stderr, r.stderr


def test_mlx_lm_convert_of_a_v5_llama3_fails_verify_naming_the_rope_base(tmp_path):
    """issue 59 item 1: transformers 5 keeps a Llama 3's rope_theta only inside rope_parameters, mlx_lm.convert copies
    that config.json unchanged, and mlx_lm.load runs its llama ModelArgs' default base 10000. verify reads B's config
    as mlx_lm.load does (its load_config, model class and ModelArgs.from_dict), not as ffn-tools' export would have
    completed it, so it fails naming rope_theta; ffn-tools' own export, which writes rope_theta, passes."""
    import mlx_lm
    import tiny_models
    import transformers
    from helpers import write_tokenizer

    src = tmp_path / "l3"
    config = transformers.LlamaConfig(**tiny_models.COMMON,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    write_tokenizer(src)
    assert "rope_theta" not in json.loads((src / "config.json").read_text())  # only in rope_parameters
    mlx_lm.convert(str(src), str(tmp_path / "theirs"))
    assert mlx_lm.load(str(tmp_path / "theirs"))[0].args.rope_theta == 10000  # what the real client runs
    r = run_cli("verify", str(src), str(tmp_path / "theirs"), "--backend", "reference", ok=None)
    assert r.exit_code == 1, r.output
    line = ("config: rope_theta: A 500000.0, B 10000 (mlx_lm's llama ModelArgs default: B's config.json has rope_theta "
            "only as rope_parameters.rope_theta (500000.0), which mlx_lm's llama model does not read; add rope_theta to "
            "B's config.json, as ffn-tools convert --to mlx writes it)")
    assert f"  - {line}" in r.output and "FAIL: config differs; first: " + line in r.output, r.output
    run_cli("convert", str(src), "--to", "mlx", "-o", str(tmp_path / "ours"))
    assert mlx_lm.load(str(tmp_path / "ours"))[0].args.rope_theta == 500000.0
    r = run_cli("verify", str(src), str(tmp_path / "ours"), "--backend", "reference")
    assert "config: 52 keys compared as transformers' LlamaConfig and mlx_lm's llama ModelArgs read them, 0 differ" \
        in r.output and "PASS" in r.output, r.output


def _children(module: str) -> list[int]:
    """This process's child processes running ``python -m module`` (from /proc)."""
    import os

    pids = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat, cmd = (d / "stat").read_text(), (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and module.encode() in cmd:
            pids.append(int(d.name))
    return pids


@pytest.mark.usefixtures("gguf_model")
def test_qwen3_moe_without_norm_topk_prob_to_gguf(gguf_model, gguf_ref, tmp_path):
    """llama.cpp's qwen3moe graph renormalizes the top-k weights whatever the GGUF says (src/models/qwen3moe.cpp:
    build_moe_ffn's norm_w true); transformers' Qwen3-MoE does only with norm_topk_prob."""
    pytest.importorskip("llama_cpp")
    src = _with(gguf_model("qwen3_moe"), tmp_path, "src", norm_topk_prob=False)
    out = tmp_path / "q.gguf"
    r = run_cli("convert", str(src), "--to", "gguf", "-o", str(out), "--outtype", "f32", ok=False)
    assert r.exit_code == 2 and not out.exists(), r.output
    from ffn_tools.converters.gguf import zygote

    # the converter started early is gone with the refusal, but for its zygote, which the process keeps for its next
    # conversion (a command's process ends it as it exits) and which ends when told
    assert _children("ffn_tools.converters.gguf.worker") in ([], [zygote._live["proc"].pid])
    zygote.stop()
    assert not _children("ffn_tools.converters.gguf.worker")
    assert ("norm_topk_prob: the input's client (transformers) runs the top-k experts' router weights as the router "
            "gives them, not renormalized; the output's client (llama.cpp) would run the top-k experts' router "
            "weights renormalized to sum to 1 (llama.cpp's qwen3moe graph, whatever the GGUF says)") in r.output
    run_cli("convert", str(src), "--to", "gguf", "-o", str(out), "--outtype", "f32", "--allow-config", "norm_topk_prob")
    r = run_cli("verify", str(src), str(out), "--backend", "reference", "--logits", ok=None)
    assert r.exit_code == 1, r.output
    assert "config: norm_topk_prob: A False, but llama.cpp assumes True" in r.output
    assert "likely cause, from the config check: norm_topk_prob" in r.output
    # the checkpoint that says true is the function llama.cpp runs: no difference, logits within tolerance (its GGUF
    # as llama.cpp's converter writes it, made once a run: convert gives those bytes, test_gguf_convert's
    # test_same_file_as_convert_hf_to_gguf[qwen3_moe-q8_0])
    assert "PASS" in run_cli("verify", str(gguf_model("qwen3_moe")), str(gguf_ref("qwen3_moe", "f32")), "--backend",
                             "reference", "--logits").output


def test_renormalizing_is_no_difference_where_every_expert_is_chosen(gguf_model, tmp_path):
    """The softmax over all experts already sums to 1: with top-k = every expert the two clients' functions
    agree, and convert names no difference (a refusal there would be a false alarm)."""
    from ffn_tools import converters

    cfg = json.loads((gguf_model("qwen3_moe") / "config.json").read_text())
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    some = _with(gguf_model("qwen3_moe"), tmp_path, "some", norm_topk_prob=False)
    every = _with(gguf_model("qwen3_moe"), tmp_path, "every", norm_topk_prob=False,
                  num_experts_per_tok=experts)
    assert cfg["num_experts_per_tok"] < experts
    gguf = converters.get("gguf")
    differ = converters.client_differences(converters.open_any(some), gguf)
    assert [(d.key, d.tokens) for d in differ] == [("norm_topk_prob", None)]  # at any length: no bound
    assert converters.client_differences(converters.open_any(every), gguf) == []


@pytest.fixture(scope="module")
def bf16_moe(tmp_path_factory):
    """A bfloat16 Qwen3-MoE and its MLX exports in float32 (a lossless upcast) and in bfloat16 (a copy)."""
    import tiny_models

    root = tmp_path_factory.mktemp("bf16-moe")
    src = tiny_models.build("qwen3_moe", root / "src", torch.bfloat16)
    run_cli("convert", str(src), "--to", "mlx", "-o", str(root / "m32"), "--dtype", "float32")
    run_cli("convert", str(src), "--to", "mlx", "-o", str(root / "m16"))
    return src, root / "m32", root / "m16"


def test_a_lossless_upcast_passes_logits_both_sides_in_float32(bf16_moe):
    """issue 37 item 4: A's bf16 weights widen to float32 exactly, so both clients compute in float32 and what
    is compared is the export, not bf16 arithmetic against float32 arithmetic (that failed 1.16x before)."""
    src, m32, _ = bf16_moe
    data = json.loads(run_cli("verify", str(src), str(m32), "--backend", "reference", "--logits", "--json").stdout)
    assert data["passed"] and data["logits"]["passed"], data["failures"]
    assert data["logits"]["max_abs"] < 1e-4  # float32 arithmetic on the same values, both sides
    assert any(n.startswith("logits: both sides computed in float32, the wider") for n in data["notes"])


def test_a_client_that_cannot_compute_in_the_weights_dtype_runs_both_in_float32(bf16_moe):
    """MLX's CPU backend runs its MoE gather in float32 only: both sides are computed in float32 then (the bf16
    weights widen exactly), instead of --logits exiting 2 with the report discarded."""
    import mlx.core as mx

    src, _, m16 = bf16_moe
    r = run_cli("verify", str(src), str(m16), "--backend", "reference", "--logits", "--json", ok=None)
    data = json.loads(r.stdout)
    assert r.exit_code == 0 and data["logits"]["passed"], data["failures"]
    if mx.default_device() == mx.cpu:
        assert any("which their weights widen to exactly: --logits: mlx_lm could not run B" in n and
                   "supports float32" in n for n in data["notes"]), data["notes"]


def test_logits_no_client_runs_leaves_the_report_incomplete_not_discarded(model_dir, tmp_path):
    """A check asked for that cannot run says so beside the other results: exit 2, the whole report printed."""
    src = model_dir("llama")
    run_cli("extract", str(src), "-o", str(tmp_path / "ffn"))
    r = run_cli("verify", str(src), str(tmp_path / "ffn"), "--backend", "reference", "--logits", ok=None)
    assert r.exit_code == 2, r.output
    verdict = r.output.strip().splitlines()[-1]
    assert verdict.startswith("INCOMPLETE: --logits: B") and "everything that ran agrees (2 FFNs" in verdict
    assert "layer 0" in r.output and "layer 1" in r.output  # the FFN table is there
    data = json.loads(run_cli("verify", str(src), str(tmp_path / "ffn"), "--backend", "reference", "--logits",
                              "--json", ok=None).stdout)
    assert not data["passed"] and data["incomplete"] and data["logits"] is None


# Runtimes per format (issue 54 item 2): a format lists the runtimes that load it, ``clients.runtime`` picks one,
# and a runtime that does not answer a hook says "not applicable" for it, never transformers' answer.

class _Toy:
    """A toy runtime declared for the torch format, answering only what every runtime must (``load_check``)."""

    @staticmethod
    def client():
        from ffn_tools.checks.load import LoadCheck
        from ffn_tools.clients import Client

        class Toy(Client):
            name = "toy"

            def load_check(self, ckpt):
                return LoadCheck(self.name, architecture="toy")

        return Toy()

    @staticmethod
    def format():
        """The torch format with the toy runtime declared after transformers."""
        from ffn_tools import converters
        from ffn_tools.converters.pytorch import PyTorch

        class WithToy(PyTorch):
            runtimes = ("transformers", "toy")

            def load_runtime(self, name):
                return _Toy.client() if name == "toy" else converters.get("torch").load_runtime(name)

        return WithToy()


def test_a_format_lists_its_runtimes_and_the_lookup_names_them():
    from ffn_tools import converters
    from ffn_tools.clients import NoClient, runtime
    from ffn_tools.errors import FFNToolsError

    fmt = _Toy.format()
    assert runtime(fmt).name == "transformers" and runtime(fmt, "toy").name == "toy"  # the first is the default
    assert runtime(converters.get("mlx")).name == "mlx_lm" and runtime(converters.get("gguf")).name == "llama.cpp"
    with pytest.raises(FFNToolsError, match=r"'nope' .*torch checkpoints.*transformers \(the default\), toy"):
        runtime(fmt, "nope")
    native = converters.get("native")
    assert native.runtimes == () and isinstance(runtime(native), NoClient)
    assert "Meta's and Mistral's own code" in runtime(native).load_check(None).skipped
    with pytest.raises(FFNToolsError, match="no runtime here loads them .Meta's"):
        runtime(native, "transformers")
    fmt.load_runtime = lambda name: converters.get("torch").load_runtime("transformers")  # ignores its name
    with pytest.raises(FFNToolsError, match=r"load_runtime\('toy'\) built <client transformers>.*disagree"):
        runtime(fmt, "toy")


def test_a_runtime_without_an_answer_says_not_applicable_not_transformers_answer(model_dir):
    """Its config, side files, settings, load warning, logits and prompts: each "not applicable for toy", where the
    same checkpoints under transformers compare (its answer is not inherited)."""
    from ffn_tools.converters import open_any
    from ffn_tools.clients import NotApplicable, runtime
    from ffn_tools.verification.model import model_checks

    src = model_dir("llama")
    fmt = _Toy.format()
    toy, transformers = runtime(fmt, "toy"), runtime(fmt)
    with open_any(src) as ca, open_any(src) as cb:
        config, side, tokens = model_checks(toy, ca, cb, None, (), True)  # as verify asks B's client

        assert tokens is None  # toy does not tokenize with code of its own
        for check in (config, side):
            assert check.verdict is None and check.skipped.endswith("as this runtime reads them: not applicable for toy"
                                                               if check is side else
                                                               "as this runtime reads it: not applicable for toy")
            assert "not compared (" in check.line() and "not applicable for toy" in check.line()
        theirs, their_side, _ = model_checks(transformers, ca, cb, None, (), True)
        assert theirs.skipped is None and their_side.skipped is None and their_side.identical  # transformers answers
        assert transformers.runs({"model_type": "llama"}) is not None
        for call in (lambda: toy.runs({"model_type": "llama"}), lambda: toy.load_warning(ca, None),
                     lambda: toy.ready_for_logits(ca, "B"), lambda: toy.logits(Path(src), torch.zeros(1, 1)),
                     lambda: toy.generate(Path(src), ["hi"], 1)):
            with pytest.raises(NotApplicable, match="not applicable for toy"):
                call()


def test_settings_a_runtime_does_not_say_are_noted_not_compared(model_dir):
    """A's client (transformers) against a toy B's: the settings they run otherwise are not compared, and the
    config check says why, instead of reading toy's settings as transformers'."""
    from ffn_tools.converters import open_any
    from ffn_tools.clients import compare_config_json, runtime

    src = model_dir("llama")
    toy = runtime(_Toy.format(), "toy")
    with open_any(src) as ca, open_any(src) as cb:
        res = compare_config_json(toy, ca, cb)
    assert any("A's client (transformers) and B's (toy) run otherwise were not compared" in n
               and n.endswith("not applicable for toy") for n in res.notes), res.notes


def test_a_load_check_of_a_planned_output_the_runtime_has_not_is_said(model_dir, tmp_path, monkeypatch):
    """fuse-gateup --load-check where the input's runtime has no load check of a planned output: the warning says
    it did not run, not applicable, and the family's data speaks (not a silent pass)."""
    from ffn_tools import converters

    torch_format = converters.get("torch")
    monkeypatch.setattr(torch_format, "load_runtime", lambda name: _Toy.client())
    monkeypatch.setattr(type(torch_format), "runtimes", ("toy",))
    r = json.loads(run_cli("fuse-gateup", model_dir("llama"), "-o", tmp_path / "fused", "--json",
                           "--load-check").stdout)
    assert r["warnings"][0] == ("--load-check did not run: the load check of a planned output: not applicable "
                                "for toy"), r["warnings"]
    assert len(r["warnings"]) == 2 and "transformers' llama model class holds its FFNs" in r["warnings"][1]  # its data


def test_verify_client_picks_a_runtime_and_names_what_it_does_not_answer(model_dir, monkeypatch):
    """verify --client toy: B judged by the toy runtime (its load check), and its config and side files said not
    compared, not applicable for toy, in the verdict itself (never transformers' answer passed off as toy's), which
    is INCOMPLETE with exit status 2, as for a check asked for that could not run: a check that did not run never
    reads as a PASS."""
    from ffn_tools import converters

    torch_format = converters.get("torch")
    real = torch_format.load_runtime
    monkeypatch.setattr(type(torch_format), "runtimes", ("transformers", "toy"))
    monkeypatch.setattr(torch_format, "load_runtime", lambda name: _Toy.client() if name == "toy" else real(name))
    src = model_dir("llama")
    r = run_cli("verify", src, src, "--client", "toy", "--backend", "reference", "--json", ok=None)
    data = json.loads(r.stdout)
    assert data["load_check"]["client"] == "toy" and data["load_check"]["ok"]
    said = [s for s in data["not_run"] if "not applicable for toy" in s]
    assert len(said) == 2 and said[0].startswith("config not compared") and said[1].startswith("side files not"), \
        data["not_run"]
    assert all(s in data["verdict"] for s in said), data["verdict"]
    assert r.exit_code == 2 and not data["passed"] and data["incomplete"] == said, (r.exit_code, data["incomplete"])
    assert data["verdict"].startswith("INCOMPLETE: config not compared") and "everything that ran agrees" in \
        data["verdict"] and data["verdict"].count("not applicable for toy") == 2, data["verdict"]
    text = run_cli("verify", src, src, "--client", "toy", "--backend", "reference", ok=None)
    assert text.exit_code == 2 and text.output.strip().splitlines()[-1] == data["verdict"], text.output
    r = run_cli("verify", src, src, "--client", "nope", "--backend", "reference", ok=False)
    assert "'nope'" in r.output and "transformers (the default), toy" in r.output
