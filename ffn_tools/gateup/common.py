"""What split-gateup's and fuse-gateup's plans share: the output forms (their names and pairs: ``naming``), an expert's
slice, a flat stack moved whole, and the plan assembled in input order."""

from __future__ import annotations

import dataclasses
import json

from ..detect import FFNSet
from ..errors import LayoutError, NothingToDoError
from ..ffn import FFN
from ..layouts import GateUpLayout
from ..library import LIBRARY, SCHEMES, scheme_for_model_type
from ..plan import Entry, Plan, copy_entry, source
from ..quant import fp8
from ..registry import Form
from ..stacks import fuse_ops, restack_entries, split_ops, stack_ops, unstack_ops  # noqa: F401 (re-exported)
from .naming import name_in

SPLIT_FROM = "ffn_tools_split_from"  # safetensors metadata of split-gateup's output: {group: form} it split (JSON)


def _twin(groups, g, form: str, names: list[str]):
    """A group named in ``names`` other than ``g`` that stores form ``form`` under the same names as ``g`` (Aria's
    ``experts.fc1`` and transformers 5's ``experts.gate_up_proj`` both split to ``experts.{e}.gate_proj``), or None."""
    return next((h for h in groups if h.name in names and h.name != g.name and (h.kind, h.prefix) == (g.kind, g.prefix)
                 and h.forms.get(form) == g.forms.get(form)), None)


def _family(ffns: FFNSet) -> tuple:
    """Every group of ``ffns``' family (detection keeps only those that matched), then its own."""
    family = SCHEMES.get(ffns.scheme.name)
    return (family.groups if family is not None else ()) + ffns.scheme.groups


def split_record(ckpt, ffns: FFNSet, fused: list[FFN]) -> tuple[dict[str, str], list[str]]:
    """The metadata of split-gateup's output and its changes line: the input's metadata, and where fuse-gateup
    would not otherwise restore the input (another group of the family stores the split FFNs separate under the
    same names, a stack whose group also has a per-FFN fused form, FFNs the input had separate), ``SPLIT_FROM``:
    each group's form in the input, which fuse-gateup writes back."""
    kept = {f.group.name: f.form_name for f in ffns.ffns if not f.form.fused}  # left separate: to stay so
    family, every = _family(ffns), [h.name for h in _family(ffns)]
    if not kept and not any(_twin(family, f.group, f.group.unfused or "separate", every)
                            or (f.form_name == "stacked" and "fused" in f.group.forms) for f in fused):
        return dict(ckpt.metadata), []
    record = {**kept, **{f.group.name: f.form_name for f in fused}}
    for f in ffns.ffns:  # a layer whose FFNs of a group had another form than the group's recorded one (an MTP
        if f.form_name != record[f.group.name]:  # head's experts one by one beside stacked main layers): its own
            record[layer_key(f)] = f.form_name
    record = dict(sorted(record.items()))
    shown = ", ".join(f"{g} {form}" for g, form in record.items())
    return {**ckpt.metadata, SPLIT_FROM: json.dumps(record)}, [
        f"recorded the input's forms in the safetensors metadata ({SPLIT_FROM}: {shown}): fuse-gateup writes them "
        "back so"]


def layer_key(f: FFN) -> str:
    """The key of split-gateup's record (``SPLIT_FROM``) for ``f``'s layer of its group, where that layer's form
    was not the group's."""
    return f"{f.group.name} layer {f.ref.layer}"


def recorded_form(record: dict[str, str], f: FFN) -> str | None:
    """The form split-gateup recorded ``f`` had (``split_from``): its layer's where the record names one, else its
    group's; None where it records neither."""
    return record.get(layer_key(f), record.get(f.group.name))


def as_split_from(ckpt, ffns: FFNSet, f: FFN) -> FFN:
    """``f`` as found through the group split-gateup recorded it was split from (``SPLIT_FROM``), where that group
    stores it separate under the same names; else ``f`` as found (the scheme's first group that matches)."""
    names = list(split_from(ckpt))
    twin = _twin(_family(ffns), f.group, f.form_name, names) if f.group.name not in names else None
    return f if twin is None else dataclasses.replace(f, group=twin)


def split_from(ckpt) -> dict[str, str]:
    """split-gateup's record in ``ckpt`` (``SPLIT_FROM``): group -> the form its FFNs had; empty where none."""
    try:
        record = json.loads(ckpt.metadata.get(SPLIT_FROM, "{}"))
    except ValueError:  # not ours: no record
        return {}
    return record if isinstance(record, dict) else {}


def target_form(f: FFN, form_name: str, verb: str) -> Form:
    form = f.group.forms.get(form_name)
    if form is None:
        want = "--gate and --up" if form_name == "separate" else "--gate-up"
        raise NothingToDoError(f"{f.ref}: the naming scheme has no {form_name} form to {verb} into "
                               f"(it knows {', '.join(f.group.forms)}); name the output tensors with {want} "
                               "templates (with the others), or declare the form in a --scheme-file")
    return form


def index_entry(ckpt, src: str, index: int | None, name: str, transpose: bool = False) -> Entry:
    """``src`` itself, or its slice ``[index]`` of a stacked tensor, under ``name`` (``transpose``: a slice
    stored (in, out), turned back to (out, in))."""
    if index is None:
        return copy_entry(ckpt, src, name)
    info = ckpt.info(src)
    return Entry(name, info.st_dtype, info.shape[1:][::-1] if transpose else info.shape[1:], (src,),
                 unstack_ops(info.shape[0], index, transpose), sources=(source(ckpt, src),),
                 text=f"[{index}] of {src}" + (", transposed to (out, in)" if transpose else ""))


def restack(ckpt, experts: list[FFN], target: Form, replaced) -> None:
    """One layer's whole stack of experts written as ``target`` (a flat form, or from one): ``stacks``."""
    experts = sorted(experts, key=lambda f: f.index if f.index is not None else -1)
    f0 = experts[0]
    if [f.index for f in experts] != list(range(len(experts))):
        raise LayoutError(f"layer {f0.ref.layer}: a flat stack moves whole, but only experts "
                          f"{[f.index for f in experts]} of {f0.names['down']} are there")
    for name in f0.names.values():
        if fp8.companions(ckpt, name):
            raise LayoutError(f"{name}: has FP8 scales, which a flat stack of experts does not carry; dequantize "
                              "it first (ffn-tools convert --to torch --dtype bfloat16)")
    entries = restack_entries(ckpt, experts, target, {r: name_in(t, f0, ckpt.config)
                                                      for r, t in target.templates().items()})
    replaced[f0.names["down"]] += entries
    for name in f0.names.values():
        replaced[name] += []


def packed_rename(ckpt, packed: dict, src: str, dst: str, replaced) -> None:
    """``src`` (a module's ``X.weight``, every stored part of it) copied under ``dst``'s names."""
    parts = packed[src].parts if src in packed else {"weight": src}
    if src != dst:
        for suffix, name in parts.items():
            replaced[name].append(copy_entry(ckpt, name, dst[: -len("weight")] + suffix))


def assemble(ckpt, ffns: FFNSet, replaced: dict[str, list[Entry]], command: str, changed: int,
              layout: GateUpLayout, *forms: tuple[list[FFN], str]) -> Plan:
    """The plan: replaced entries in input order, everything else copied; ``forms`` are (FFNs, the form they
    take), for the warning when the output's form is not the one its carried config.json loads."""
    entries: list[Entry] = []
    for name in ckpt:
        entries += replaced[name] if name in replaced else [copy_entry(ckpt, name)]
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise LayoutError(f"two output tensors would be named {e.name}; the input mixes forms")
        seen.add(e.name)
    summary = {"command": command, "input": str(ckpt.path), "scheme": ffns.scheme.name, "layout": layout.describe(),
               "ffns_changed": changed, "ffns_total": len(ffns.ffns), "tensors_in": len(ckpt),
               "tensors_out": len(entries), "bytes": sum(e.nbytes for e in entries),
               "warnings": [w] if (w := ffns.unmatched_warning()) else []}
    summary["form_changes"] = [(fs, form) for fs, form in forms if fs]
    changes = ["config.json: carried over unchanged (no config key records the gate/up layout)"] if ckpt.config else []
    return Plan(ckpt, entries, ckpt.config, changes, summary)


# What a form of dense FFNs is for where the model's own class holds another: the line split and fuse print.
FORM_USE = {"separate": ("split", "for code that reads gate and up as separate projections (Llama-style models and "
                                  "converters, per-projection LoRA, pruning or quantization)", "fuse-gateup"),
            "fused": ("fused", "for code that reads one gate_up projection (Phi-3-style models, fused kernels)",
                      "split-gateup")}


def held_form_warning(config, forms: list[tuple[list[FFN], str]], out: str) -> str | None:
    """One line when the output's dense or shared FFNs are in a form that the model's own class (config.json's
    ``model_type``, carried over unchanged) does not load, as its family's data says (``Scheme.held_forms``):
    transformers would initialise them anew. Known without importing transformers; None where the output's
    form is one the class loads, or its family does not say (routed experts, a model_type no family names).

    Args:
        config: the input's config.json (carried into the output), or None.
        forms: (FFNs, the form the output stores them in), as ``assemble`` records them.
        out: the output path, for the message.
    """
    model_type = (config or {}).get("model_type")
    family = scheme_for_model_type(model_type)
    if family is None:
        return None
    strange = [(f, form) for fs, form in forms for f in fs
               if (held := family.held_forms(model_type, f.group)) is not None and form not in held]
    if not strange:
        return None
    f, form = strange[0]
    held = family.held_forms(model_type, f.group) or ()
    word, use, undo = FORM_USE.get(form, (form, "for other tools", "fuse-gateup"))
    n = len(strange)
    return (f"{out}: transformers' {model_type} model class holds its FFNs {' or '.join(held)}, so it would load this "
            f"output's {n} {word} FFN{'s' * (n > 1)} as newly initialised weights (config.json is carried over "
            f"unchanged); a {word} checkpoint is {use}: for transformers load the input, or run "
            f"`ffn-tools {undo} {out}`")


def foreign_layout(ffns: FFNSet, changed: list[FFN], verb: str) -> str | None:
    """A warning when FFNs were split or fused in another arrangement than their family stores (``--layout``
    given): the family's names are read and written by its clients in the family's arrangement, so a fused output
    would compute another function, and a split input's gate and up would each be half of both; None for a
    user's own templates (``--gate-up``, ``--scheme-file``), which name no family."""
    foreign = [f for f in changed if not f.layout.same_arrangement(f.group.layout)]
    if not foreign or foreign[0].group not in set(LIBRARY):
        return None
    f, n = foreign[0], len(foreign)
    own, given = f.group.layout.oriented(False).describe(), f.layout.oriented(False).describe()
    head = (f"{n} FFN{'s' * (n > 1)} {verb} {given!r}, but {ffns.scheme.name}'s names hold gate and up as {own!r}, "
            "which is how its clients ")
    if verb == "fused":
        return head + ("read them: they would compute another function from this output; fuse without --layout to "
                       "write the family's own, or split this output back with the same --layout")
    return head + ("write them: each gate and up written holds rows of both, another function; split without --layout "
                   "to read the family's own, unless this checkpoint was written in that arrangement by another tool")
