"""The ``ffn-tools`` command line. Thin: each command parses, calls one library function, prints."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click

from .. import progress
from ..errors import FFNToolsError, pip_install
from ..options import (CHECKPOINT, emit, estimate_option, estimated, layout_options, ray_option, resume_option,
                       scheme_options, size_option, upload_option, uploaded)
from .verify import verify as verify_command

# Optional packages: import name -> the extras of ffn-tools that install it (one per platform where they differ;
# none: the package is installed by its own name).
EXTRAS = {"mlx": ("mlx", "mlx-cpu"), "mlx_lm": ("mlx", "mlx-cpu"), "jax": ("flax",), "flax": ("flax",),
          "msgpack": ("flax",), "ml_dtypes": ("flax",), "triton": ("cuda",), "transformers": (),
          "gguf": ("gguf",), "llama_cpp": ("gguf",)}
PLATFORMS = {"mlx": "Apple silicon", "mlx-cpu": "Linux"}  # extras for one platform each


def how_to_install(name: str) -> str:
    """The pip command(s) that install the optional package ``name`` (a key of EXTRAS), from where this ffn-tools
    was installed (``errors.pip_install``)."""
    extras = EXTRAS[name]
    if not extras:
        return f"pip install {name}"
    return " or ".join(pip_install(e) + (f" ({PLATFORMS[e]})" if e in PLATFORMS else "") for e in extras)


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


def missing_package(e: ImportError) -> str | None:
    """One line naming the optional package an ImportError is about and how to install it, or None.

    The package is the ImportError's ``name``; without one (a shared library that does not load, as
    ``libmlx.so`` when mlx is installed without a backend), the optional package whose module was importing
    when it failed (the innermost frame of the traceback that belongs to one).
    """
    name = (e.name or "").split(".")[0]
    broken = False
    if name not in EXTRAS:
        frames = []
        tb = e.__traceback__
        while tb is not None:
            frames.append(str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0])
            tb = tb.tb_next
        name = next((f for f in reversed(frames) if f in EXTRAS), "")
        broken = True
    if name not in EXTRAS:
        return None
    if broken:
        return f"this needs {name}, which does not load here ({' '.join(str(e).split())[:160]}): {how_to_install(name)}"
    return f"this needs {name}, which is not installed here: {how_to_install(name)}"


class Interrupted(KeyboardInterrupt):
    """The command was stopped by SIGTERM or SIGHUP (SIGINT is KeyboardInterrupt itself); exit status 128 + its
    number. A KeyboardInterrupt, so everything on the way out treats it as Ctrl-C (an interrupted output keeps its
    finished shards for --resume: ``io.output.atomic_output``)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Group(click.Group):
    """Turns every failure into one line and exit status 2 (never a traceback); see ``cli``'s help."""

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


QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
# convert_hf_to_gguf.py's --outtype, then llama-quantize's types (converters/gguf/kquant.py, whose FTYPES the tests
# hold this list to: the CLI does not import the converters to draw its --help)
GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0", "auto", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4_moe", "q2_k", "q2_k_s",
                 "q3_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k", "q4_k_s", "q4_k_m", "q5_k", "q5_k_s", "q5_k_m", "q6_k",
                 "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_xs", "iq3_s", "iq3_m",
                 "iq4_nl", "iq4_xs", "tq1_0", "tq2_0")


def _quantize_value(ctx, param, value):
    """-q/--quantize is mlx_lm's flag; the older ``--quantize 4`` still gives bits."""
    if value in (None, "flag"):
        return value and True
    if value not in ("2", "3", "4", "5", "6", "8"):
        raise click.BadParameter(f"{value!r}: -q/--quantize takes no value (bits are --q-bits); put PATH before "
                                 "the options, or give it with --hf-path", ctx, param)
    return int(value)


@cli.command()
@click.argument("path", type=CHECKPOINT, required=False)
@click.option("--hf-path", "--model", "hf_path", type=CHECKPOINT, help="The input, as mlx_lm.convert names it "
              "(instead of PATH).")
@click.option("--to", "to", type=click.Choice(("torch", "mlx", "flax", "gguf", "dcp", "orbax")),
              help="Output format (mlx when --mlx-path is given).")
@click.option("-o", "--out", type=click.Path(), help="Output directory (a .gguf file for --to gguf).")
@click.option("--outtype", type=click.Choice(GGUF_OUTTYPES, case_sensitive=False), metavar="TYPE",
              help="GGUF only. f32, f16, bf16, q8_0, auto: convert_hf_to_gguf.py's flag, the type of the weights "
              "(norms and other 1-D tensors stay f32); auto, the default, is bf16 for a bf16 model, else f16, and "
              "a quantized model's weights from their codes (--requantize). "
              "llama-quantize's types (q4_k_m, q5_k_m, q6_k, q3_k_m, q2_k, q4_0, iq4_xs, ...): llama.cpp's own "
              "quantizer run on the auto file, in one command.")
@click.option("--requantize", is_flag=True, default=None, help="GGUF, a quantized input: write the weights no GGUF "
              "type holds exactly as Q8_0 of their dequantized values (said per tensor). Without it a quantized "
              "input (--outtype auto) is written from its codes, each weight in the type that holds it bit for bit "
              "(int8 -> Q8_0, int4 -> Q4_0 / Q4_1), and a weight none holds is refused, named with the numbers.")
@click.option("--output-tensor-type", metavar="TYPE", help="GGUF, with a llama-quantize --outtype: the type of "
              "output.weight, as llama-quantize's flag (q8_0, q6_k, f16, ...).")
@click.option("--token-embedding-type", metavar="TYPE", help="GGUF, with a llama-quantize --outtype: the type of "
              "token_embd.weight, as llama-quantize's flag.")
@click.option("--imatrix", type=click.Path(exists=True, dir_okay=False), help="GGUF, with a llama-quantize "
              "--outtype: llama-imatrix's importance matrix (GGUF), as llama-quantize's flag; i-quants below 3 bits "
              "need one.")
@click.option("--mlx-path", type=click.Path(), help="Output directory of an MLX export, as mlx_lm.convert names it "
              "(instead of --to mlx -o).")
@click.option("--dtype", type=click.Choice(("float32", "float16", "bfloat16")), help="Cast floating weights to this "
              "dtype (MLX: those the model's cast_predicate allows, as mlx_lm.convert).")
@click.option("-q", "--quantize", is_flag=False, flag_value="flag", default=None, callback=_quantize_value, metavar="",
              help="MLX only: quantize with mx.quantize, exactly the modules mlx_lm.convert -q would "
                   "(default 4 bits, group size 64, affine). In this command -q is quantize, as in mlx_lm; "
                   "quiet is `ffn-tools -q convert ...`.")
@click.option("--q-bits", type=click.Choice(("2", "3", "4", "5", "6", "8")), help="MLX: bits per weight "
              "(default: 4; mxfp8 8).")
@click.option("--q-group-size", "--group-size", "q_group_size", type=click.Choice(("16", "32", "64", "128")),
              help="MLX: quantization group size (default 64 affine, 32 mxfp4/mxfp8, 16 nvfp4).")
@click.option("--q-mode", type=click.Choice(QUANT_MODES), help="MLX: quantization mode (default affine; mxfp4, "
              "nvfp4, mxfp8 are MLX's microscaling float formats).")
@click.option("--quant-predicate", help="MLX: one of mlx_lm's mixed-bit recipes (mixed_2_6, mixed_3_4, mixed_3_6, "
              "mixed_4_6): more bits for v_proj/down_proj of some layers and lm_head, as mlx_lm.convert.")
@click.option("-d", "--dequantize", is_flag=True, help="MLX: write a quantized MLX input dequantized. Without -d "
              "or -q it stays quantized, copied as it is, as mlx_lm.convert keeps it; refused with -q, as in mlx_lm.")
@click.option("--flax-layout", type=click.Choice(("hf", "linen")),
              help="Flax only: hf = the Hugging Face Flax parameter tree (default); linen = FFNs as nn.Dense gate/up/down.")
@click.option("--orbax-layout", type=click.Choice(("hf", "maxtext", "nnx")), help="Orbax only: hf = the Hugging Face "
              "Flax tree (default); maxtext = MaxText's scanned decoder (layers stacked on axis 1, its query scaling; "
              "Llama, Mistral, Mixtral, Qwen3, Qwen3-MoE); nnx = each FFN as the NNX state of gate/up/down "
              "nnx.Linear (FFNs only).")
@click.option("--dcp-naming", type=click.Choice(("torchtitan", "hf")), help="DCP only: torchtitan = the keys of "
              "torchtitan's model of the architecture, as its state-dict adapter maps Hugging Face names (default; "
              "Llama, Qwen3, Qwen3-MoE, DeepSeek-V3); hf = the Hugging Face names as they are.")
@click.option("--dcp-ranks", type=click.IntRange(min=1), help="DCP only: the world size the output is sharded for "
              "(default 1): each tensor cut along dim 0, one __R_0.distcp per rank.")
@click.option("--base", type=CHECKPOINT, help="PATH is a LoRA adapter: its base model (the config.json mlx_lm's and "
              "llama.cpp's names come from; --to mlx and --to gguf need it, unless the adapter names a local base).")
@click.option("--dry-run", is_flag=True, help="Print every output tensor and how it is made (for mlx, what mlx_lm's "
              "model expects, checked), and the estimate of the run (output bytes, temporary disk, peak RSS, time) from "
              "a sample of it run here; write nothing.")
@estimate_option
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--allow-config", "allow_config", multiple=True, metavar="KEY",
              help="Write the output although its client runs setting KEY otherwise than the input's client (say "
                   "mlx_lm renormalizing Jamba's top-k weights, llama.cpp renormalizing Qwen3-MoE's): without it "
                   "such a conversion is refused, naming the setting and both behaviours. Repeatable.")
@click.option("--unbounded", is_flag=True,
              help="Refuse also a difference that shows only past a sequence length. By default an output whose "
                   "client differs only there (mlx_lm attending to every token where transformers' Mistral slides a "
                   "4096-token window) is written, and a warning says the length up to which the two agree.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@upload_option
@resume_option
@ray_option
@size_option
@scheme_options
@layout_options
def convert(path, hf_path, to, out, outtype, requantize, output_tensor_type, token_embedding_type, imatrix, mlx_path, dtype, quantize, q_bits, q_group_size, q_mode, quant_predicate,
            dequantize, flax_layout, orbax_layout, dcp_naming, dcp_ranks, base, dry_run, estimate, force, allow_config, unbounded, as_json, upload_repo, resume, ray, max_shard_size, scheme, layout):
    """Convert the checkpoint at PATH to PyTorch safetensors, MLX, Flax msgpack, GGUF, DCP or Orbax.

    The input may be any format ffn-tools reads. MLX output is what mlx_lm.convert writes for the same
    model: the parameters of mlx_lm's own model class (checked before anything is written), config.json,
    tokenizer and a model card; mlx_lm.load opens it. mlx_lm.convert's flags work as there:

    \b
        ffn-tools convert --hf-path ./llama --mlx-path ./llama-4bit -q --q-bits 4

    Flax output is flax_model.msgpack (sharded with an index beyond --max-shard-size). Unquantized
    conversions are lossless: converting back reproduces every bit.

    GGUF output is what llama.cpp's convert_hf_to_gguf.py writes for the same model and --outtype, bit for
    bit: its own model class runs, fed from ffn-tools' reader (so MLX and native inputs convert too). A GGUF
    input converts to torch (config.json and tokenizer from its metadata). K-quants and i-quants
    (--outtype q4_k_m, ...) are llama.cpp's own quantizer run on that file, in one command: the bytes
    llama-quantize writes, the recipe in the metadata:

    \b
        ffn-tools convert ./llama --to gguf -o llama-q4_k_m.gguf --outtype q4_k_m

    Orbax output is an item directory orbax.checkpoint restores (the Hugging Face Flax tree, or MaxText's
    scanned decoder with --orbax-layout maxtext), written an array slab at a time.

    DCP output is a torch.distributed.checkpoint directory (torchtitan's keys, or --dcp-naming hf) that
    torch.distributed.checkpoint.load reads, config.json and the tokenizer beside it; a DCP input (a
    torchtitan step-N directory) converts to any format, its training state left out.

    A quantized input (int4/int8 compressed-tensors, GPTQ, AWQ, MLX 4-bit, ModelOpt NVFP4) goes into GGUF from its
    codes, each weight in the type that holds it bit for bit; see --requantize. The scheme and layout options say
    where the FFNs are for --flax-layout linen and --orbax-layout nnx, which write only the FFNs.

    A LoRA adapter converts too: --to torch writes PEFT's adapter, --to mlx mlx_lm's (mlx_lm.load(...,
    adapter_path=OUT)), --to gguf llama.cpp's GGUF LoRA (as convert_lora_to_gguf.py writes it; llama.cpp's
    --lora); --base names the base model where the adapter does not:

    \b
        ffn-tools convert ./my-lora --to gguf --base ./llama -o my-lora.gguf
    """
    from ..api import convert as run

    if path and hf_path:
        raise click.UsageError("give the input once: PATH or --hf-path")
    path = path or hf_path
    if path is None:
        raise click.UsageError("missing the input: PATH (or --hf-path)")
    if mlx_path is not None:
        if out is not None or to not in (None, "mlx"):
            raise click.UsageError("--mlx-path is the output of --to mlx; give either it or --to/-o")
        to, out = "mlx", mlx_path
    if to is None or out is None:
        raise click.UsageError("missing " + " and ".join(n for n, v in (("--to", to), ("-o", out)) if v is None))
    if dequantize and quantize:
        raise click.UsageError("choose either -q/--quantize or -d/--dequantize, not both (as mlx_lm.convert)")
    if not (force or dry_run):  # an existing output refused before the imports a conversion needs (seconds)
        from ..io.output import check_output

        check_output(Path(out), [], force)
    # until a step has a progress bar (seconds: torch's and the clients' imports, a converter's start) the terminal
    # says what runs; steps that take long on their own say more
    with progress.doing(f"convert: opening {Path(path).name} and checking its {to} output's client"):
        r = run(path, to, Path(out), dtype=dtype, force=force, max_shard_size=max_shard_size, quantize=quantize,
                q_bits=int(q_bits) if q_bits else None, q_group_size=int(q_group_size) if q_group_size else None,
                q_mode=q_mode, quant_predicate=quant_predicate, dequantize=dequantize or None,
                dry_run=dry_run or None, flax_layout=flax_layout, orbax_layout=orbax_layout, dcp_naming=dcp_naming,
                dcp_ranks=dcp_ranks, outtype=outtype, requantize=requantize, output_tensor_type=output_tensor_type,
                token_embedding_type=token_embedding_type, imatrix=imatrix, scheme=scheme, layout=layout,
                upload_repo=upload_repo, allow_config=allow_config, unbounded=unbounded, base=base, resume=resume,
                estimate=estimate, ray=ray)
    emit(r, as_json, [*(r.get("plan") or []), r["summary"], *r.get("changes", []), *estimated(r), *uploaded(r)])


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
