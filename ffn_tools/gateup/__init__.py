"""Plans for ``split-gateup`` and ``fuse-gateup``: move FFNs between the forms of their scheme.

Split: fused ``gate_up`` (per FFN, or experts stacked (E, 2I, H)) -> separate gate/up (per expert), or the
group's flat form (``stacks``) where it declares that before a separate one (DBRX).
Fuse: separate gate/up -> fused per FFN, or with ``stack_experts`` routed experts -> stacked (E, 2I, H); flat
experts always stack. Every output is a pure row rearrangement, so most entries carry byte pieces as well as
``compute``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from .. import quant
from ..detect import find_ffns
from ..checks.load import MissingClient
from ..clients import NotApplicable, runtime
from ..errors import FFNToolsError
from ..io.output import check_output
from ..io.readers import open_checkpoint
from ..io.store import Checkpoint
from ..layouts import GateUpLayout
from ..estimate import priced
from ..executor import check_shardable, execute
from ..io.run import NO_RUN, Run
from ..io.shards import like_input
from ..registry import Scheme
from .common import held_form_warning
from .fuse import plan_fuse
from .split import plan_split

__all__ = ["split_gateup", "fuse_gateup", "plan_split", "plan_fuse", "check_rewritable", "default_output"]


def default_output(path: Path, tag: str) -> Path:
    """A path that exists nowhere yet: model.split.safetensors beside a lone file; DIR-split/ beside a directory
    and beside a file that sits in a checkpoint directory (a config.json beside it): loaders read every
    *.safetensors of a directory, so a second weight file there would break the input for them."""
    path = Path(path).resolve()  # '.' has no name: resolve it first
    if path.is_file() and path.suffix == ".safetensors" and not (path.parent / "config.json").is_file():
        stem, suffix, parent = f"{path.stem}.{tag}", ".safetensors", path.parent
    else:
        d = path if path.is_dir() else path.parent
        stem, suffix, parent = f"{d.name}-{tag}", "", d.parent
    candidate, k = parent / f"{stem}{suffix}", 2
    while candidate.exists():
        candidate, k = parent / f"{stem}-{k}{suffix}", k + 1
    return candidate


def check_rewritable(ckpt: Checkpoint, command: str) -> None:
    """The rule of split-gateup and fuse-gateup, for the CLI and the Python API alike: they rewrite the tensors
    of a PyTorch checkpoint as stored, so other formats and MXFP4 experts are refused (exit 2).

    Raises:
        FFNToolsError: naming the format and the conversion to run first.
    """
    if not ckpt.rewritable:
        raise FFNToolsError(f"{ckpt.path}: is {ckpt.described} checkpoint; {command} works on PyTorch checkpoints: "
                            f"ffn-tools convert {ckpt.path} --to torch -o DIR first")
    by_scheme: dict = {}
    for m in quant.find(ckpt.stored).values():
        by_scheme.setdefault(m.scheme, []).append(m)
    for scheme, modules in by_scheme.items():
        scheme.check_rewritable(modules, ckpt.path, command)


def _run(command: str, plan_fn, source, out, *, scheme, layout, dry_run, force, max_shard_size, load_check,
         run: Run = NO_RUN, **kw) -> dict:
    """``source``: a path (opened here as PyTorch weights) or a checkpoint already open (the API's, any format)."""
    with ExitStack() as stack:
        ckpt = source if isinstance(source, Checkpoint) else stack.enter_context(open_checkpoint(Path(source)))
        path = Path(ckpt.path)
        check_rewritable(ckpt, command)
        ckpt = ckpt.stored  # tensors as stored: quantized parts move as they are
        packed = {n: m for n, m in quant.find(ckpt).items()  # FFNs found as read, parts moved by their scheme
                  if m.scheme.moves_parts}  # (FP8 weights and their scales: as fp8 moves them, below)
        seen = quant.DecodedView(ckpt, packed) if packed else ckpt
        plan = plan_fn(ckpt, find_ffns(seen, scheme, layout), **kw, **({"packed": packed} if packed else {}))
        out = Path(out) if out else default_output(path, "split" if command == "split-gateup" else "fused")
        check_shardable(out, max_shard_size)
        max_shard_size, sharded = like_input(ckpt.files, out, max_shard_size)
        plan.changes.extend([sharded] if sharded else [])
        summary = dict(plan.summary, output=str(out), dry_run=dry_run, changes=plan.changes,
                       plan=plan.describe() if dry_run else None)
        with ThreadPoolExecutor(1) as pool:  # the load check (importing transformers) overlaps the copy
            changed = summary.pop("form_changes")
            metadata = summary.pop("metadata", None)  # split-gateup's record of what it split (``SPLIT_FROM``)
            client = runtime(ckpt.format) if ckpt.format is not None and changed and load_check else None
            warning = pool.submit(client.load_warning, ckpt, plan, str(out)) if client else None
            made = run.but(out=out, force=force, max_shard_size=max_shard_size, desc=command, metadata=metadata)
            if dry_run:
                check_output(out, [path, *ckpt.files], force)
                summary.update(priced(plan, made))  # the estimate, where asked for: a sample of this plan streamed
            else:
                summary["files"] = execute(plan, made)
            # the load check, where it ran, says what transformers does; else the family's data, where it knows
            try:
                w = warning.result() if warning is not None else None
            except (MissingClient, NotApplicable) as e:  # asked for, but its client is not installed or has none:
                # said, and the data speaks
                summary["warnings"] = [*summary["warnings"], f"--load-check did not run: {e}"]
                warning = None
            if warning is None:
                w = None if out.suffix == ".safetensors" else held_form_warning(ckpt.config, changed, str(out))
            if w:  # (a single file beside its source is not what a client loads)
                summary["warnings"] = [*summary["warnings"], w]
        return summary


def split_gateup(path, out=None, *, scheme: Scheme | None = None, layout: GateUpLayout | None = None,
                 dry_run: bool = False, force: bool = False, max_shard_size: int | None = None,
                 load_check: bool = False, run: Run = NO_RUN) -> dict:
    """Split every fused gate_up tensor of a checkpoint into gate and up projections.

    Args:
        path: a .safetensors file, an index, or a checkpoint directory.
        out: output file or directory; default beside the input (``model.split.safetensors``, ``DIR-split``).
        scheme: naming scheme (detected when None).
        layout: the layout the fused tensors are stored in (the scheme's when None).
        dry_run: plan only; nothing is written.
        force: replace an existing output.
        max_shard_size: bytes per output shard (directory outputs).
        load_check: check that transformers loads the planned output under the config.json it carries, and
            warn, naming what it would not load, where it does not (imports transformers: off by default,
            since split and fuse otherwise run at the speed of a copy without it). Without it the family's data
            says where the model's own class holds its dense FFNs in another form (``held_form_warning``).
        run: the run's options from the command (``io.run.Run``: --resume, --ray, the receipt's record).

    Returns:
        A summary: scheme, layout, counts, output path, files (and the plan lines when ``dry_run``).
    """
    return _run("split-gateup", plan_split, path, out, scheme=scheme, layout=layout, dry_run=dry_run,
                force=force, max_shard_size=max_shard_size, load_check=load_check, run=run)


def fuse_gateup(path, out=None, *, scheme: Scheme | None = None, layout: GateUpLayout | None = None,
                stack_experts: bool = False, dry_run: bool = False, force: bool = False,
                max_shard_size: int | None = None, load_check: bool = False, run: Run = NO_RUN) -> dict:
    """Fuse gate and up projections into one gate_up tensor per FFN (the inverse of ``split_gateup``).

    Args are as for ``split_gateup``, plus ``stack_experts``: stack routed experts into transformers-v5
    tensors ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I).
    """
    return _run("fuse-gateup", plan_fuse, path, out, scheme=scheme, layout=layout, dry_run=dry_run,
                force=force, max_shard_size=max_shard_size, load_check=load_check, stack_experts=stack_experts,
                run=run)
