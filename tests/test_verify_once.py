"""verify compares once, what it cannot compare says so by a flag, and the output options are declared once.

- What B should hold given A is B's export ops applied to A's tensor (``ffn_tools.ops``), compared once with what B
  stores: a norm B's client stores plus one (llama.cpp's Gemma norms, mlx_lm's Qwen3-Next norms) fails, naming
  the tensor, when B holds it shifted twice or not shifted at all; nothing is compared first and forgiven after.
- A check B's runtime has no answer to carries ``not_applicable`` (``clients.NotApplicable``'s runtime and
  question), and the report reads that flag, not the check's wording.
- ``-o/--out``, ``--force`` and ``--json`` come from one decorator (``options.output_options``) in every command
  that writes an output.
"""

from __future__ import annotations

import inspect

import click

from helpers import run_cli

from ffn_tools import options
from ffn_tools.cli import convert as convert_cli
from ffn_tools.cli import rewrite

WRITERS = ("extract", "split-gateup", "fuse-gateup", "merge", "convert")


def test_every_writing_command_takes_the_output_options_from_one_decorator():
    for source in (inspect.getsource(rewrite), inspect.getsource(convert_cli)):
        assert "option(\"-o\"" not in source and '"--force"' not in source and '"--json"' not in source
    for name in WRITERS:
        text = run_cli(name, "--help").output
        assert "-o, --out" in text and "Replace OUT if it exists." in text and "--json" in text, (name, text)
    required = {name: p.required for name, cmd in (("extract", rewrite.extract), ("merge", rewrite.merge),
                                                   ("split-gateup", rewrite.split_gateup))
                for p in cmd.params if p.name == "out"}
    assert required == {"extract": True, "merge": True, "split-gateup": False}


def test_output_options_give_out_force_and_as_json():
    @click.command()
    @options.output_options("where", required=False, json_help="as JSON")
    def cmd(out, force, as_json):
        click.echo(f"{out} {force} {as_json}")

    from click.testing import CliRunner

    r = CliRunner().invoke(cmd, ["-o", "x", "--force", "--json"])
    assert r.exit_code == 0 and r.output == "x True True\n", r.output
    r = CliRunner().invoke(cmd, [])
    assert r.output == "None False False\n"
    helps = {p.name: p.help for p in cmd.params}
    assert helps == {"out": "where", "force": "Replace OUT if it exists.", "as_json": "as JSON"}


def _report(**checks):
    from ffn_tools.verification.report import VerifyReport

    return VerifyReport({}, {}, ["reference"], {}, 4, 0, None, **checks)


def test_a_check_the_runtime_has_no_answer_to_is_flagged_and_the_report_reads_the_flag():
    """``Client.unanswered``: the default hooks' results carry ``not_applicable``; the report's verdict is
    INCOMPLETE because of that flag, whatever the skip's wording, and a skip for another reason (nothing to compare)
    that happens to say "not applicable" leaves it complete."""
    from ffn_tools.checks.config import ConfigResult
    from ffn_tools.checks.load import LoadCheck
    from ffn_tools.checks.side_files import SideFilesResult
    from ffn_tools.clients import Client

    class Mute(Client):
        name = "mute"

        def load_check(self, ckpt):
            return LoadCheck(self.name)

    mute = Mute()
    config, side, tokens = mute.compare_config(None, None), mute.compare_side_files(None, None), \
        mute.compare_tokenization(None, None)
    for check in (config, side, tokens):
        assert check.not_applicable and check.verdict is None and check.skipped.endswith("not applicable for mute")
    assert isinstance(config, ConfigResult) and isinstance(side, SideFilesResult)
    report = _report(config=config, side_files=side)
    assert not report.passed and report.unrun == [f"config not compared ({config.skipped})",
                                                  f"side files not compared ({side.skipped})"]
    data = report.as_dict()
    assert data["config"]["not_applicable"] is True and data["side_files"]["not_applicable"] is True
    assert data["incomplete"] == report.unrun and data["config"]["passed"] is None
    reworded = _report(config=ConfigResult(skipped="asked elsewhere", not_applicable=True))
    assert reworded.unrun == ["config not compared (asked elsewhere)"] and not reworded.passed
    worded = _report(config=ConfigResult(skipped="A has no config: not applicable for anyone"))
    assert worded.unrun == [] and worded.passed  # a skip by wording alone is not the flag
    assert "not_applicable" not in worded.as_dict()["config"]


def test_a_derived_tensor_is_compared_once_and_nothing_by_name_is_forgiven():
    """``Loaded``: the names its pairing derives are decided before any comparison (left out of the one by name,
    A's used or dropped as well), each derived tensor counted once where its outcome says; a failure of the
    comparison by name stays a failure."""
    from ffn_tools.checks.outside import DIFFER, IDENTICAL, WITHIN, Derived, OutsideResult
    from ffn_tools.verification.expected import Expected, Loaded, Sides

    class Sanitize:
        asked: list = []

        def derives(self, a_names, b_names):
            return frozenset(n for n in b_names if n.endswith("norm")), frozenset(n for n in a_names if n == "kv")

        def compare(self, names, compare):
            self.asked.append(names)
            return [Derived(n, {"a.norm": IDENTICAL, "b.norm": WITHIN}.get(n, DIFFER), f"{n}: shifted twice")
                    for n in names], ["compared as derived"]

    class Client:
        name = "fake"

        def pairing(self, ca, cb):
            return Sanitize()

        def stored_otherwise(self, cb):
            return frozenset()

    class Side(dict):
        metadata: dict = {}

    ca = Side.fromkeys(["a.norm", "b.norm", "c.norm", "kv", "embed", "ffn.gate"])
    cb = Side.fromkeys(["a.norm", "b.norm", "c.norm", "embed", "ffn.gate", "ffn.norm"])
    expected = Expected.derive(Client(), ca, cb, True, (frozenset({"ffn.gate"}), frozenset({"ffn.gate", "ffn.norm"})))
    loaded = next(t for t in expected.transforms if isinstance(t, Loaded))
    assert loaded.derived == {"a.norm", "b.norm", "c.norm"} and loaded.gone == {"kv"}  # B's FFN norm is the pairs'
    assert expected.left_out() == {"a.norm", "b.norm", "c.norm", "kv"}
    outside = OutsideResult(identical=1, differ=["embed: A 1 vs B 2"])  # the comparison by name: embed differs
    notes = expected.compare_derived(outside, Sides(ca, cb, None, None, (None, None)))
    assert Sanitize.asked == [["a.norm", "b.norm", "c.norm"]]
    assert outside.differ == ["embed: A 1 vs B 2", "c.norm: shifted twice"]  # not forgiven, and c.norm said once
    assert (outside.identical, outside.within) == (2, 1) and not outside.passed
    assert notes[0] == "compared as derived" and "A's kv: renamed, used or dropped" in notes[1]


GEMMA_NORM = ("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight")


def _one_failure(report, name: str) -> str:
    """The one outside-FFN failure of ``report``, which names ``name`` (compared once: said once)."""
    assert not report.passed and report.outside is not None
    said = [d for d in report.outside.differ if name in d]
    assert len(said) == 1 and len(report.outside.differ) == 1, report.outside.differ
    return said[0]


def test_gguf_norm_shifted_twice_or_not_at_all_is_caught_naming_it(gguf_model, gguf_ref, tmp_path):
    """Gemma 2 through llama.cpp's converter stores its norms plus one: B is compared with A's norm through the
    converter's ops, so a norm stored plus two, or stored as A's (not shifted), fails naming the tensor; the
    converter's own file passes, every norm bit for bit."""
    from safetensors.torch import load_file
    from test_gguf import _edit

    from ffn_tools.api import verify

    src, ref = gguf_model("gemma2"), gguf_ref("gemma2", "f32")
    good = verify(src, ref, backends=["reference"], load_check=False)
    assert good.passed and any("9 bit for bit" in n and "converter's ops" in n for n in good.notes), good.notes
    a = load_file(str(src / "model.safetensors"))[GEMMA_NORM[1]].numpy()
    for defect, edit in (("twice", lambda b: b + 1), ("not at all", lambda b: a)):
        bad = _edit(ref, tmp_path / f"{defect}.gguf", tensors={GEMMA_NORM[0]: edit})
        why = _one_failure(verify(src, bad, backends=["reference"], load_check=False), GEMMA_NORM[1])
        assert why.startswith(GEMMA_NORM[1]) and "compared with A's plus one" in why, (defect, why)


MLX_NORM = "model.layers.0.input_layernorm.weight"


def test_mlx_norm_shifted_twice_or_not_at_all_is_caught_naming_it(request, tmp_path):
    """Qwen3-Next through mlx_lm's sanitize holds its norms plus one: B's stored norm is compared with A's through
    the MLX export's own plan, once (not read back minus one and compared by name), so a norm stored plus two, or
    as A's (not shifted), fails naming the tensor; the export itself passes."""
    from safetensors.torch import load_file
    from test_zoo_mlx import _built, _edited_mlx, _exported

    import ffn_tools

    src, _ = _built(request, "qwen3_next")
    out = _exported(request, "qwen3_next")
    good = ffn_tools.verify(src, out, backends=["reference"], tokens=4)
    assert good.passed, good.failures()
    derived = next(n for n in good.notes if "compared with what mlx_lm's sanitize makes of A's" in n)
    assert MLX_NORM in derived and "bit for bit" in derived, derived
    a = load_file(str(src / "model.safetensors"))[MLX_NORM]

    def twice(w):
        w[MLX_NORM] = w[MLX_NORM] + 1.0

    def unshifted(w):
        w[MLX_NORM] = a.to(w[MLX_NORM].dtype)

    for defect, edit in (("twice", twice), ("not at all", unshifted)):
        bad = _edited_mlx(out, tmp_path / defect.replace(" ", "-"), edit)
        why = _one_failure(ffn_tools.verify(src, bad, backends=["reference"], tokens=4), MLX_NORM)
        assert why.startswith(MLX_NORM) and "as mlx_lm's sanitize makes it of A" in why, (defect, why)


def test_plus_ops_are_the_converters_arithmetic_for_every_16_bit_value():
    """``checks.rounded.plus_ops`` (Cast, Affine) against llama.cpp's converter's own arithmetic (``w + 1`` in
    float16 or float32, else in float32 after a cast; stored float32) over every float16 and bfloat16 bit pattern,
    and ``read_back_ops`` against the reader's ``- 1`` in float32: bit for bit (NaNs where both have them)."""
    import torch

    from ffn_tools.checks.rounded import derive, plus_ops, read_back_ops

    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for dtype, theirs in ((torch.float16, lambda w: (w + 1.0).float()),
                          (torch.bfloat16, lambda w: (w.float() + 1.0).float()),
                          (torch.float32, lambda w: (w + 1.0).float())):
        w = every.view(dtype) if dtype != torch.float32 else every.view(torch.float16).float()
        want, got = theirs(w), derive(plus_ops(w.dtype, 1.0), w)
        assert got.dtype == torch.float32 and torch.equal(want.isnan(), got.isnan()), dtype
        assert torch.equal(want[~want.isnan()], got[~got.isnan()]), dtype
        back = derive(read_back_ops(w.dtype, 1.0, torch.float32), w)
        assert torch.equal((want - 1.0)[~want.isnan()], back[~back.isnan()]), dtype
