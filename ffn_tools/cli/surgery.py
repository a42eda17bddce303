"""The expert surgery commands: ``prune-experts`` and ``reorder-experts`` (``ffn_tools.surgery``)."""

from __future__ import annotations

import click

from ..options import CHECKPOINT, emit, scheme_options, size_option

SPEC = ("a list or range the same for every MoE layer (0,2,5 or 0-5), or a JSON file: a list, or {layer: "
        "[experts]} naming every MoE layer")


def _common(f):
    for option in reversed((
            click.option("-o", "--out", required=True, type=click.Path(),
                         help="Output directory (or a .safetensors file; for a GGUF input, a .gguf file)."),
            click.option("--dry-run", is_flag=True, help="Print the plan (every output tensor and how it is made); "
                                                         "write nothing."),
            click.option("--force", is_flag=True, help="Replace OUT if it exists."),
            click.option("--json", "as_json", is_flag=True, help="Print a JSON summary."))):
        f = option(f)
    return scheme_options(size_option(f))


def _emit(r: dict, as_json: bool) -> None:
    emit(r, as_json, [*(r["plan"] or []), r["summary"], *r["changes"]])


@click.command("prune-experts")
@click.argument("path", type=CHECKPOINT)
@click.option("--keep", help=f"Experts to keep: {SPEC}.")
@click.option("--drop", help=f"Experts to drop: {SPEC}.")
@click.option("--saliency", type=click.Path(exists=True, dir_okay=False),
              help="A scores file (what `ffn-tools saliency` writes): keep each layer's top experts by --score.")
@click.option("--keep-ratio", type=float, help="With --saliency: the fraction of each layer's experts kept (0.75).")
@click.option("--score", type=click.Choice(["reap", "frequency"]), default="reap", show_default=True,
              help="With --saliency: which score ranks the experts.")
@_common
def prune_experts(path, as_json, **options):
    """Keep some routed experts of each MoE layer of PATH (the same count per layer), renumbered in order.

    Kept experts move as stored bytes (per-expert tensors renamed, transformers-v5 stacks sliced), the router's
    rows (gate.weight, e_score_correction_bias, router biases) in step; shared experts and dense layers are
    copied. config.json's expert count is updated and num_experts_per_tok checked. The mapping new -> source
    expert is recorded in the weight files' metadata and expert_map.json; `ffn-tools verify PATH OUT` pairs the
    experts through it. A GGUF input's _exps stacks and router rows are sliced as stored bytes (any quant type),
    its expert_count set; the mapping is recorded in its metadata.
    """
    from ..surgery.run import prune_experts as run

    _emit(run(path, **options), as_json)


@click.command("reorder-experts")
@click.argument("path", type=CHECKPOINT)
@click.option("--order", required=True, help="JSON file: each MoE layer's experts in their new order (a list, the "
                                             "same for every layer, or {layer: [experts]}).")
@_common
def reorder_experts(path, as_json, **options):
    """Reorder the routed experts of each MoE layer of PATH (e.g. grouped by usage for expert parallelism): the
    experts and the router's rows moved together, so the model computes the same function exactly."""
    from ..surgery.run import reorder_experts as run

    _emit(run(path, **options), as_json)


@click.command("saliency")
@click.argument("path", type=CHECKPOINT)
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="The scores file (JSON) to write.")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False),
              help="Prompts: a JSON list of strings, or one a line (default: a small built-in set).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Each prompt cut to this many tokens.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the scores as JSON too.")
def saliency(path, out, prompts, max_tokens, force, as_json):
    """Score each routed expert of PATH on prompts, run by its client (transformers; mlx_lm for an MLX
    checkpoint): REAP's score (the mean, over the tokens routed to it, of its router weight times the norm of its
    output) and its routing frequency.
    `prune-experts PATH --saliency OUT --keep-ratio 0.75` keeps each layer's top experts by it."""
    from ..api import saliency as run

    r = run(path, out, prompts=prompts, max_tokens=max_tokens, force=force)
    emit(r, as_json, [r["summary"]])


COMMANDS = (prune_experts, reorder_experts, saliency)
