"""The ``ffn-tools`` command line. Thin: each command parses, calls one library function, prints."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click

from .. import progress
from ..errors import FFNToolsError
from ..formats import missing_package
from ..options import CHECKPOINT, emit, layout_options, scheme_options
from .rewrite import extract, fuse_gateup, merge, split_gateup
from .verify import verify as verify_command
from .surgery import COMMANDS as surgery_commands


class Trouble(click.ClickException):
    """The command could not run: one line on stderr (and ``{"error": ...}`` on stdout under --json), exit 2."""

    exit_code = 2

    def __init__(self, message: str, as_json: bool = False):
        super().__init__(message)
        self.as_json = as_json

    def show(self, file=None) -> None:
        if self.as_json:
            click.echo(json.dumps({"error": self.message}))
        super().show(file)


class Interrupted(KeyboardInterrupt):
    """The command was stopped by SIGTERM or SIGHUP (SIGINT is KeyboardInterrupt itself); exit status 128 + its
    number. A KeyboardInterrupt, so everything on the way out treats it as Ctrl-C (an interrupted output keeps its
    finished shards for --resume: ``io.output.atomic_output``)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


LISTING = "ffn_tools.listing"  # ctx.meta's key: the help is listing the commands


class Group(click.Group):
    """Turns every failure into one line and exit status 2 (never a traceback); see ``cli``'s help. ``convert`` is
    drawn from the format registry when it is asked for (``cli.convert``): a format registered after this module was
    imported has its ``--to`` choice and flags, and a command that converts nothing imports no format."""

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), "convert"])

    def get_command(self, ctx, name):
        if name == "convert":
            from .convert import HELP, command

            # the command list needs only its help: drawing it imports every format (~0.2 s)
            return click.Command(name, help=HELP) if ctx.meta.get(LISTING) else command()
        return super().get_command(ctx, name)

    def format_commands(self, ctx, formatter):
        ctx.meta[LISTING] = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            ctx.meta[LISTING] = False

    def invoke(self, ctx):
        as_json = "--json" in ctx.args
        try:
            return super().invoke(ctx)
        except FFNToolsError as e:
            raise Trouble(e.for_cli(), as_json) from None
        except click.ClickException as e:  # usage errors too; Trouble prints its own JSON
            if as_json and not isinstance(e, Trouble):
                click.echo(json.dumps({"error": e.format_message()}))
            raise
        except KeyboardInterrupt as e:  # temporary outputs are removed (or kept for --resume) on the way here
            import signal

            signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
            if as_json:
                click.echo(json.dumps({"error": "interrupted", "signal": signal.Signals(signum).name}))
            click.echo(f"Interrupted ({signal.Signals(signum).name})", err=True)
            ctx.exit(128 + signum)
        except BrokenPipeError:  # output piped into `head`: not an error; silence the flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(0) from None
        except ImportError as e:
            why = missing_package(e)
            if why is None:
                raise
            raise Trouble(why, as_json) from None
        except OSError as e:  # a path the OS refuses (a file where a folder must be, no permission, disk full)
            where = f"{e.filename}: " if e.filename else ""
            raise Trouble(f"{where}{e.strerror or e}", as_json) from None


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-q", "--quiet", is_flag=True, help="Print only results and errors; no progress.")
@click.option("-v", "--verbose", is_flag=True, help="Log what is being done.")
@click.option("--config", "config", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="config.json of checkpoints that carry none (a training run's DCP checkpoint, MaxText's Orbax "
                   "checkpoint): without it one is inferred from the shapes, and what was assumed is said.")
@click.version_option(package_name="ffn-tools")
def cli(quiet: bool, verbose: bool, config: str | None) -> None:
    """Split, fuse, convert and verify the gated feed-forward weights of LLM checkpoints.

    Reads the checkpoints of every gated model family transformers ships (Llama, Mistral, Qwen, Phi-3,
    Gemma, DeepSeek, Mixtral, Qwen-MoE, GPT-OSS, Llama-4, ...; safetensors, sharded or not, weights-only
    pickles, MLX, Flax), finds every FFN, and writes new checkpoints atomically: outputs go to a temporary
    path and are moved into place only on success; the input is never modified. LoRA adapters (PEFT, mlx_lm,
    GGUF) are inspected, split, fused, converted, merged (merge) and verified the same way.

    Exit status, every command: 0 done (verify: everything agrees); 1 verify found a difference; 2 could
    not run (bad input or option, an I/O error, a missing optional package); 130 interrupted (Ctrl-C),
    143 terminated (SIGTERM), 129 hung up (SIGHUP): the temporary output is removed (its finished shards
    are kept for --resume, and a line says where), and under --json stdout says {"error": "interrupted"}.
    """
    from ..io.store import give_config

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[progress.StatusAwareHandler()])  # above a status line, never glued to it
    progress.set_enabled(not quiet)
    give_config(Path(config) if config else None)


@cli.command()
@click.argument("path", type=CHECKPOINT)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of text.")
@click.option("--tensors", is_flag=True, help="Also list every tensor: name, dtype, shape, bytes, and its role "
              "(which FFN and projection, outside the FFNs, or FFN-like but unmatched).")
@click.option("--base", type=CHECKPOINT, help="PATH is a LoRA adapter: its base model, to say which of the base's "
              "FFNs get no factors (or only zero ones).")
@scheme_options
@layout_options
def inspect(path, as_json, **options):
    """Show the architecture, naming scheme, FFN layout and sizes of the checkpoint at PATH.

    PATH is a .safetensors file, an index, a pickle, a .gguf file (any part of a split one), or a directory
    (PyTorch, MLX, Flax, an Orbax checkpoint, a torch.distributed.checkpoint). A LoRA adapter (PEFT, mlx_lm, GGUF
    LoRA) is shown as what each LoRA targets: layer, expert, projection, rank and scale; with --base, which FFNs
    of the base get no factors.
    """
    from ..api import inspect as run
    from ..summary import format_summary, format_tensors

    s = run(path, **options)
    if "lines" in s:  # a LoRA adapter's
        emit(s, as_json, s["lines"])
        return
    emit(s, as_json, format_summary(s) + (["", *format_tensors(s["tensor_table"])] if options["tensors"] else []))


for command in (extract, split_gateup, fuse_gateup, merge, verify_command):
    cli.add_command(command)
for command in surgery_commands:  # prune-experts, reorder-experts (cli/surgery.py)
    cli.add_command(command)


def _terminate(signum, frame):
    """SIGTERM / SIGHUP end the command like Ctrl-C: temporary outputs are removed (or kept for --resume) on the
    way out, and the exit status is 128 + the signal's number (143, 129)."""
    raise Interrupted(signum)


# Extension modules that print, as the interpreter exits, every object of theirs still alive: Triton 3.x's
# nanobind bindings ("nanobind: leaked 64 types!", ~30 lines on stderr after a passing verify, when its objects
# were frozen out of the collector's sight). mlx, jaxlib and tensorstore print nothing (checked).
LISTS_LEAKS_AT_EXIT = ("triton._C.libtriton",)


def main() -> None:
    """Console-script entry point."""
    import gc
    import signal

    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, _terminate)
    try:
        cli(prog_name="ffn-tools")
    finally:
        # The command is done, its output in place: the interpreter's exit would now walk every object torch,
        # transformers and mlx_lm made for a last cycle collection (~0.8 s of a 1 s exit, measured), which frees
        # nothing the process needs. Frozen, they are left to the exit itself (atexit handlers still run); not
        # where an extension that lists its objects still alive at exit is loaded: frozen, they never are freed.
        if not any(name in sys.modules for name in LISTS_LEAKS_AT_EXIT):
            gc.freeze()


if __name__ == "__main__":
    main()
