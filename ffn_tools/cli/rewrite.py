"""The commands that write a checkpoint rewritten: ``extract``, ``split-gateup``, ``fuse-gateup``, ``merge``. Each
passes its options to the library function of its name under the same names (``ffn_tools.api``)."""

from __future__ import annotations

from pathlib import Path

import click

from ..options import (CHECKPOINT, emit, estimate_option, estimated, layout_options, output_options, ray_option,
                       resume_option, scheme_options, size_option, upload_option, uploaded)


@click.command()
@click.argument("path", type=CHECKPOINT)
@output_options(json_help="Print the manifest as JSON.")
@click.option("--layers", help="Layers to keep, e.g. 0-3,7 (default: all).")
@click.option("--experts", help="Routed experts to keep, e.g. 0,5 (default: all; dense and shared FFNs are kept).")
@upload_option
@resume_option
@ray_option
@size_option
@scheme_options
@layout_options
def extract(path, out, as_json, **options):
    """Write only the FFNs of PATH, with canonical names layers.{L}.{gate,up,down}.weight.

    Experts are layers.{L}.experts.{E}.*, the shared expert layers.{L}.shared_expert.*; biases .bias.
    Weights are (out, in) and bit-exact with the source. A manifest (ffn_manifest.json in a directory
    output, OUT.json beside a .safetensors output) records the source, scheme, activation, dtype, d_model,
    d_ffn, layers and experts.
    """
    from ..api import extract as run

    m = run(path, Path(out), **options)
    emit(m, as_json, [m["summary"], *uploaded(m)])


def _gateup_command(name: str, fn, help_text: str, extra=()):
    @click.argument("path", type=CHECKPOINT)
    @output_options("Output file or directory. Default: beside the input, under a new name: DIR-split/ for a "
                    "directory or a file inside a checkpoint directory, model.split.safetensors for a lone file "
                    "(-fused / .fused for fuse).", required=False, json_help="Print a JSON summary of what was done.")
    @click.option("--dry-run", is_flag=True, help="Print the plan (every output tensor and how it is made) and the "
                  "estimate of the run: output bytes, temporary disk, peak RSS and time, from a sample of it run here "
                  "(a few seconds); write nothing.")
    @estimate_option
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
    def command(path, out, as_json, **options):
        r = fn(path, out, **options)
        lines = list(r["plan"] or []) if options["dry_run"] else []
        emit(r, as_json, [*lines, r["summary"], *r["changes"], *estimated(r), *uploaded(r)])

    command.__doc__ = help_text
    for decorator in extra:
        command = decorator(command)
    return click.command(name)(command)


def _split(*a, **k):
    from ..api import split_gateup

    return split_gateup(*a, **k)


def _fuse(*a, **k):
    from ..api import fuse_gateup

    return fuse_gateup(*a, **k)


split_gateup = _gateup_command("split-gateup", _split, """Split fused gate_up projections into gate_proj and up_proj.

    PATH is a .safetensors file, an index, a weights-only pickle or a directory. Phi-3 style mlp.gate_up_proj becomes
    mlp.gate_proj + mlp.up_proj; transformers-v5 stacked experts mlp.experts.gate_up_proj (E, 2I, H) and
    mlp.experts.down_proj (E, H, I) become per-expert tensors. Everything else is copied byte for byte;
    config.json, tokenizer and generation files are carried over.
    """)
fuse_gateup = _gateup_command("fuse-gateup", _fuse, """Fuse gate_proj and up_proj into one gate_up_proj (the inverse of split-gateup).

    Llama-style mlp.gate_proj + mlp.up_proj become mlp.gate_up_proj; per-expert MoE weights become
    per-expert fused tensors or, with --stack-experts, transformers-v5 stacked tensors
    mlp.experts.gate_up_proj (E, 2I, H) and mlp.experts.down_proj (E, H, I).
    """, extra=(click.option("--stack-experts", is_flag=True,
                             help="Stack routed experts into mlp.experts.gate_up_proj / down_proj, as transformers v5 "
                                  "stores them; dense MLPs and shared experts are left as they are."),))


@click.command()
@click.argument("base", type=CHECKPOINT)
@click.argument("adapter", type=CHECKPOINT)
@output_options()
@resume_option
@ray_option
@size_option
@scheme_options
def merge(base, adapter, out, as_json, **options):
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

    r = run(base, adapter, Path(out), **options)
    emit(r, as_json, [r["summary"], *r["changes"]])
