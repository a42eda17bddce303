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
from ..options import (CHECKPOINT, emit, estimate_option, estimated, layout_options, ray_option, resume_option,
                       scheme_options, size_option, upload_option, uploaded)
from .verify import verify as verify_command


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


class Group(click.Group):
    """Turns every failure into one line and exit status 2 (never a traceback); see ``cli``'s help. ``convert`` is
    drawn from the format registry when it is asked for (``cli.convert``): a format registered after this module was
    imported has its ``--to`` choice and flags, and a command that converts nothing imports no format."""

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), "convert"])

    def get_command(self, ctx, name):
        if name == "convert":
            from .convert import command

            return command()
        return super().get_command(ctx, name)

    def invoke(self, ctx):
        as_json = "--json" in ctx.args
        from ..rerun import ARGV, RUNNER

        given = ["--config", ctx.params["config"]] if ctx.params.get("config") else []
        # what --dry-run's sample run and --ray's tasks run again (quietly: no progress to draw)
        token = ARGV.set(["-q", *given, *getattr(ctx, "_protected_args", []), *ctx.args])
        RUNNER.set(run_again)
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
        finally:
            ARGV.reset(token)


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
def inspect(path, as_json, tensors, base, scheme, layout):
    """Show the architecture, naming scheme, FFN layout and sizes of the checkpoint at PATH.

    PATH is a .safetensors file, an index, a pickle, a .gguf file (any part of a split one), or a directory
    (PyTorch, MLX, Flax, an Orbax checkpoint, a torch.distributed.checkpoint). A LoRA adapter (PEFT, mlx_lm, GGUF
    LoRA) is shown as what each LoRA targets: layer, expert, projection, rank and scale; with --base, which FFNs
    of the base get no factors.
    """
    from ..api import inspect as run
    from ..summary import format_summary, format_tensors

    s = run(path, scheme=scheme, layout=layout, tensors=tensors, base=base)
    if "lines" in s:  # a LoRA adapter's
        emit(s, as_json, s["lines"])
        return
    emit(s, as_json, format_summary(s) + (["", *format_tensors(s["tensor_table"])] if tensors else []))


@cli.command()
@click.argument("path", type=CHECKPOINT)
@click.option("-o", "--out", required=True, type=click.Path(), help="Output directory (or a .safetensors file).")
@click.option("--layers", help="Layers to keep, e.g. 0-3,7 (default: all).")
@click.option("--experts", help="Routed experts to keep, e.g. 0,5 (default: all; dense and shared FFNs are kept).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@upload_option
@resume_option
@ray_option
@size_option
@scheme_options
@layout_options
def extract(path, out, layers, experts, force, as_json, upload_repo, resume, ray, max_shard_size, scheme, layout):
    """Write only the FFNs of PATH, with canonical names layers.{L}.{gate,up,down}.weight.

    Experts are layers.{L}.experts.{E}.*, the shared expert layers.{L}.shared_expert.*; biases .bias.
    Weights are (out, in) and bit-exact with the source. A manifest (ffn_manifest.json in a directory
    output, OUT.json beside a .safetensors output) records the source, scheme, activation, dtype, d_model,
    d_ffn, layers and experts.
    """
    from ..api import extract as run

    m = run(path, Path(out), layers=layers, experts=experts, scheme=scheme, layout=layout, force=force,
            max_shard_size=max_shard_size, upload_repo=upload_repo, resume=resume, ray=ray)
    emit(m, as_json, [m["summary"], *uploaded(m)])


def _gateup_command(name: str, fn, help_text: str, extra=()):
    @click.argument("path", type=CHECKPOINT)
    @click.option("-o", "--out", type=click.Path(), help="Output file or directory. Default: beside the input, "
                  "under a new name: DIR-split/ for a directory or a file inside a checkpoint directory, "
                  "model.split.safetensors for a lone file (-fused / .fused for fuse).")
    @click.option("--dry-run", is_flag=True, help="Print the plan (every output tensor and how it is made) and the "
                  "estimate of the run: output bytes, temporary disk, peak RSS and time, from a sample of it run here "
                  "(a few seconds); write nothing.")
    @estimate_option
    @click.option("--force", is_flag=True, help="Replace OUT if it exists.")
    @click.option("--json", "as_json", is_flag=True, help="Print a JSON summary of what was done.")
    @click.option("--load-check", is_flag=True, help="Check that transformers would load the output under the "
                  "config.json it carries (the load check of verify, on the planned names and shapes) and warn "
                  "where it would not. Off by default: it imports transformers, and split/fuse run at the speed of "
                  "a copy without it; without it, a family whose model class holds its FFNs in the other form "
                  "(Phi-3 fused, Llama split) is still warned from the registry's data, and `ffn-tools verify IN "
                  "OUT` checks everything.")
    @upload_option
    @resume_option
    @ray_option
    @size_option
    @scheme_options
    @layout_options
    def command(path, out, dry_run, estimate, force, as_json, load_check, upload_repo, resume, ray, max_shard_size,
                scheme, layout, **kw):
        r = fn(path, out, scheme=scheme, layout=layout, dry_run=dry_run, force=force, max_shard_size=max_shard_size,
               upload_repo=upload_repo, load_check=load_check, resume=resume, estimate=estimate, ray=ray, **kw)
        lines = list(r["plan"] or []) if dry_run else []
        emit(r, as_json, [*lines, r["summary"], *r["changes"], *estimated(r), *uploaded(r)])

    command.__doc__ = help_text
    for decorator in extra:
        command = decorator(command)
    return cli.command(name)(command)


def _split(*a, **k):
    from ..api import split_gateup

    return split_gateup(*a, **k)


def _fuse(*a, **k):
    from ..api import fuse_gateup

    return fuse_gateup(*a, **k)


_gateup_command("split-gateup", _split, """Split fused gate_up projections into gate_proj and up_proj.

    PATH is a .safetensors file, an index, a weights-only pickle or a directory. Phi-3 style mlp.gate_up_proj becomes
    mlp.gate_proj + mlp.up_proj; transformers-v5 stacked experts mlp.experts.gate_up_proj (E, 2I, H) and
    mlp.experts.down_proj (E, H, I) become per-expert tensors. Everything else is copied byte for byte;
    config.json, tokenizer and generation files are carried over.
    """)
_gateup_command("fuse-gateup", _fuse, """Fuse gate_proj and up_proj into one gate_up_proj (the inverse of split-gateup).

    Llama-style mlp.gate_proj + mlp.up_proj become mlp.gate_up_proj; per-expert MoE weights become
    per-expert fused tensors or, with --stack-experts, transformers-v5 stacked tensors
    mlp.experts.gate_up_proj (E, 2I, H) and mlp.experts.down_proj (E, H, I).
    """, extra=(click.option("--stack-experts", is_flag=True,
                             help="Stack routed experts into mlp.experts.gate_up_proj / down_proj, as transformers v5 "
                                  "stores them; dense MLPs and shared experts are left as they are."),))


@cli.command()
@click.argument("base", type=CHECKPOINT)
@click.argument("adapter", type=CHECKPOINT)
@click.option("-o", "--out", required=True, type=click.Path(), help="Output directory (or a .safetensors file).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@resume_option
@ray_option
@size_option
@scheme_options
def merge(base, adapter, out, force, as_json, resume, ray, max_shard_size, scheme):
    """Merge the LoRA ADAPTER into BASE: each targeted weight becomes W + scale·B·A.

    ADAPTER is PEFT's (target_modules or transformers v5 stacked experts through target_parameters, rsLoRA,
    rank_pattern / alpha_pattern), mlx_lm's or a GGUF LoRA. Where the adapter's targets are laid out otherwise
    than BASE stores its weights (a LoRA of v5 stacked experts and a base saved per expert, a fused LoRA and a
    split base), it is re-laid out exactly first. The sum is computed in float32 and rounded once to the
    weight's dtype; every other tensor is copied byte for byte, config.json and tokenizer carried; one tensor in
    memory at a time. A quantized BASE is refused (merging into codes means re-quantizing every weight).
    `ffn-tools verify BASE+ADAPTER OUT` proves the result.
    """
    from ..api import merge as run

    r = run(base, adapter, Path(out), force=force, max_shard_size=max_shard_size, scheme=scheme, resume=resume, ray=ray)
    emit(r, as_json, [r["summary"], *r["changes"]])


cli.add_command(verify_command)


def __getattr__(name: str):
    """``GGUF_OUTTYPES``: the --outtype choices convert offers, read from the command drawn from the registry (the
    name tests/test_gguf_kquant.py imports; the choices themselves are declared once, by the GGUF format)."""
    if name == "GGUF_OUTTYPES":
        from .convert import command

        return next(tuple(p.type.choices) for p in command().params
                    if p.name == "outtype" and isinstance(p.type, click.Choice))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _terminate(signum, frame):
    """SIGTERM / SIGHUP end the command like Ctrl-C: temporary outputs are removed (or kept for --resume) on the
    way out, and the exit status is 128 + the signal's number (143, 129)."""
    raise Interrupted(signum)


def run_again(call: dict) -> None:
    """A command line run again in this process (``rerun.replay``'s call: a ``--ray`` task's)."""
    cli.main(args=call["argv"], standalone_mode=False)


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
