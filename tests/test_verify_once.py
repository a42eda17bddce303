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
    reworded = _report(config=ConfigResult(skipped="asked elsewhere", not_applicable=True))
    assert reworded.unrun == ["config not compared (asked elsewhere)"] and not reworded.passed
    worded = _report(config=ConfigResult(skipped="A has no config: not applicable for anyone"))
    assert worded.unrun == [] and worded.passed  # a skip by wording alone is not the flag
