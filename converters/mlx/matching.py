"""Which view of the input gives mlx_lm's model exactly its parameters: the export's own function from a Hugging
Face checkpoint to an MLX model's tensors (``match``), used by the export, by reading an MLX model back
(``inverse``) and by verify (``mlx_entries``: A as mlx_lm loads it).

The input is tried as it is, then with its FFNs split, fused, or its experts stacked (``gateup``'s plans: byte
copies), then with its FP8 weights dequantized; mlx_lm's own model class and ``sanitize`` decide (``names``).
"""

from __future__ import annotations

from functools import partial
from typing import TypedDict

from ffn_tools import quant
from ffn_tools.detect import find_ffns
from ffn_tools.errors import FFNToolsError, NothingToDoError, listing
from ffn_tools.gateup import plan_fuse, plan_split
from ffn_tools.io.store import Checkpoint
from ffn_tools.ops import Transpose
from ffn_tools.plan import Entry, copy_entry

from . import from_fp8
from . import names as mlx_names
from .models import Target, parameters, target
from .tensors import plan_outputs

HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _views(ckpt: Checkpoint):
    """The input as the model may want it: as it is, FFNs split, FFNs fused (name, entries)."""
    yield "as it is", [copy_entry(ckpt, n) for n in ckpt]
    try:
        ffns = find_ffns(ckpt)
    except FFNToolsError:
        return
    stacked = partial(plan_fuse, stack_experts=True)
    for label, fn in (("with gate_up split", plan_split), ("with gate/up fused", plan_fuse),
                      ("with gate/up fused and experts stacked", stacked)):
        try:
            yield label, fn(ckpt, ffns).entries
        except NothingToDoError:
            continue
        except FFNToolsError:
            continue
    if any(f.form.transposed for f in ffns.ffns):
        yield "with stacked experts turned to (E, out, in) .weight", _out_in(ckpt, ffns)


def _out_in(ckpt: Checkpoint, ffns) -> list[Entry]:
    """Stacked experts stored (E, in, out) (transformers' GPT-OSS) as OpenAI's layout, (E, out, in) named
    ``.weight``, which mlx_lm's GPT-OSS sanitize reads; everything else as it is."""
    turned = {f.names[r] for f in ffns.ffns if f.form.transposed and f.index is not None for r in ("gate_up", "down")
              if r in f.names}
    out = []
    for n in ckpt:
        if n not in turned:
            out.append(copy_entry(ckpt, n))
            continue
        info = ckpt.info(n)
        out.append(Entry(f"{n}.weight", info.st_dtype, (info.shape[0], info.shape[2], info.shape[1]), (n,),
                         (Transpose(1, 2),), sources=((info.st_dtype, tuple(info.shape)),),
                         text=f"{n} turned to (E, out, in)"))
    return out


def _problems(tg: Target, outputs, ckpt: Checkpoint) -> tuple[list[str], list[str], int]:
    """(what does not match the model's parameters, changes, how many tensors that is) for one view's outputs."""
    got = {o.name: o.shape for o in outputs}
    missing = sorted(set(tg.params) - set(got))
    extra = sorted(set(got) - set(tg.params))
    changes = []
    if extra == [HEAD] and HEAD not in tg.params and EMBED in ckpt and HEAD in ckpt:
        same = ckpt.info(HEAD).shape == ckpt.info(EMBED).shape and _bytes(ckpt, HEAD) == _bytes(ckpt, EMBED)
        if same:
            extra = []
            changes.append(f"dropped {HEAD}: it equals {EMBED} byte for byte, and mlx_lm's {tg.module} model ties "
                           "its output head to the embedding")
        else:
            return [f"{HEAD} differs from {EMBED} but mlx_lm's {tg.module} model always ties its output head to the "
                    "embedding, so it would compute different logits; tie the head or use another format"], [], 1
    bad = [f"{n}: {list(got[n])}, model wants {list(tg.params[n])}" for n in sorted(got)
           if n in tg.params and tuple(got[n]) != tuple(tg.params[n])]
    out = []
    if missing:
        out.append(f"missing {len(missing)} parameter(s) mlx_lm's {tg.module} model has: {listing(missing)}")
    if extra:
        out.append(f"{len(extra)} tensor(s) mlx_lm's {tg.module} model has no parameter for: {listing(extra)}")
    if bad:
        out.append(f"{len(bad)} shape(s) differ: {listing(bad)}")
    return out, changes, len(missing) + len(extra) + len(bad)


def _bytes(ckpt: Checkpoint, name: str) -> bytes:
    return bytes(ckpt.read_raw(name))


def match(ckpt: Checkpoint, where: str) -> tuple[Target, list[Entry], list, list[str], list[str]]:
    """mlx_lm's model and the first view of the input that gives exactly its parameters (else the problems
    of the view closest to them).

    Returns:
        (target, view entries, outputs, unused view names, changes).

    Raises:
        FFNToolsError: no view fits (what the plain input lacks or has too much, all listed).
    """
    tg = target(ckpt.config, where, has_head=HEAD in ckpt)
    closest: tuple[float, list[str]] = (float("inf"), [])
    for label, entries in _views(ckpt):
        shapes = {e.name: (tuple(e.shape), e.st_dtype) for e in entries}
        tg.model, tg.prequant = tg.fresh(), None
        try:
            outputs, unused = mlx_names.map_outputs(tg.model, shapes)
        except FFNToolsError as e:
            closest = min(closest, (float("inf") if closest[1] else 10**9, [str(e)]))
            continue
        tg.params = parameters(tg.model)  # sanitize may change the model (Gemma 3 drops its unused lm_head)
        _prequantized(tg, outputs)
        problems, changes, n = _problems(tg, outputs, ckpt)
        if not problems:
            if label != "as it is":
                changes.insert(0, f"FFNs {label.removeprefix('with ')} for mlx_lm's {tg.module} model "
                                  "(byte copies, as split-gateup/fuse-gateup do)")
            return tg, entries, outputs, unused, changes
        closest = min(closest, (n, problems))
    raise FFNToolsError(f"{where}: does not fit mlx_lm's {tg.module} model (mlx_lm.load would refuse it): "
                        + "; ".join(closest[1]))


class _Prequant(TypedDict):
    group_size: int
    bits: int
    mode: str


# quantization_config methods mlx_lm.load keeps quantized, as its load_model maps them (mode, group, bits)
PREQUANTIZED: dict[str, _Prequant] = {"mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
                "mxfp8": {"group_size": 32, "bits": 8, "mode": "mxfp8"}}


def _prequantized(tg: Target, outputs) -> None:
    """As ``mlx_lm.load`` does for a checkpoint quantized in a form MLX runs (GPT-OSS's MXFP4): quantize the
    lazy model's modules whose ``.scales`` sanitize produced, so its parameters are the packed ones; the
    config then carries mlx_lm's ``quantization`` block (``tg.prequant``)."""
    method = ((tg.config.get("quantization_config") or {}) if isinstance(tg.config.get("quantization_config"), dict)
              else {}).get("quant_method")
    names = {o.name for o in outputs}
    if method not in PREQUANTIZED or not any(n.endswith(".scales") for n in names):
        return
    import mlx.nn as nn

    q = PREQUANTIZED[method]
    nn.quantize(tg.model, q["group_size"], q["bits"], mode=q["mode"],
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in names)
    tg.params, tg.prequant = parameters(tg.model), dict(q)


def match_or_dequantize(ckpt: Checkpoint, quantizing: bool = False):
    """``match`` on the input as it is (models whose sanitize reads FP8 scales, as DeepSeek-V3's, dequantize
    it themselves; MXFP4 experts, read dequantized by default, are tried first as stored, which mlx_lm keeps
    MXFP4 unless ``quantizing``); failing that, on the input with its FP8 weights dequantized
    (``quant.decoded`` of every scheme).

    Returns:
        ``match``'s result, then the checkpoint the plan reads.
    """
    mxfp4 = [d["weights"] for d in ckpt.decoded() if d["dtype"] == "MXFP4"]
    if mxfp4 and not quantizing:
        try:
            found = match(ckpt.stored, str(ckpt.path))
            if found[0].prequant:
                found[4].insert(0, f"kept {mxfp4[0]} MXFP4 tensors as MLX's own mxfp4 (as mlx_lm.load does)")
                return (*found, ckpt.stored)
        except FFNToolsError:
            pass
    try:
        return (*match(ckpt, str(ckpt.path)), ckpt)
    except FFNToolsError:
        scaled = quant.kept(ckpt)
        if not scaled:
            raise
    deq = quant.decoded(ckpt, every=True)
    found = match(deq, str(ckpt.path))
    return (*found, deq)  # what becomes of each FP8 weight (codes kept or dequantized) is said by ``fp8_said``


def fp8_said(source: Checkpoint, module: str, said: set[str], quantizing: bool) -> list[str]:
    """What became of the FP8 weights ``source`` (``match_or_dequantize``'s view) reads dequantized and no other
    line says (``said``: the ones ``from_ct`` keeps as mxfp8 or says it did not), grouped by why MLX's mxfp8 does
    not hold them (``from_fp8.why_not``): written dequantized to float32, or (``quantizing``) quantized as asked.
    [] where there are none."""
    mods = [m for n in source if (m := source.quantized(n)) is not None and m.scheme.name == from_fp8.FP8]
    whys: dict[str, list] = {}
    for m in mods:
        if m.weight not in said:
            why = from_fp8.why_not(m, source.quantized_parts(m.weight)) or "not kept"
            whys.setdefault(why, []).append(m)
    out = []
    for why, ms in whys.items():
        n, first = len(ms), ms[0]
        names = ", ".join(m.weight for m in ms[:3]) + (", ..." if n > 3 else "")
        then = ", then quantized as asked (-q)" if quantizing else " to float32"
        out.append(f"dequantized {n} {first.args.dtype} weight{'s' * (n != 1)} (times their "
                   f"_{first.args.suffix.lstrip('_')}){then}: mlx_lm's {module} model has no FP8 form and MLX's "
                   f"mxfp8 does not hold them ({why})"
                   + ("" if quantizing else "; pass --dtype to store them smaller, -q to quantize") + f": {names}")
    return out


def mlx_entries(ckpt: Checkpoint) -> tuple[Checkpoint, dict[str, Entry], set[str]]:
    """``ckpt``'s tensors as mlx_lm's model holds them, unquantized and uncast (what ``verify`` pairs an MLX B
    with): the checkpoint the entries read, output name -> entry, and the input names the model's sanitize
    does not carry over by name (dropped, or used for a computed tensor).

    Raises:
        FFNToolsError: ``ckpt`` does not export to MLX (no mlx_lm model for its config, a misfit).
    """
    tg, view, outputs, unused, _, source = match_or_dequantize(ckpt)

    entries, _ = plan_outputs(source, tg, view, outputs, None, {}, {})
    return source, {e.name: e for e in entries}, set(unused)
