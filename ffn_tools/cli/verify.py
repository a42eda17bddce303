"""The ``ffn-tools verify`` command: parse, call ``ffn_tools.api.verify``, print, exit 0/1/2.

Its shared options come from ``ffn_tools.options``, as the other commands' do. Only click and torch-free core
modules are imported here; torch and the kernels load when the command runs.
"""

from __future__ import annotations

import json

import click

from ..checks.agreement import DEFAULT_PROFILE, PROFILES
from ..checks.prompts import NEW_TOKENS
from ..options import CHECKPOINT, emit, layout_options, layout_options_for, ray_flag, scheme_options
from ..tolerances import HELP as TOLERANCE_HELP
from ..verification.options import DEFAULT_TOKENS

# what verify of LoRA adapters takes (``adapters.verify``); the other options are refused there
ADAPTER_OPTIONS = ("a", "b", "tokens", "seed", "as_json", "backends", "scheme_name", "scheme_file", "gate", "up", "down",
                   "gate_up")
PROFILE_NAMES = tuple(PROFILES)
BACKEND_NAMES = "reference, triton, metal, mlx, jax"


# B's fused gate_up layout, resolved into ``b_layout`` (None: none given, B's is A's).
b_layout_options = layout_options_for(
    "b-", "b_layout",
    "B's fused gate_up layout, when it differs from A's (say A concat-fused like Phi-3, B interleaved): with any "
    "--b-* option --layout/--order/--tp apply to A only.",
    "B's order of gate and up. Default: gate-up.", "B's tensor-parallel degree for --b-layout tp.")


@click.command("verify", epilog=TOLERANCE_HELP)
@click.argument("a", type=CHECKPOINT, required=False)
@click.argument("b", type=CHECKPOINT, required=False)
@click.option("--receipt", "receipt", type=click.Path(), metavar="OUT",
              help="Check the output OUT (a directory or file ffn-tools wrote) against the receipt it carries, without "
                   "A: every file there with its size and BLAKE3 digest, no file it does not list. Exit 1 on any "
                   "difference. Give no A and B with it.")
@click.option("--backend", "backends", multiple=True, metavar="NAME",
              help=f"Kernel backend to run B's FFNs on, one of {BACKEND_NAMES}; repeat for several; 'all': every one "
                   "available on this machine. Default: the float64 reference and the kernels of B's runtime that "
                   "run natively here (Triton for a PyTorch B on CUDA, MLX and Metal for an MLX B, JAX for a Flax "
                   "B); the report says which ran and why the others did not.")
@click.option("--tokens", type=click.IntRange(min=1), default=DEFAULT_TOKENS, show_default=True,
              help="Rows of the random input each FFN is run on.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs and token batch.")
@click.option("--layers", help="Layers to verify, e.g. 0-3,7 (default: all). A sharded A or B may then lack the "
              "shards that hold none of these layers' FFNs (verify a large pair by range on several machines); "
              "the load check and logits need every shard and say they did not run.")
@click.option("--shards-needed", is_flag=True, help="Print the shard files of A and of B that hold the FFNs of "
              "--layers (and --experts), read from their indexes alone, and verify nothing: what a machine "
              "verifying that range must hold, besides each side's index, config.json and tokenizer files.")
@click.option("--experts", help="Routed experts to verify, e.g. 0,5 (default: all; dense and shared FFNs "
              "are kept).")
@click.option("--atol", type=click.FloatRange(min=0), help="Absolute tolerance, in units of the RMS of the "
              "reference output (default: from the table below).")
@click.option("--rtol", type=click.FloatRange(min=0), help="Relative tolerance (default: from the table below).")
@click.option("--exact/--no-exact", default=None,
              help="Demand (or skip) bit-identical canonical gate/up/down and biases. Default: demanded where "
                   "both sides should be lossless copies (same dtype, neither quantized).")
@click.option("--logits", is_flag=True, help="Also run both whole models on a fixed token batch through their "
              "real clients (transformers for PyTorch, mlx_lm for MLX directories) and compare the logits.")
@click.option("--generate", is_flag=True, help="Also run both models on prompts, each through its own client "
              "(transformers, mlx_lm, llama.cpp; its tokenizer and chat template, greedy decoding, its stop ids), and "
              "compare them token by token: KL(A||B) and KL(B||A) mean/p99/max, top-1 and top-5 agreement, where "
              "greedy decoding first diverges, whether both stop at the same token, whether both tokenize the "
              "prompts alike; each held against the same statistics between A and A re-derived in B's form (its "
              "dtype, quantization, format; run by B's client): the noise floor. Costs one model load and one "
              "forward pass per token per side and for the floor.")
@click.option("--locate", is_flag=True, help="Also say where B parts from A: both models run on a seeded token batch "
              "with hooks in their clients, and every part of every layer (norms, attention, the hidden state after "
              "it, router logits and top-k choice, shared and routed experts, the FFN block, the hidden state after "
              "it) is compared with A's and held against its own floor (A in B's form, as --generate's); the first "
              "part that leaves its floor is named, with a per-layer table (--json: every figure).")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), metavar="FILE",
              help="With --locate: also draw its per-layer table as a small SVG image at FILE.")
@click.option("--prompts", "prompts", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="With --generate: prompts to run instead of the built-in ten (English, CJK, Hangul, Arabic, code, "
                   "a tool call): one per line, a JSON list, or JSON "
                   "lines with a \"prompt\" field.")
@click.option("--new-tokens", type=click.IntRange(min=1), default=NEW_TOKENS, show_default=True,
              help="With --generate: greedy tokens generated per prompt (A's continuation, which B is scored on).")
@click.option("--profile", type=click.Choice(PROFILE_NAMES), default=DEFAULT_PROFILE, show_default=True,
              help="With --generate: how far above its noise floor a statistic may be. strict: not at all (B's "
                   "logits as the floor's); standard: 2x + 1e-7 nats / 1 position; relaxed: 5x + 1e-5 nats / 3 "
                   "positions. Prompts tokenized otherwise or stopping otherwise fail above the floor's count in "
                   "every profile.")
@click.option("--client", "client", metavar="NAME",
              help="The runtime that judges B, one of those that load B's format (the load check, config, side files "
                   "and tokenizer as it reads them, its kernels, --logits and --generate run by it). Default: the "
                   "format's first (transformers for PyTorch, mlx_lm for MLX, llama.cpp for GGUF).")
@click.option("--allow-unmatched", is_flag=True, help="Pass even when tensors that look like FFN projections "
              "(mlp/ffn/expert + gate/up/down/w1/fc...) belong to no FFN found; by default they fail the check, "
              "since they were never run.")
@click.option("--ffn-only", is_flag=True, help="Compare the FFNs only. By default every tensor outside them "
              "(embeddings, attention, norms) is compared too: bit for bit where lossless, within the tolerance "
              "row where not, and a tensor on one side only fails.")
@click.option("--load-check/--no-load-check", default=True, show_default=True,
              help="Check that B would load in its real client (transformers on the meta device, mlx_lm "
                   "lazily): every parameter provided, nothing left over, shapes equal.")
@click.option("--allow-config", "allow_config", multiple=True, metavar="KEY",
              help="Accept a difference in this config key on purpose (a dotted key such as "
                   "rope_parameters.rope_theta, or its top-level key); repeat for several. By default every key "
                   "the clients read that differs fails.")
@click.option("--unbounded", is_flag=True,
              help="Fail also a setting the clients run otherwise only past a sequence length. By default such a "
                   "pair passes (mlx_lm attending to every token where transformers' Mistral slides a 4096-token "
                   "window), and the verdict says the length up to which the two are equivalent.")
@click.option("--side-files/--no-side-files", default=True, show_default=True,
              help="Compare the files a client reads beside the weights: tokenizer (vocabulary, merges, added "
                   "and special tokens), tokenizer_config (chat template), special_tokens_map, "
                   "generation_config. Present in A and missing or different in B fails.")
@click.option("--all-ffns-on-every-backend", is_flag=True,
              help="Run every FFN on every backend. By default every FFN runs on the float64 reference (which "
                   "proves the weights) and each other backend runs the first FFN of each kind (shape, form, "
                   "layout, dtype, quantization), which proves its kernels; the report says what ran where.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of a table.")
@click.option("--resume", is_flag=True, help="Continue a killed verify of the same pair with the same options: the "
              "FFN steps it had finished (kept in the ffn-tools cache, ~/.cache/ffn-tools/verify/ by default, removed "
              "when a verify ends) are reused, the rest run; the report is an uninterrupted run's but for those "
              "steps' wall times.")
@ray_flag("Verify the FFN pairs as Ray tasks, each where its tensors' files are: on the Ray cluster at ADDRESS "
          "(--ray=ADDRESS), or, alone, on a Ray started here on every core. This process keeps the first FFN of each "
          "kind (the kernel backends run it) and every check that is not an FFN pair; the report is a one-node run's. "
          "Needs the ray extra.")
@scheme_options
@layout_options
@b_layout_options
def verify(a, b, receipt, shards_needed, as_json, resume, ray, locate, plot, **options):
    """Check that checkpoint B holds the same FFNs as checkpoint A.

    A and B are any checkpoints ffn-tools reads (PyTorch safetensors or pickles, split or fused, MLX plain
    or quantized, Flax, an extract output). FFNs are paired by layer and expert; one present on one side
    only fails. For each pair, the canonical gate/up/down (and biases) must be bit-identical where both
    sides should be lossless copies (where B is MLX-quantized and A is not: A's tensors quantized with B's
    parameters must give B's stored bytes), and the FFN is run on seeded random inputs: A's on the float64
    reference, B's on every backend, in B's dtype, with fused gate_up checkpoints going through the fused
    kernel. The activation is each checkpoint's own (SwiGLU, or GeGLU where config.json says so).

    A passes when every element is within atol·rms + rtol·|reference| and the cosine similarity is high
    enough; the tolerances depend on the coarser dtype and on quantization (table below). --layout,
    --order and --tp say how fused gate_up tensors are laid out, in both checkpoints; when B's layout
    differs from A's, give B's with --b-layout, --b-order and --b-tp (the plain options then apply to
    A only). --layers and --experts naming layers or experts neither checkpoint has are refused.

    Beyond the tensors, B must be the same model: both config.json files are read by their clients' own
    readers (transformers' config class; for MLX also mlx_lm's ModelArgs, against what an export of A gives
    mlx_lm) and compared key by key (--allow-config KEY accepts one difference); B's config dtype must not
    cast its stored weights lossily; the tokenizer and generation files must match (--no-side-files skips
    them); and B must load in its client (a client that refuses B's config fails; without transformers the
    check says it did not run; a missing mlx_lm or llama.cpp is exit 2). The report names every check that did
    not run.

    Prints a table, worst FFN first, and a verdict. Exit status: 0 all pass, 1 something differs,
    2 verification could not run (bad arguments, unreadable input, no FFNs, backend unavailable), or a check
    asked for could not run here (--logits a client cannot run): then the report says so beside the others.

    With --generate, both models also run on prompts through their own clients and are compared token by
    token against a noise floor measured in the same run: the same statistics between A and A re-derived in
    B's form (or A in B's dtype, or A run again). The report has one line per prompt and a verdict naming
    the floor; a floor that cannot be measured (B's quantization is not one ffn-tools writes) leaves the
    statistics reported and the check not judged (exit 2, as a check that could not run), never passed.

    With --layers, A and B may each hold only some of their shards: the shards holding the selected layers'
    FFNs must be there (else exit 2 names the missing ones; --shards-needed lists them before any
    download), the others may be absent, and the report names them. Without --layers every shard an
    index names must be there.

    verify --receipt OUT checks an output of ffn-tools against the receipt every output carries
    (ffn-tools-receipt.json inside a directory, OUT.ffn-tools-receipt.json beside a file): each file's size and
    BLAKE3 digest, without A. The receipt also names the command, its options and every source file's digest.
    """
    if receipt is not None or a is None or b is None:
        _receipt(receipt, a, b, as_json)
        return
    from ..adapters.verify import involves_adapters

    if involves_adapters(a, b):
        from ..api import verify as run_adapters

        ctx = click.get_current_context()
        given = [p.opts[-1] for p in ctx.command.params if p.name not in ADAPTER_OPTIONS and p.opts[-1].startswith("-")
                 and ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"{', '.join(given)} do not apply to verifying LoRA adapters (their verify takes "
                                   "--backend, --tokens, --seed and the scheme options)")
        report = run_adapters(a, b, tokens=options["tokens"], seed=options["seed"], scheme=options["scheme"],
                              backends=list(options["backends"]) or None)
        if as_json:
            click.echo(json.dumps({"command": "verify", "input": [a, b], "output": None, "summary": report.verdict,
                                   "warnings": [], **report.as_dict()}, indent=2, default=str))
        else:
            for line in report.lines():
                click.echo(line)
        click.get_current_context().exit(0 if report.passed else 1)
    if shards_needed:
        if not options["layers"]:
            raise click.UsageError("--shards-needed lists the shards a --layers range needs; give --layers")
        from ..api import shards_needed as needs

        r = needs(a, b, layers=options["layers"], experts=options["experts"], scheme=options["scheme"])
        emit(r, as_json, [*r["lines"], r["summary"]])
        return
    from .. import progress
    from ..api import verify as run

    # could-not-run (FFNToolsError) becomes exit 2 and one line in cli.Group, as for every command; until the FFN
    # steps' progress bar, the terminal says what runs (seconds: torch's import, the load check's model)
    with progress.doing("verify: opening A and B (importing torch), then the load check, configs and tokenizers"):
        # the library's options under the command's names (``VerifyOptions``); unbounded None: not given, as
        # the adapters' verify takes it
        report = run(a, b, **{**options, "backends": list(options["backends"]) or None,
                              "unbounded": options["unbounded"] or None}, ray=ray, resume=resume)
    if plot and not locate:
        raise click.UsageError("--plot FILE draws --locate's table: give --locate")
    located, status = _locate(a, b, options, plot) if locate else (None, report.exit_status)
    if as_json:
        from ..api import json_of

        click.echo(json.dumps({**json_of(report), **({"locate": located} if locate else {})}, indent=2, default=str))
    else:
        for line in report.lines():
            click.echo(line)
        for line in (located or {}).get("lines", []):
            click.echo(line)
    click.get_current_context().exit(max(report.exit_status, status))


def _locate(a, b, options, plot: str | None = None) -> tuple[dict, int]:
    """``verify --locate`` (``verification.locate``): its figures and lines, and its exit status (1: B parts from A;
    2: it could not run or had no floor)."""
    from ..errors import FFNToolsError
    from ..formats import registry
    from ..hub import resolve
    from ..verification.locate import locate

    try:
        r = locate(resolve(str(a)), resolve(str(b)), opener=registry().open_sides, converter=registry().convert,
                   client=options["client"], seed=options["seed"], allow_config=options["allow_config"])
    except FFNToolsError as e:
        return {"passed": None, "error": str(e), "lines": [f"--locate: could not run: {e}"]}, 2
    lines = r.lines()
    if plot:
        from ..verification.locate_plot import write_svg

        lines.append(f"  plot: {write_svg(r, plot)}")
    return {**r.as_dict(), "lines": lines, "plot": plot}, {True: 0, False: 1, None: 2}[r.passed]


def _receipt(out, a, b, as_json) -> None:
    """``verify --receipt OUT``: the output against its receipt; A and B refused with it, and required without it."""
    if out is None:
        raise click.UsageError("give A and B (verify B against A), or --receipt OUT (an output against its receipt)")
    if a is not None:
        raise click.UsageError("--receipt OUT checks an output against its own receipt: give no A or B with it")
    from ..api import verify_receipt

    r = verify_receipt(out)
    emit(r, as_json, r["lines"])
    click.get_current_context().exit(0 if r["passed"] else 1)
