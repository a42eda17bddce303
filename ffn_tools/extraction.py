"""``extract``: an FFN-only safetensors checkpoint with canonical names and a JSON manifest.

Names: ``layers.{L}.{gate,up,down}.weight`` (and ``.bias``); experts ``layers.{L}.experts.{E}.…``; the
shared expert ``layers.{L}.shared_expert.…``. Weights are (out, in), bit-exact with the source (fused
tensors split by row moves, stacked experts indexed). The manifest sits beside it as ``ffn_manifest.json``
(or ``OUT.json`` for a ``.safetensors`` output).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from .quant import fp8
from .detect import find_ffns
from .errors import FFNToolsError, OutputError
from .ffn import CLAMPED_RECORD, FFN, clamped_record
from .io.dtypes import short_name
from .io.output import check_output, check_parent
from .layouts import GateUpLayout
from .ops import Copy, Op, Rows, Select, Transpose
from .plan import DEQUANTIZED, Entry, Plan, copy_entry, source
from .executor import execute, side_files
from .io.run import NO_RUN, Run
from .registry import Scheme
from .specs import parse_spec
from .stacks import split_ops

MANIFEST = "ffn_manifest.json"


def canonical_prefix(f: FFN) -> str:
    """``layers.3`` / ``layers.3.experts.5`` / ``layers.3.shared_expert``."""
    base = f"layers.{f.ref.layer}"
    return {"dense": base, "expert": f"{base}.experts.{f.ref.expert}", "shared": f"{base}.shared_expert"}[f.ref.kind]


def _entries(ckpt, f: FFN) -> list[Entry]:
    prefix = canonical_prefix(f)
    shapes = {"gate": (f.d_ffn, f.d_model), "up": (f.d_ffn, f.d_model), "down": (f.d_model, f.d_ffn),
              "gate_bias": (f.d_ffn,), "up_bias": (f.d_ffn,), "down_bias": (f.d_model,)}
    has_bias = {"gate_bias": "gate_bias" in f.names or "gate_up_bias" in f.names,
                "up_bias": "up_bias" in f.names or "gate_up_bias" in f.names, "down_bias": "down_bias" in f.names}
    roles = ["gate", "up", "down"] + [r for r, present in has_bias.items() if present]
    dtype = ckpt.info(f.names["down"]).st_dtype
    out = []
    for role in roles:
        name = f"{prefix}.{role.split('_')[0]}.{'bias' if role.endswith('_bias') else 'weight'}"
        if role in f.names and f.index is None:  # stored as is: a byte copy under the canonical name
            out.append(copy_entry(ckpt, f.names[role], name))
            continue

        src = f.names.get(role) or f.names["gate_up_bias" if role.endswith("_bias") else "gate_up"]
        out.append(Entry(name, dtype, shapes[role], (src,), role_ops(f, role, src), sources=(source(ckpt, src),),
                         text=f"{role} of {f.ref} ({src})"))
    return out + _scale_entries(ckpt, f, prefix)


def role_ops(f: FFN, role: str, src: str) -> tuple[Op, ...]:
    """The ops making FFN ``f``'s canonical ``role`` (gate, up, down, or a bias; (out, in)) from its stored tensor
    ``src``, as ``ffn.canonical_weights`` reads it: the expert's part, split (fuse-gateup's definition reversed),
    turned. What ``extract`` writes, and what a format reading one FFN's weights builds on (flax's linen leaves)."""
    bias, base = role.endswith("_bias"), role.removesuffix("_bias")
    part: tuple[Op, ...] = ()
    if f.index is not None:  # a stack's slice, or a flat stack's row block
        stored = role if role in f.names else ("gate_up_bias" if bias else "gate_up")
        n = f.form.rows(stored, f.d_model, f.d_ffn)
        part = (Rows(f.index * n, n),) if f.form.flat else (Select(f.index),)
    turn = not bias and f.form.turns(base)
    if role in f.names:
        return (*part, *((Transpose(),) if turn else ()))
    return (*part, *split_ops(f.layout, 0 if base == "gate" else 1, bias, turn, name=src))


def _scale_entries(ckpt, f: FFN, prefix: str) -> list[Entry]:
    """FP8 scales of the FFN's weights under the canonical names + their suffix (``layers.0.gate.weight_scale_inv``):
    copied, indexed out of a stack, or split out of a fused gate_up's scale with its weight (see ``scales``)."""
    out = []
    for role in ("gate", "up", "down"):
        fused = role not in f.names
        base = f.names["gate_up"] if fused else f.names[role]
        for suffix, sc in fp8.companions(ckpt, base).items():
            name = f"{prefix}.{role}.weight{suffix}"
            if not fused and f.index is None:
                out.append(copy_entry(ckpt, sc, name))
                continue
            if fused or f.form.transposed:
                fp8.check(ckpt, base, sc, f.layout, f.index is not None, transposed=f.form.transposed)
            info = ckpt.info(sc)
            shape = list(info.shape[1:] if f.index is not None else info.shape)
            if fused:
                shape[0] //= 2

            made: tuple[Op, ...] = (Select(f.index),) if f.index is not None else ()
            if fused:
                made += split_ops(f.layout, 0 if role == "gate" else 1, len(shape) == 1, name=sc)
            out.append(Entry(name, info.st_dtype, tuple(shape), (sc,), made or (Copy(),), sources=(source(ckpt, sc),),
                             text=f"{role} scale of {f.ref} ({sc})"))
    return out


def extract(ckpt, out: Path, *, layers: str | None = None, experts: str | None = None,
            scheme: Scheme | None = None, layout: GateUpLayout | None = None, force: bool = False,
            max_shard_size: int | None = None, run: Run = NO_RUN) -> dict:
    """Write the (selected) FFNs of ``ckpt`` with canonical names, plus a manifest.

    Args:
        ckpt: the source checkpoint.
        out: a directory, or a ``.safetensors`` file.
        layers, experts: selections like ``0-3,7`` (None: all). ``experts`` keeps dense and shared FFNs.

    Returns:
        The manifest (also written as JSON).

    Raises:
        FFNToolsError: the selection matches no FFN, or the output exists.
    """
    ffns = find_ffns(ckpt, scheme, layout)
    chosen = _select(ckpt, ffns.ffns, layers, experts)
    entries = [e for f in chosen for e in _entries(ckpt, f)]
    dtype = ckpt.info(chosen[0].names["down"]).st_dtype
    manifest = {
        "source": str(Path(ckpt.path).resolve()), "scheme": ffns.scheme.name, "activation": ffns.activation.config_name,
        "gated_unit": ffns.activation.unit, "dtype": short_name(dtype),
        "d_model": chosen[0].d_model, "d_ffn": sorted({f.d_ffn for f in chosen}),
        "layers": sorted({f.ref.layer for f in chosen}),
        "experts": sorted({f.ref.expert for f in chosen if f.ref.kind == "expert"}),
        "shared_expert": any(f.ref.kind == "shared" for f in chosen),
        "ffns": len(chosen), "tensors": len(entries),
        "warnings": [w] if (w := ffns.unmatched_warning()) else [],
    }
    quantized = [q.params for f in chosen for n in f.names.values() if (q := ckpt.quantized(n))]
    if quantized:  # read dequantized (compressed-tensors, GPTQ/AWQ, MXFP4, FP8 views): said, and recorded for verify
        q = quantized[0]
        manifest["dequantized"] = (f"{len(quantized)} quantized weights written dequantized, as read ({q['bits']}-bit "
                                   f"{q.get('mode')}, group {q.get('group_size')})")
    clamped = clamped_record(ffns.activation)  # GPT-OSS's limit and alpha: the extract runs the same unit
    config = {"hidden_act": ffns.activation.config_name, **({CLAMPED_RECORD: clamped} if clamped else {}),
              "ffn_tools_manifest": manifest}
    plan = Plan(ckpt, entries, None if out.suffix == ".safetensors" else config)
    metadata = {"format": "pt", "ffn_tools": "extract", "hidden_act": ffns.activation.config_name,
                **({CLAMPED_RECORD: json.dumps(clamped)} if clamped else {})}
    if quantized:  # verify against the source gives B its bits' row
        metadata[DEQUANTIZED] = json.dumps({k: quantized[0].get(k) for k in ("bits", "group_size", "mode")}
                                                            | {"weights": len(quantized)})
    if out.suffix == ".safetensors":
        _execute_file(plan, run.but(out=out, force=force, max_shard_size=max_shard_size, metadata=metadata,
                                    desc="extracting"), manifest)
    else:
        execute(plan, run.but(out=out, force=force, max_shard_size=max_shard_size, metadata=metadata, desc="extracting",
                              extra_files={MANIFEST: json.dumps(manifest, indent=2) + "\n"}, carry=False))
    return manifest


def _select(ckpt, ffns, layers: str | None, experts: str | None) -> list[FFN]:
    """The FFNs ``--layers``/``--experts`` keep; a requested layer or expert the checkpoint lacks is an error."""
    have_layers = sorted({f.ref.layer for f in ffns})
    have_experts = sorted({f.ref.expert for f in ffns if f.ref.kind == "expert"})
    keep_layers = parse_spec(layers) if layers else set(have_layers)
    keep_experts = parse_spec(experts) if experts else set(have_experts)
    missing = []
    if keep_layers - set(have_layers):
        missing.append(f"layers {sorted(keep_layers - set(have_layers))} (it has {have_layers[0]}-{have_layers[-1]})")
    if keep_experts - set(have_experts):
        has = f"{have_experts[0]}-{have_experts[-1]}" if have_experts else "no routed experts"
        missing.append(f"experts {sorted(keep_experts - set(have_experts))} (it has {has})")
    if missing:
        raise FFNToolsError(f"{ckpt.path} has no {' and no '.join(missing)}; adjust --layers/--experts")
    return [f for f in ffns if f.ref.layer in keep_layers and (f.ref.kind != "expert" or f.ref.expert in keep_experts)]


def _execute_file(plan: Plan, run: Run, manifest) -> None:
    """A .safetensors output and its OUT.json manifest, both checked first and both moved in only on success."""
    ckpt, out, force = plan.source, Path(str(run.out)), run.force
    manifest_path = out.with_suffix(".json")
    check_output(manifest_path, [ckpt.path, *ckpt.files, *side_files(ckpt), ckpt.root / "config.json"], force,
                 replaceable=_is_manifest)
    check_parent(out)  # a place it cannot write is said of -o, before the manifest's temporary is written
    tmp = manifest_path.with_name(f".{manifest_path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")  # remove_stale's
    try:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{out}: cannot write its manifest {manifest_path.name} beside it ({e.strerror}); choose "
                          "another -o path") from None
    try:
        execute(plan, run)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, manifest_path)


def _is_manifest(p: Path) -> bool:
    try:
        return {"source", "scheme", "ffns"} <= set(json.loads(p.read_text()))
    except (OSError, ValueError, TypeError):
        return False
