"""``ffn-tools convert``, drawn from the format registry: ``--to`` offers the formats that write
(``converters.writable``), and each format's own options (``Format.options``, declared as data in its package) become
its flags here, passed to ``ffn_tools.convert`` under their own names (as mlx_lm's ``convert(**vars(args))``). A new
format's flags need no line in this module; its options are declared once, in its package."""

from __future__ import annotations

from pathlib import Path

import click

from .. import progress
from ..formats import Option
from ..options import (CHECKPOINT, emit, estimate_option, estimated, layout_options, output_options, ray_option,
                       resume_option, scheme_options, size_option, upload_option, uploaded)

HELP = """Convert the checkpoint at PATH to PyTorch safetensors, MLX, Flax msgpack, GGUF, DCP or Orbax.

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


def click_option(o: Option):
    """The click option a format's declared ``Option`` is on the command line (its value under ``o.name``)."""
    kw: dict = {"help": o.help, "default": o.default}
    if o.metavar is not None:
        kw["metavar"] = o.metavar
    if o.type is bool:
        return click.option(*o.cli_flags, o.name, is_flag=True, default=None,
                            callback=lambda ctx, param, v: True if v else None, help=o.help)
    if o.optional_value:  # given bare: True; with a value: what ``parse`` reads from it
        def optional(ctx, param, value):
            if value in (None, "bare"):
                return value and True
            try:
                return o.parse(value) if o.parse else value
            except ValueError as e:
                raise click.BadParameter(str(e), ctx, param) from None

        return click.option(*o.cli_flags, o.name, is_flag=False, flag_value="bare", callback=optional, **kw)
    if o.choices:
        kw["type"] = click.Choice([str(c) for c in o.choices], case_sensitive=o.case_sensitive)
        if o.type is not str:
            kw["callback"] = lambda ctx, param, v: None if v is None else o.type(v)
    elif o.existing_file:
        kw["type"] = click.Path(exists=True, dir_okay=False)
    elif o.type is int:
        kw["type"] = click.IntRange(min=o.minimum) if o.minimum is not None else int
    return click.option(*o.cli_flags, o.name, **kw)


def command() -> click.Command:
    """The ``convert`` command as the registry is now: ``--to`` its writable formats, a flag per declared option."""
    from ..formats import registry

    converters = registry()

    def convert(path, hf_path, to, out, mlx_path, dry_run, as_json, **options):
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
        if not (options["force"] or dry_run):  # an existing output refused before the imports a conversion needs
            from ..io.output import check_output

            check_output(Path(out), [], options["force"])
        # until a step has a progress bar (seconds: torch's and the clients' imports, a converter's start) the
        # terminal says what runs; steps that take long on their own say more
        with progress.doing(f"convert: opening {Path(path).name} and checking its {to} output's client"):
            r = run(path, to, Path(out), dry_run=dry_run or None, **options)
        emit(r, as_json, [*(r.get("plan") or []), r["summary"], *r.get("changes", []), *estimated(r), *uploaded(r)])

    decorators = [
        click.argument("path", type=CHECKPOINT, required=False),
        click.option("--hf-path", "--model", "hf_path", type=CHECKPOINT,
                     help="The input, as mlx_lm.convert names it (instead of PATH)."),
        click.option("--to", "to", type=click.Choice(converters.writable()),
                     help="Output format (mlx when --mlx-path is given)."),
        output_options("Output directory (a .gguf file for --to gguf).", required=False),
        click.option("--mlx-path", type=click.Path(), help="Output directory of an MLX export, as mlx_lm.convert "
                     "names it (instead of --to mlx -o)."),
        click.option("--dtype", type=click.Choice(("float32", "float16", "bfloat16")), help="Cast floating weights "
                     "to this dtype (MLX: those the model's cast_predicate allows, as mlx_lm.convert)."),
        *(click_option(o) for o in converters.options("convert")),
        click.option("--base", type=CHECKPOINT, help="PATH is a LoRA adapter: its base model (the config.json "
                     "mlx_lm's and llama.cpp's names come from; --to mlx and --to gguf need it, unless the adapter "
                     "names a local base)."),
        click.option("--dry-run", is_flag=True, help="Print every output tensor and how it is made (for mlx, what "
                     "mlx_lm's model expects, checked), and the estimate of the run (output bytes, temporary disk, "
                     "peak RSS, time) from a sample of it run here; write nothing."),
        estimate_option,
        click.option("--allow-config", "allow_config", multiple=True, metavar="KEY",
                     help="Write the output although its client runs setting KEY otherwise than the input's client "
                          "(say mlx_lm renormalizing Jamba's top-k weights, llama.cpp renormalizing Qwen3-MoE's): "
                          "without it such a conversion is refused, naming the setting and both behaviours. "
                          "Repeatable."),
        click.option("--unbounded", is_flag=True,
                     help="Refuse also a difference that shows only past a sequence length. By default an output "
                          "whose client differs only there (mlx_lm attending to every token where transformers' "
                          "Mistral slides a 4096-token window) is written, and a warning says the length up to "
                          "which the two agree."),
        upload_option, resume_option, ray_option, size_option, scheme_options, layout_options,
    ]
    for decorator in reversed(decorators):
        convert = decorator(convert)
    return click.command("convert", help=HELP)(convert)
