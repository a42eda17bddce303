"""Options and argument types the commands share (``cli`` and ``verification.cli`` both use them, so neither
imports the other): checkpoint paths or Hub ids, FFN naming scheme and gate_up layout, output sizes and
uploads, and how a result is printed."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import click

from .errors import FFNToolsError
from .layouts import ARRANGEMENTS, ORDERS, GateUpLayout
from .library import SCHEMES, custom_scheme, load_scheme_file
from .sizes import SIZE_HELP, parse_size


class CheckpointPath(click.ParamType):
    """A checkpoint path, or a Hugging Face Hub id (``org/name[@revision]``) resolved through the local
    cache or the Hub (see ``hub``); the command receives a local path either way."""

    name = "PATH|REPO_ID"

    def shell_complete(self, ctx, param, incomplete):
        """Complete file and directory names (the README's completion line), as click.Path does."""
        return [click.shell_completion.CompletionItem(incomplete, type="file")]

    def convert(self, value, param, ctx):
        from .hub import looks_like_repo_id, resolve

        if Path(value).exists():
            return value
        base, plus, adapter = str(value).rpartition("+")
        if plus and Path(base).exists() and Path(adapter).exists():  # verify's BASE+ADAPTER
            return value
        if not looks_like_repo_id(str(value)):
            self.fail(f"{value!r}: no such file or directory (nor a Hub repo id like org/name)", param, ctx)
        try:
            return str(resolve(str(value)))
        except FFNToolsError as e:
            self.fail(e.for_cli(), param, ctx)


CHECKPOINT = CheckpointPath()
SHARD_HELP = f"Largest output file, header included, e.g. 500MB, 5GB, 2GiB. {SIZE_HELP}"


def scheme_options(f):
    """--scheme, --scheme-file and --gate/--up/--down/--gate-up templates, resolved into ``scheme``."""

    @click.option("--scheme", "scheme_name", type=click.Choice(sorted(SCHEMES)),
                  help="Naming scheme of the FFN tensors (detected from config.json and tensor names by default).")
    @click.option("--scheme-file", type=click.Path(exists=True, dir_okay=False),
                  help="JSON file declaring the FFN tensor names: {\"gate\": T, \"up\": T, \"down\": T} "
                       "with {layer}/{expert} placeholders, or the full form with groups and forms.")
    @click.option("--gate", help="Template of gate weights, e.g. 'blocks.{layer}.ffn.W_gate.weight'.")
    @click.option("--up", help="Template of up weights.")
    @click.option("--down", help="Template of down weights.")
    @click.option("--gate-up", help="Template of fused gate_up weights. Splitting with templates names the output "
                  "with --gate/--up as well; fusing names it with --gate-up.")
    @functools.wraps(f)
    def wrapper(*args, scheme_name, scheme_file, gate, up, down, gate_up, **kwargs):
        if sum(bool(x) for x in (scheme_name, scheme_file, gate or up or down or gate_up)) > 1:
            raise click.UsageError("use one of --scheme, --scheme-file or --gate/--up/--down templates")
        scheme = SCHEMES.get(scheme_name) if scheme_name else None
        try:
            if scheme_file:
                scheme = load_scheme_file(scheme_file)
            elif gate or up or down or gate_up:
                scheme = custom_scheme(gate, up, down, gate_up)
        except FFNToolsError as e:
            raise click.UsageError(e.for_cli()) from None
        return f(*args, scheme=scheme, **kwargs)

    return wrapper


def layout_options_for(prefix: str, into: str, layout_help: str, order_help: str, tp_help: str):
    """A decorator adding --{prefix}layout/--{prefix}order/--{prefix}tp, resolved into the keyword ``into``
    (None when none is given)."""
    key = prefix.replace("-", "_")

    def decorator(f):
        @click.option(f"--{prefix}layout", f"{key}arrangement", type=click.Choice(ARRANGEMENTS), help=layout_help)
        @click.option(f"--{prefix}order", f"{key}order", type=click.Choice(ORDERS), help=order_help)
        @click.option(f"--{prefix}tp", f"{key}tp", type=click.IntRange(min=1), help=tp_help)
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            given = [kwargs.pop(f"{key}{k}") for k in ("arrangement", "order", "tp")]
            return f(*args, **{into: resolve_layout(*given, flag=f"--{prefix}")}, **kwargs)

        return wrapper

    return decorator


layout_options = layout_options_for(
    "", "layout",
    "How gate and up share the fused tensor: concat [g; u], interleaved rows g0,u0,g1,u1,... (GPT-OSS), or tp: "
    "per tensor-parallel rank [g_r; u_r] (vLLM, Megatron). Default: the scheme's (concat).",
    "Which projection comes first. Default: gate-up.", "Tensor-parallel degree for --layout tp.")


def resolve_layout(arrangement: str | None, order: str | None, tp: int | None, flag: str = "--") -> GateUpLayout | None:
    """The layout the options give (None when none is given); usage errors name the flags (``--`` or ``--b-``)."""
    if not (arrangement or order or tp):
        return None
    if tp and arrangement != "tp":
        raise click.UsageError(f"{flag}tp needs {flag}layout tp")
    if arrangement == "tp" and not tp:
        raise click.UsageError(f"{flag}layout tp needs {flag}tp N (the number of ranks)")
    return GateUpLayout(order or "gate-up", arrangement or "concat", tp or 1)


OUT_HELP = "Output directory (or a .safetensors file)."


def output_options(out_help: str = OUT_HELP, *, required: bool = True, json_help: str = "Print a JSON summary."):
    """-o/--out (``out``, ``required`` or not), --force (``force``: replace OUT if it exists) and --json
    (``as_json``): what every command that writes an output takes, declared once."""

    def decorator(f):
        for option in reversed((
                click.option("-o", "--out", required=required, type=click.Path(), help=out_help),
                click.option("--force", is_flag=True, help="Replace OUT if it exists."),
                click.option("--json", "as_json", is_flag=True, help=json_help))):
            f = option(f)
        return f

    return decorator


def upload_option(f):
    return click.option("--upload-repo", metavar="ORG/NAME", help="Then upload the output to this Hugging Face Hub "
                        "repo (created if missing; huggingface_hub's token), as mlx_lm.convert --upload-repo.")(f)


def uploaded(r: dict) -> list[str]:
    """The line saying where the output was uploaded, if it was."""
    return [f"uploaded to {r['uploaded']}"] if r.get("uploaded") else []


def estimated(r: dict) -> list[str]:
    """The line of a dry run's estimate, if one was asked for (``ffn_tools.estimate``)."""
    if not r.get("estimate"):
        return []
    from .estimate import line

    return line(r)


def estimate_option(f):
    return click.option("--estimate/--no-estimate", default=None,
                        help="With --dry-run: estimate the run (output bytes, temporary disk, peak RSS, time) from a "
                             "sample of it run here in a child process (default: yes, unless the environment sets "
                             "FFN_TOOLS_ESTIMATE=0).")(f)


def ray_flag(help_text: str):
    """``--ray [ADDRESS]``: an address, or ``cluster.LOCAL`` given alone (a Ray started here); ``help_text`` says what
    runs as Ray tasks."""
    from .cluster import LOCAL

    return click.option("--ray", "ray", is_flag=False, flag_value=LOCAL, default=None, metavar="[ADDRESS]",
                        help=help_text)


ray_option = ray_flag("Write the output's shards as Ray tasks, each where its input files are: on the Ray cluster at "
                      "ADDRESS (--ray=ADDRESS, e.g. --ray=auto, --ray=ray://head:10001; the output directory and the "
                      "inputs on storage every node sees, or the inputs on each node), or, alone, on a Ray started "
                      "here on every core. The output, receipt included, is byte-identical to a one-node run's. "
                      "Directory outputs of safetensors shards only; needs the ray extra.")


def resume_option(f):
    return click.option("--resume", is_flag=True, help="Continue the unfinished output a killed run of this same command "
                        "left (its temporary directory beside OUT): every shard it finished is checked (size and "
                        "BLAKE3) and kept, the rest written; the result is byte-identical to an uninterrupted run. "
                        "Directory outputs of safetensors shards only.")(f)


def size_option(f):
    return click.option("--max-shard-size", type=str, default=None, callback=lambda c, p, v: parse_size(v) if v else None,
                        help=SHARD_HELP)(f)


def emit(result: dict, as_json: bool, lines: list[str]) -> None:
    """The result as JSON, or as ``lines``; its ``warnings`` also go to stderr as one line each."""
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    else:
        for line in lines:
            click.echo(line)
    for w in result.get("warnings") or []:
        if as_json or not any(w in line for line in lines):
            click.echo(f"warning: {w}", err=True)
