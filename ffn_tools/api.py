"""The library as the command line is: every command a function taking paths (or Hub ids, ``org/name[@rev]``)
and returning what its ``--json`` prints (``verify`` returns its report; ``json_of(report)`` is that JSON).

Every command's JSON starts with the same keys (``envelope``): ``command``, ``input`` (a list for verify),
``output`` (None when nothing is written), ``summary`` (the one line the text output ends with) and
``warnings``; the command's own fields follow.

    import ffn_tools
    ffn_tools.inspect("./phi3")["ffn"]                 # what `ffn-tools inspect ./phi3 --json` prints
    ffn_tools.split_gateup("./phi3", "./phi3-split")
    ffn_tools.convert("./phi3", "mlx", "./phi3-mlx", quantize=4)
    assert ffn_tools.verify("./phi3", "./phi3-mlx").passed

Every writing command also takes ``ray=`` (an address, or ``"local"``: ``--ray``) and, with ``dry_run=True``,
``estimate=`` (``--no-estimate`` is ``estimate=False``); ``verify`` takes ``ray=``, ``verify_receipt(out)`` is
``verify --receipt OUT``.
"""

from __future__ import annotations

import functools
from inspect import signature as _signature
from pathlib import Path

from . import cluster
from . import estimate as estimates
from .envelope import ENVELOPE, envelope  # noqa: F401  (the keys every command's JSON starts with)
from .errors import FFNToolsError, counted
from .formats import registry
from .hub import resolve
from .io.receipt import record
from .io.run import Run


def _command(command: str):
    """A writing command: run with ``command`` and the arguments it was given recorded in its output's receipt
    (``io.receipt``); under ``dry_run``, the estimate of the real run added (``estimate``; ``estimate=False``: none);
    ``ray``: the output's shards written as Ray tasks (``cluster``; an address, or ``"local"``)."""
    def wrap(fn):
        signature = _signature(fn)

        @functools.wraps(fn)
        def run(*args, estimate: bool | None = None, ray: str | None = None, **kwargs):
            given = dict(signature.bind(*args, **kwargs).arguments)
            given.update(given.pop("options", {}))
            # the run's options as one value, handed down to the one executor (``io.run``): no ambient state
            run = Run(command=record(command, given), ray=ray, resume=bool(given.get("resume")))
            if given.get("dry_run") and estimates.wanted(estimate):  # the dry run prices its plan (``estimate``)
                run = run.but(estimate=estimates.began())
            r = fn(*args, run=run, **kwargs)
            if run.estimate is not None and r.get("output") and "estimate" not in r:
                r = {**r, "estimate": estimates.NOT_STREAMED}  # written by its own writer (GGUF): no plan to price
            return r

        return run

    return wrap


def _published(r: dict, upload_repo: str | None) -> dict:
    """``r`` with ``uploaded`` (the repo URL) once its output is pushed to ``upload_repo`` (see ``upload``)."""
    if upload_repo is None:
        return r
    from .upload import upload

    return {**r, "uploaded": upload(Path(r["output"]), upload_repo, r["command"])}


def _upload_first(upload_repo: str | None, dry_run=False) -> None:
    """Check ``--upload-repo`` before anything is written."""
    if upload_repo is None:
        return
    from .errors import FFNToolsError
    from .upload import check_repo_id

    if dry_run:
        raise FFNToolsError("--upload-repo with --dry-run: nothing is written, so nothing can be uploaded")
    check_repo_id(upload_repo)


def json_of(report) -> dict:
    """A verify report as ``ffn-tools verify --json`` prints it."""
    return envelope("verify", [report.a["path"], report.b["path"]], None, report.verdict, report.as_dict())


def _inspect_line(s: dict) -> str:
    kinds = ", ".join(f"{k['count']} {kind}" for kind, k in s["ffn"].items())
    ffns = "FFN" if sum(k["count"] for k in s["ffn"].values()) == 1 else "FFNs"
    return f"{s['architecture']}: {kinds} {ffns} under scheme {s['scheme']}, {counted(s['tensors'], 'tensor')}"


def _adapter_options(path, command: str, given: dict, allowed: tuple[str, ...]) -> dict | None:
    """None where ``path`` is a checkpoint; for a LoRA adapter (the command then runs ``adapters.api``'s) the
    options of ``given`` it takes (``allowed``), refusing the others it was given (not None, False or empty):
    they apply to checkpoints only."""
    from .adapters.formats import is_adapter

    if not is_adapter(path):
        if given.get("base") is not None:
            raise FFNToolsError("base= is for a LoRA adapter; this is a checkpoint", flags={"base=": "--base"})
        return None
    return _taken(command, given, allowed)


def _taken(command: str, given: dict, allowed: tuple[str, ...]) -> dict:
    """The options of ``given`` a command of LoRA adapters takes (``allowed``); the others it was given refused."""
    wrong = sorted(k for k, v in given.items() if k not in allowed and v not in (None, False, (), []))
    if wrong:
        raise FFNToolsError(f"{', '.join(f'{k}=' for k in wrong)} do not apply to {command} of a LoRA adapter",
                            flags={f"{k}=": "--" + k.replace("_", "-") for k in wrong})
    return {k: v for k, v in given.items() if k in allowed}


# the options each command takes for a LoRA adapter (``adapters.api``)
ADAPTER_OPTIONS = {"inspect": ("base", "scheme"), "relayout": ("force", "scheme", "dry_run", "stack_experts"),
                   "convert": ("base", "force", "scheme", "outtype"), "verify": ("tokens", "seed", "scheme", "backends")}


def inspect(path, *, scheme=None, layout=None, tensors: bool = False, base=None) -> dict:
    """``ffn-tools inspect PATH --json``: architecture, scheme, FFNs, sizes (and every tensor with ``tensors``).
    A LoRA adapter: what each LoRA targets (``adapters.api.inspect``; ``base``: which of its FFNs get none)."""
    open_any = registry().open_any

    given = {"layout": layout, "tensors": tensors, "base": base, "scheme": scheme}
    if (kw := _adapter_options(path, "inspect", given, ADAPTER_OPTIONS["inspect"])) is not None:
        from .adapters.api import inspect as adapter_inspect

        return adapter_inspect(path, **kw)

    from .summary import inspect_checkpoint

    with open_any(resolve(str(path))) as ckpt:
        s = inspect_checkpoint(ckpt, scheme, layout, tensors=tensors)
    return envelope("inspect", str(path), None, _inspect_line(s), s)


@_command("extract")
def extract(path, out, *, layers: str | None = None, experts: str | None = None, scheme=None, layout=None,
            force: bool = False, max_shard_size: int | None = None, upload_repo: str | None = None,
            resume: bool = False, run: Run = Run()) -> dict:
    """``ffn-tools extract PATH -o OUT --json``: the FFNs alone, canonical names; returns the manifest.
    ``upload_repo``: push the output to that Hub repo afterwards (every writing command takes it); ``resume``:
    continue what a killed run of the same command left (``io.resume``; every writing command takes it); ``run``: the
    run's options the command wrapper made (``io.run.Run``)."""
    open_any = registry().open_any

    from .extraction import extract as extracting

    _upload_first(upload_repo)
    with open_any(resolve(str(path))) as ckpt:
        m = extracting(ckpt, Path(out), layers=layers, experts=experts, scheme=scheme, layout=layout, force=force,
                       max_shard_size=max_shard_size, run=run)
    line = f"wrote {out}: {counted(m['ffns'], 'FFN')}, {counted(m['tensors'], 'tensor')} ({m['dtype']})" + (
        f"; {m['dequantized']}" if m.get("dequantized") else "")
    return _published(envelope("extract", str(path), out, line, m), upload_repo)


@_command("split-gateup")
def split_gateup(path, out=None, *, upload_repo: str | None = None, resume: bool = False, run: Run = Run(),
                **options) -> dict:
    """``ffn-tools split-gateup PATH [-o OUT] --json`` (options as ``gateup.split_gateup``)."""
    open_any = registry().open_any

    from .gateup import split_gateup as rewrite

    if (kw := _adapter_options(path, "split-gateup", {**options, "upload_repo": upload_repo, "resume": resume},
                               ADAPTER_OPTIONS["relayout"])) is not None:
        from .adapters.api import relayout

        return relayout("split-gateup", path, out, run=run, **kw)
    _upload_first(upload_repo, options.get("dry_run"))
    with open_any(resolve(str(path))) as ckpt:  # any format: its rule refuses what it cannot
        r = rewrite(ckpt, out, run=run, **options)
    return _published(_gateup("split-gateup", path, r), upload_repo)


@_command("fuse-gateup")
def fuse_gateup(path, out=None, *, upload_repo: str | None = None, resume: bool = False, run: Run = Run(),
                **options) -> dict:
    """``ffn-tools fuse-gateup PATH [-o OUT] --json`` (options as ``gateup.fuse_gateup``)."""
    open_any = registry().open_any

    from .gateup import fuse_gateup as rewrite

    if (kw := _adapter_options(path, "fuse-gateup", {**options, "upload_repo": upload_repo, "resume": resume},
                               ADAPTER_OPTIONS["relayout"])) is not None:
        from .adapters.api import relayout

        return relayout("fuse-gateup", path, out, run=run, **kw)
    _upload_first(upload_repo, options.get("dry_run"))
    with open_any(resolve(str(path))) as ckpt:
        r = rewrite(ckpt, out, run=run, **options)
    return _published(_gateup("fuse-gateup", path, r), upload_repo)


def _gateup(command: str, path, r: dict) -> dict:
    verb = "would write" if r.get("dry_run") else "wrote"
    line = (f"{verb} {r['output']}: {r['ffns_changed']} of {counted(r['ffns_total'], 'FFN')} ({r['layout']}), "
            f"{counted(r['tensors_out'], 'tensor')}")
    return envelope(command, str(path), r["output"], line, r)


@_command("convert")
def convert(path, to: str, out, *, upload_repo: str | None = None, resume: bool = False, run: Run = Run(),
            **options) -> dict:
    """``ffn-tools convert PATH --to FORMAT -o OUT --json`` (options as ``converters.convert``)."""
    converting = registry().convert

    if (kw := _adapter_options(path, "convert", {**options, "upload_repo": upload_repo, "resume": resume},
                               ADAPTER_OPTIONS["convert"])) is not None:
        from .adapters.api import convert as adapter_convert

        return adapter_convert(path, to, out, run=run, **kw)
    options.pop("base", None)
    _upload_first(upload_repo, options.get("dry_run"))
    r = converting(resolve(str(path)), to, Path(out), run=run, **options)
    verb = "would write" if options.get("dry_run") else "wrote"
    line = r.get("summary") or f"{verb} {r['output']} ({to})"  # a converter's own line says more (GGUF's does)
    return _published(envelope("convert", str(path), r["output"], line, r), upload_repo)


def shards_needed(a, b, *, layers: str, experts: str | None = None, scheme=None) -> dict:
    """``ffn-tools verify A B --layers R --shards-needed --json``: the shard files of A and of B that hold the
    FFNs of the range, read from their indexes alone (``verification.partial``): what a machine verifying
    that range must hold, beside the index and the non-weight files (config.json, tokenizer)."""
    from .specs import parse_spec
    from .verification.partial import shards_needed as needs

    sel_layers, sel_experts = parse_spec(layers), parse_spec(experts) if experts else None
    sides = {s: needs(resolve(str(p)), sel_layers, sel_experts, scheme) for s, p in (("A", a), ("B", b))}
    summary = (f"--layers {layers} needs " + " and ".join(f"{len(n.needed)} of {n.total} weight files of {s}"
                                                         for s, n in sides.items())
               + " (and each side's index, config.json and tokenizer files)")
    return envelope("verify", [str(a), str(b)], None, summary,
                    {"layers": layers, "experts": experts, "lines": [n.line(s) for s, n in sides.items()],
                     **{s.lower(): n.as_dict() for s, n in sides.items()}})


@_command("merge")
def merge(base, adapter, out, *, resume: bool = False, run: Run = Run(), **options) -> dict:
    """``ffn-tools merge BASE ADAPTER -o OUT --json``: the LoRA merged into the base (``adapters.merge``)."""
    from .adapters.api import merge as merging

    return merging(resolve(str(base)), adapter, out, run=run, **options)


def verify_receipt(out) -> dict:
    """``ffn-tools verify --receipt OUT --json``: every file of an output against the receipt it carries (sizes and
    BLAKE3 digests; ``checks.receipt``), without the source; ``passed`` says whether it is what its receipt says."""
    from .checks.receipt import check

    c = check(out)
    return envelope("verify", [str(out)], None, c.summary(), {"lines": c.lines(), **c.as_dict()})


def verify(a, b, **options):
    """``ffn-tools verify A B``: the report (``.passed``, ``.lines()``, ``.as_dict()`` = the --json); A and B of
    any format the registry reads (``converters.open_sides``). ``verify("BASE+ADAPTER", MERGED)`` and
    ``verify(ADAPTER, ADAPTER2)`` verify adapters (``adapters.verify``: ``tokens``, ``seed``, ``scheme`` and
    ``backends`` apply)."""
    converting, open_sides = registry().convert, registry().open_sides

    from .adapters.verify import involves_adapters

    if involves_adapters(str(a), str(b)):
        from .adapters.api import verify as adapter_verify

        return adapter_verify(a, b, **_taken("verify", options, ADAPTER_OPTIONS["verify"]))

    from .verification import ledger

    ray, resume = options.pop("ray", None), bool(options.pop("resume", False))
    a, b = resolve(str(a)), resolve(str(b))
    steps = (ledger.key(a, b, options), resume)  # the FFN steps' ledger (--resume), handed down as data
    with cluster.linked(ray) as link:  # --ray: connecting to Ray while the engine's imports (torch) run
        from .verification.engine import verify as run

        return run(a, b, opener=open_sides, converter=converting, ray=link, ledger=steps, **options)


def prune_experts(path, out, **options) -> dict:
    """``ffn-tools prune-experts PATH -o OUT --json``: ``keep=`` / ``drop=`` (a spec or a JSON file), or
    ``saliency=`` (a scores file) with ``keep_ratio=`` and ``score=``; ``force``, ``dry_run``, ``max_shard_size``,
    ``scheme``, ``layout`` (``surgery.run.prune_experts``)."""
    from .surgery.run import prune_experts as run

    return run(path, out, **options)


def reorder_experts(path, out, *, order, **options) -> dict:
    """``ffn-tools reorder-experts PATH --order FILE -o OUT --json`` (``surgery.run.reorder_experts``)."""
    from .surgery.run import reorder_experts as run

    return run(path, out, order=order, **options)


def saliency(path, out=None, *, prompts=None, max_tokens: int = 512, force: bool = False) -> dict:
    """``ffn-tools saliency PATH -o OUT --json``: each MoE layer's experts' REAP score and routing frequency on
    ``prompts`` (a file; None: the built-in set), the scores file written to ``out`` (None: returned only; what
    ``prune_experts(saliency=OUT)`` reads).

    Raises:
        FFNToolsError: ``out`` exists and not ``force``.
    """
    import json

    from .surgery.saliency import saliency as run

    if out is not None and Path(out).exists() and not force:
        raise FFNToolsError(f"{out} exists: --force replaces it")
    scores = run(resolve(str(path)), prompts=prompts, max_tokens=max_tokens)
    if out is not None:
        Path(out).write_text(json.dumps(scores, indent=1) + "\n")
    line = (f"{'wrote ' + str(out) if out is not None else 'scored'}: {len(scores['layers'])} MoE layers scored on "
            f"{scores['tokens']} tokens")
    return envelope("saliency", str(path), None if out is None else str(out), line, scores)


def locate(a, b, *, client: str | None = None, seed: int = 0, allow_config=()):
    """``ffn-tools verify A B --locate``: where B's computation first leaves A's, layer by layer, against the
    floor re-derived from A (``verification.locate``): its result (``.passed``, ``.lines()``, ``.as_dict()``).

    Raises:
        FFNToolsError: a side cannot be read, or run as a whole model here.
    """
    from .verification.locate import locate as run

    return run(resolve(str(a)), resolve(str(b)), opener=registry().open_sides, converter=registry().convert,
               client=client, seed=seed, allow_config=allow_config)
