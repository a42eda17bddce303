"""split-gateup / fuse-gateup on real transformers checkpoints: exact, loadable, planned, refusing bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_identical, run_cli, tensors, tree_digest
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import logits, make_model

from ffn_tools.io.readers import open_checkpoint

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_phi3_split_then_fuse_is_byte_identical_and_loads(model_dir, tmp_path):
    src = model_dir("phi3")
    run_cli("split-gateup", src, "-o", tmp_path / "split")
    split = tensors(tmp_path / "split")
    assert "model.layers.0.mlp.gate_up_proj.weight" not in split
    assert split["model.layers.0.mlp.gate_proj.weight"].shape == (96, 64)
    run_cli("fuse-gateup", tmp_path / "split", "-o", tmp_path / "back")
    assert_identical(tensors(src), tensors(tmp_path / "back"))
    assert torch.equal(logits(src, "phi3"), logits(tmp_path / "back", "phi3"))
    assert (tmp_path / "split" / "generation_config.json").is_file()
    assert json.loads((tmp_path / "split" / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_split_phi3_ffn_equals_transformers_phi3_mlp(model_dir, tmp_path):
    model = make_model("phi3")
    src = model_dir("phi3")
    run_cli("split-gateup", src, "-o", tmp_path / "split")
    t = tensors(tmp_path / "split")
    x = torch.randn(5, 64)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp."
        g, u, d = (t[p + n + ".weight"] for n in ("gate_proj", "up_proj", "down_proj"))
        ours = F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)
        with torch.no_grad():
            theirs = model.model.layers[layer].mlp(x)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(ours, F.linear(F.silu(F.linear(x, u)) * F.linear(x, g), d))  # order matters


@pytest.mark.parametrize("arch", ["llama", "llama-bias", "qwen3"])
def test_llama_fuse_then_split_is_byte_identical_with_same_logits(model_dir, tmp_path, arch):
    src = model_dir(arch)
    run_cli("fuse-gateup", src, "-o", tmp_path / "fused")
    fused = tensors(tmp_path / "fused")
    assert fused["model.layers.1.mlp.gate_up_proj.weight"].shape == (192, 64)
    if arch == "llama-bias":
        assert fused["model.layers.1.mlp.gate_up_proj.bias"].shape == (192,)
    run_cli("split-gateup", tmp_path / "fused", "-o", tmp_path / "back")
    assert_identical(tensors(src), tensors(tmp_path / "back"))
    assert torch.equal(logits(src, arch), logits(tmp_path / "back", arch))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_stack_experts_round_trip_and_transformers_loads_stacked(model_dir, tmp_path, arch):
    src = model_dir(arch)
    run_cli("fuse-gateup", src, "--stack-experts", "-o", tmp_path / "stacked")
    st = tensors(tmp_path / "stacked")
    assert st["model.layers.0.mlp.experts.gate_up_proj"].shape[:1] == (4,)
    assert not any(".experts.0." in n for n in st)
    # transformers v5 stores experts exactly like this: the stacked checkpoint loads and gives equal logits
    assert torch.equal(logits(src, arch), logits(tmp_path / "stacked", arch))
    run_cli("split-gateup", tmp_path / "stacked", "-o", tmp_path / "back")
    assert_identical(tensors(src), tensors(tmp_path / "back"))


def test_moe_per_expert_fuse_round_trip(model_dir, tmp_path):
    src = model_dir("qwen2_moe", torch.bfloat16)
    run_cli("fuse-gateup", src, "-o", tmp_path / "fused")
    t = tensors(tmp_path / "fused")
    assert t["model.layers.0.mlp.experts.3.gate_up_proj.weight"].shape == (96, 64)
    assert t["model.layers.0.mlp.shared_expert.gate_up_proj.weight"].shape == (160, 64)
    assert "model.layers.0.mlp.shared_expert_gate.weight" in t  # not an FFN: passes through
    run_cli("split-gateup", tmp_path / "fused", "-o", tmp_path / "back")
    assert_identical(tensors(src), tensors(tmp_path / "back"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [("concat", "gate-up", None), ("concat", "up-gate", None),
                                    ("interleaved", "gate-up", None), ("interleaved", "up-gate", None),
                                    ("tp", "gate-up", 2), ("tp", "up-gate", 4)], ids=str)
def test_every_layout_round_trips_on_a_real_checkpoint(model_dir, tmp_path, dtype, layout):
    arrangement, order, tp = layout
    opts = ["--layout", arrangement, "--order", order] + (["--tp", str(tp)] if tp else [])
    src = model_dir("llama-bias", dtype)
    run_cli("fuse-gateup", src, "-o", tmp_path / "fused", *opts)
    base, fused = tensors(src), tensors(tmp_path / "fused")
    g, u = base["model.layers.0.mlp.gate_proj.weight"], base["model.layers.0.mlp.up_proj.weight"]
    w = fused["model.layers.0.mlp.gate_up_proj.weight"]
    first = g if order == "gate-up" else u
    assert torch.equal(w[0], first[0])  # every layout starts with row 0 of the first projection
    run_cli("split-gateup", tmp_path / "fused", "-o", tmp_path / "back", *opts)
    assert_identical(base, tensors(tmp_path / "back"))
    if layout != ("concat", "gate-up", None):  # reading it with the wrong layout must not round-trip
        run_cli("split-gateup", tmp_path / "fused", "-o", tmp_path / "wrong")
        assert not torch.equal(tensors(tmp_path / "wrong")["model.layers.0.mlp.gate_proj.weight"], g)


def test_byte_copy_path_equals_compute_path(model_dir, tmp_path):
    """The executor copies byte ranges from safetensors and computes from pickles: both must agree."""
    st, pk = model_dir("llama-bias", torch.bfloat16), model_dir("llama-bias", torch.bfloat16, safe_serialization=False)
    for name, src in (("st", st), ("pk", pk)):
        run_cli("fuse-gateup", src, "-o", tmp_path / f"{name}-fused", "--layout", "tp", "--tp", "2")
    assert_identical(tensors(tmp_path / "st-fused"), tensors(tmp_path / "pk-fused"))


def test_single_file_form_writes_beside_a_lone_file(model_dir, tmp_path):
    shutil.copy(model_dir("phi3") / "model.safetensors", tmp_path / "model.safetensors")
    f = tmp_path / "model.safetensors"
    before = tree_digest(f)
    r = run_cli("split-gateup", f)
    assert (tmp_path / "model.split.safetensors").is_file()
    assert "model.split.safetensors" in r.output
    run_cli("split-gateup", f)  # a second run overwrites nothing
    assert (tmp_path / "model.split-2.safetensors").is_file()
    assert tree_digest(f) == before
    with safe_open(tmp_path / "model.split.safetensors", "pt") as s:
        assert s.metadata() == {"format": "pt"}
        assert "model.layers.1.mlp.up_proj.weight" in s.keys()


def test_a_file_in_a_checkpoint_directory_gets_a_sibling_directory(model_dir, tmp_path):
    """Loaders read every *.safetensors of a directory (mlx_lm.convert, from_pretrained of a single-file
    checkpoint): a split file beside the input would break it, so the default output is a sibling directory."""
    shutil.copytree(model_dir("phi3"), tmp_path / "phi3")
    before = tree_digest(tmp_path / "phi3")
    r = run_cli("split-gateup", tmp_path / "phi3" / "model.safetensors")
    out = tmp_path / "phi3-split"
    assert str(out) in r.output and tree_digest(tmp_path / "phi3") == before
    assert len(list((tmp_path / "phi3").iterdir())) == len(before)  # nothing added beside the input
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_dry_run_writes_nothing_and_names_every_output(model_dir, tmp_path):
    src = model_dir("phi3")
    r = run_cli("split-gateup", src, "-o", tmp_path / "out", "--dry-run")
    assert not (tmp_path / "out").exists()
    assert "model.layers.0.mlp.gate_proj.weight  float32[96, 64]  \u2190 rows 0:96 of model.layers.0.mlp.gate_up_proj.weight" in r.output
    assert "model.layers.1.mlp.up_proj.weight  float32[96, 64]  \u2190 rows 96:192 of" in r.output
    assert len([ln for ln in r.output.splitlines() if "\u2190" in ln]) == len(tensors(src)) + 2
    j = json.loads(run_cli("split-gateup", src, "-o", tmp_path / "out", "--json").stdout)
    assert j["ffns_changed"] == 2 and j["tensors_out"] == len(tensors(src)) + 2 and j["files"] == ["model.safetensors"]


def test_sharded_output_is_byte_exact_in_size_and_loads(model_dir, tmp_path):
    src = model_dir("phi3")
    run_cli("split-gateup", src, "-o", tmp_path / "out", "--max-shard-size", "60KB")
    files = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    big = max(p.stat().st_size for p in files)
    assert big <= 60_000
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors(tmp_path / "out").values())
    run_cli("fuse-gateup", tmp_path / "out", "-o", tmp_path / "back")
    assert torch.equal(logits(src, "phi3"), logits(tmp_path / "back", "phi3"))


def _bad_phi3(tmp_path, src, case):
    t = tensors(src)
    if case == "odd-rows":
        t["model.layers.1.mlp.gate_up_proj.weight"] = t["model.layers.1.mlp.gate_up_proj.weight"][:-1].contiguous()
        t["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 95)
    elif case == "missing-fused":
        del t["model.layers.1.mlp.gate_up_proj.weight"]
    d = tmp_path / case
    d.mkdir()
    shutil.copy(src / "config.json", d)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("case, args, message", [
    ("odd-rows", [], "odd number of gate/up rows"),
    ("tp-not-dividing", ["--layout", "tp", "--tp", "5"], "5 tensor-parallel ranks"),
    ("missing-fused", [], "layer 1: has model.layers.1.mlp.down_proj.weight but lacks model.layers.1.mlp.gate_up_proj.weight"),
    ("nothing-to-split", [], "nothing to split"),
    ("output-exists", [], "already exists"),
    ("output-is-input", [], "would overwrite the input"),
    ("tp-without-layout", ["--tp", "2"], "--tp needs --layout tp"),
])
def test_bad_input_is_refused_and_nothing_is_written(model_dir, tmp_path, case, args, message):
    src = model_dir("llama" if case == "nothing-to-split" else "phi3")
    if case in ("odd-rows", "missing-fused"):
        src = _bad_phi3(tmp_path, src, case)
    out = tmp_path / "out"
    if case == "output-exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    if case == "output-is-input":
        out = src
    before = tree_digest(src)
    r = run_cli("split-gateup", src, "-o", out, *args, ok=False)
    assert message in r.output
    assert tree_digest(src) == before
    if case == "output-exists":
        assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1
    elif case != "output-is-input":
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_force_replaces_an_earlier_output_but_no_other_directory(model_dir, tmp_path):
    out = tmp_path / "out"
    run_cli("split-gateup", model_dir("phi3"), "-o", out)
    (out / "old.txt").write_text("old")
    run_cli("split-gateup", model_dir("phi3"), "-o", out, "--force")
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    r = run_cli("split-gateup", model_dir("phi3"), "-o", home, "--force", ok=False)
    assert "earlier checkpoint output" in r.output and (home / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("where, src", [("_copy_range", "safetensors"), ("_copy_range", "pickle"),
                                        ("_emit", "legacy-pickle")])
def test_failure_midway_leaves_no_partial_output(model_dir, tmp_path, monkeypatch, where, src):
    """A disk filling up while bytes are copied (safetensors, zip pickle) or written (legacy pickle: no offsets)."""
    import ffn_tools.io.writer as writer

    calls = {"n": 0}
    real = getattr(writer, where)

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(writer, where, flaky)
    from ffn_tools.gateup import split_gateup

    source = model_dir("phi3") if src == "safetensors" else model_dir("phi3", safe_serialization=False)
    if src == "legacy-pickle":
        import shutil

        import torch

        legacy = tmp_path.parent / f"{tmp_path.name}-legacy"
        shutil.copytree(source, legacy)
        state = torch.load(legacy / "pytorch_model.bin", weights_only=True)
        torch.save(state, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
        source = legacy
    from ffn_tools.errors import OutputError

    with pytest.raises(OutputError, match="no space left on the device") as e:
        split_gateup(source, tmp_path / "out", max_shard_size=60_000)
    assert str(e.value).startswith(str(tmp_path / "out")) and "needs" in str(e.value)  # names -o, not a temp
    assert calls["n"] == 2 and list(tmp_path.iterdir()) == []


def test_pickle_input_is_split_too(model_dir, tmp_path):
    src = model_dir("llama", safe_serialization=False)
    run_cli("fuse-gateup", src, "-o", tmp_path / "fused")
    with open_checkpoint(tmp_path / "fused") as c:
        assert c.kind == "safetensors" and "model.layers.0.mlp.gate_up_proj.weight" in c


def test_split_never_imports_torch(model_dir, tmp_path):
    """Importing torch costs over a second, more than copying a gigabyte: the byte-moving path avoids it."""
    import subprocess
    import sys

    code = ("import sys; from click.testing import CliRunner; from ffn_tools.cli import cli; "
            f"r = CliRunner().invoke(cli, ['split-gateup', {str(model_dir('phi3'))!r}, '-o', {str(tmp_path / 'o')!r}]); "
            "assert r.exit_code == 0, r.output; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    split = tensors(tmp_path / "o")
    fused = tensors(model_dir("phi3"))["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(split["model.layers.1.mlp.up_proj.weight"], fused[96:])


def test_a_sharded_input_gives_a_sharded_output(model_dir, tmp_path):
    src = model_dir("phi3", max_shard_size="60KB")
    largest = max(p.stat().st_size for p in src.glob("*.safetensors"))
    r = run_cli("split-gateup", src, "-o", tmp_path / "out")
    assert "like the input's largest" in r.output
    files = list((tmp_path / "out").glob("model-*.safetensors"))
    assert len(files) > 1 and max(p.stat().st_size for p in files) <= max(largest, 2 * 96 * 64 * 4 + 500)
    run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "one")
    assert_identical(tensors(tmp_path / "out"), tensors(tmp_path / "one"))


@pytest.mark.parametrize("fmt", ["mlx", "flax"])
def test_other_formats_are_refused_by_the_cli_and_the_api_alike(model_dir, tmp_path, fmt):
    pytest.importorskip("mlx.core" if fmt == "mlx" else "flax")
    import ffn_tools
    from ffn_tools.errors import FFNToolsError

    src = tmp_path / fmt
    run_cli("convert", model_dir("llama"), "--to", fmt, "-o", src)
    for command in ("split-gateup", "fuse-gateup"):
        r = run_cli(command, src, "-o", tmp_path / "out", ok=None)
        assert r.exit_code == 2, r.output  # could not run: the rule lives in the core, not the CLI
        article = {"mlx": "an MLX", "flax": "a Flax"}[fmt]
        assert f"is {article} checkpoint; {command} works on PyTorch checkpoints" in r.output
    for fn in (ffn_tools.split_gateup, ffn_tools.fuse_gateup):
        with pytest.raises(FFNToolsError, match="works on PyTorch checkpoints"):
            fn(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_form_warning_is_the_load_check_on_the_planned_output(model_dir, tmp_path):
    """With --load-check a warning says what transformers does with the output, checked on the planned names and
    shapes; without it the family's data says it (split and fuse do not import transformers)."""
    def fuse(src, out, *extra):
        return json.loads(run_cli("fuse-gateup", src, "-o", tmp_path / out, "--json", *extra).stdout)

    r = fuse(model_dir("llama"), "fused", "--load-check")
    assert len(r["warnings"]) == 1 and "would load in transformers (LlamaForCausalLM) with" in r["warnings"][0]
    assert "newly initialized" in r["warnings"][0] and "gate_up_proj" in r["warnings"][0]
    unchecked = fuse(model_dir("llama"), "unchecked")["warnings"]
    assert len(unchecked) == 1 and "llama model class holds its FFNs separate" in unchecked[0], unchecked
    run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "split")
    assert fuse(tmp_path / "split", "back", "--load-check")["warnings"] == []  # Phi-3's own form: it loads
    assert_identical(tensors(tmp_path / "back"), tensors(model_dir("phi3")))
    assert fuse(model_dir("mixtral"), "stacked", "--stack-experts", "--load-check")["warnings"] == []  # v5 loads it


def _loaded(path):
    """transformers' own load of ``path``: (the model, the weights it initialised because the checkpoint lacks them)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), sorted(info["missing_keys"])


def test_an_output_its_model_class_would_not_load_says_so_without_a_load_check(model_dir, tmp_path):
    """59.4: a split Phi-3 loads in transformers with gate_up_proj newly initialised; split says so by default, in
    one line on stderr and in --json, from the family's data (no transformers imported), with what to do. A fused
    Llama likewise; a form the model's class takes says nothing."""
    r = run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "split")
    warned = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: ")]
    assert warned == [f"warning: {tmp_path / 'split'}: transformers' phi3 model class holds its FFNs fused, so it "
                      "would load this output's 2 split FFNs as newly initialised weights (config.json is "
                      "carried over unchanged); a split checkpoint is for code that reads gate and up as separate "
                      "projections (Llama-style models and converters, per-projection LoRA, pruning or "
                      "quantization): for transformers load the input, or run "
                      f"`ffn-tools fuse-gateup {tmp_path / 'split'}`"], r.stderr
    model, missing = _loaded(tmp_path / "split")  # what the line is about, as transformers itself does it
    assert "model.layers.0.mlp.gate_up_proj.weight" in missing
    with torch.no_grad():
        assert not torch.allclose(model(torch.arange(3, 19).reshape(2, 8)).logits, logits(model_dir("phi3"), "phi3"))
    js = json.loads(run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "split2", "--json").stdout)
    assert len(js["warnings"]) == 1 and "phi3 model class holds its FFNs fused" in js["warnings"][0]

    back = run_cli("fuse-gateup", tmp_path / "split", "-o", tmp_path / "back")  # Phi-3's own form again
    assert "warning" not in back.stderr, back.stderr

    r = run_cli("fuse-gateup", model_dir("llama"), "-o", tmp_path / "fused")
    assert "warning: " in r.stderr and "llama model class holds its FFNs separate, so it would load this output's " \
        "2 fused FFNs" in r.stderr and f"`ffn-tools split-gateup {tmp_path / 'fused'}`" in r.stderr, r.stderr
    assert "model.layers.0.mlp.gate_proj.weight" in _loaded(tmp_path / "fused")[1]
    r = run_cli("split-gateup", tmp_path / "fused", "-o", tmp_path / "llama")  # Llama's own form: it loads
    assert "warning" not in r.stderr and _loaded(tmp_path / "llama")[1] == [], r.stderr


@pytest.mark.parametrize("model_type", ["phi3", "glm", "glm4", "llama", "qwen3", "hrm_text", "minimax_m3_vl_text",
                                        "granitemoeshared", "modernbert-decoder"])
def test_the_familys_form_data_agrees_with_transformers_load_check(model_type, tmp_path):
    """The form data the default line reads (``own_forms`` in schemes/families.json) against transformers' own
    load check of the same output (--load-check): a warning from one exactly where the other gives one."""
    import zoo

    from ffn_tools.detect import find_ffns

    src = tmp_path / "src"
    zoo.build(model_type, src)
    with open_checkpoint(src) as c:
        ffns = find_ffns(c).ffns
    stack = ("--stack-experts",) if any(f.ref.kind == "expert" for f in ffns) else ()  # experts back as saved
    steps = [("split-gateup", ()), ("fuse-gateup", stack)]
    if not any(f.form.fused for f in ffns):
        steps.reverse()

    def warnings(command, path, out, *extra):
        return json.loads(run_cli(command, path, "-o", tmp_path / out, "--json", *extra).stdout)["warnings"]

    path = src
    for command, extra in steps:  # each form, each direction
        by_data = warnings(command, path, f"{command}-by-data", *extra)
        checked = warnings(command, path, f"{command}-checked", "--load-check", *extra)
        assert bool(by_data) == bool(checked), (command, by_data, checked)
        path = tmp_path / f"{command}-by-data"


def test_a_layout_other_than_the_familys_is_warned_at_split_time(model_dir, tmp_path):
    """59.5: `split-gateup phi3 --layout interleaved` wrote scrambled FFNs without a word: one line now says the
    family holds them otherwise; the family's own layout, or one's own templates, say nothing."""
    src = model_dir("phi3")
    r = run_cli("split-gateup", src, "-o", tmp_path / "inter", "--layout", "interleaved")
    layout_lines = [ln for ln in r.stderr.splitlines() if "split as" in ln]
    assert layout_lines == ["warning: 2 FFNs split as 'interleaved, gate-up', but hf's names hold gate and up as "
                            "'concat, gate-up', which is how its clients write them: each gate and up written holds "
                            "rows of both, another function; split without --layout to read the family's own, unless "
                            "this checkpoint was written in that arrangement by another tool"], r.stderr
    fused = tensors(src)["model.layers.0.mlp.gate_up_proj.weight"]
    assert not torch.equal(tensors(tmp_path / "inter")["model.layers.0.mlp.gate_proj.weight"], fused[:96])  # scrambled
    js = json.loads(run_cli("split-gateup", src, "-o", tmp_path / "j", "--layout", "interleaved", "--json").stdout)
    assert any(w.startswith("2 FFNs split as 'interleaved, gate-up'") for w in js["warnings"]), js["warnings"]
    r = run_cli("split-gateup", src, "-o", tmp_path / "own", "--layout", "concat")
    assert "split as" not in r.stderr, r.stderr
    mine = ["--gate", "model.layers.{layer}.mlp.gate_proj.weight", "--up", "model.layers.{layer}.mlp.up_proj.weight",
            "--down", "model.layers.{layer}.mlp.down_proj.weight",
            "--gate-up", "model.layers.{layer}.mlp.gate_up_proj.weight"]
    r = run_cli("split-gateup", src, "-o", tmp_path / "mine", "--layout", "interleaved", *mine)
    assert "split as" not in r.stderr, r.stderr


@pytest.mark.parametrize("model_type", ["aria_text", "granitemoe", "granitemoeshared", "granitemoehybrid"])
def test_split_then_fuse_gives_back_the_names_the_experts_had(model_type, tmp_path):
    """A family that names its stacked experts two ways (Aria's ``experts.fc1``/``fc2`` and Granite-MoE's
    ``input_linear``/``output_linear`` as saved, ``experts.gate_up_proj``/``down_proj`` in transformers 5's own
    state dict) splits both to ``experts.{e}.gate_proj``: split-gateup records which it split (and the FFNs it left
    separate), and fuse-gateup, without options, writes back the input's names, shapes and bytes (the v5 form came
    back under the saved form's names, and Aria's separate shared experts fused); verify passes the result."""
    import zoo

    from ffn_tools.gateup.common import SPLIT_FROM

    saved, state = tmp_path / "saved", tmp_path / "state-dict"
    zoo.build(model_type, saved, extra=zoo.case(model_type)[1], state_dict=state)
    for src in (saved, state):
        split, back = tmp_path / f"{src.name}-split", tmp_path / f"{src.name}-back"
        run_cli("split-gateup", src, "-o", split)
        r = run_cli("fuse-gateup", split, "-o", back)
        assert "FFNs fused back as split-gateup recorded they were (ffn_tools_split_from): " in r.output, r.output
        assert_identical(tensors(back), tensors(src))
        with open_checkpoint(back) as c:
            assert SPLIT_FROM not in c.metadata  # the record is used up
    r = run_cli("verify", state, tmp_path / "state-dict-back", "--backend", "reference", "--tokens", "4", ok=None)
    assert r.exit_code == 0 and "PASS" in r.output, r.output
