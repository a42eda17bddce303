"""Find every FFN of a checkpoint by matching its tensor names against the registry's schemes.

Strict: every problem (a layer missing a projection, shapes that disagree, a layer both fused and
separate) is collected and reported in one error, sorted.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import SchemeError, listing
from .io.dtypes import FLOAT_ST
from .ffn import FFN, Activation, FFNRef, activation_from_config
from .layouts import GateUpLayout
from .library import LIBRARY, SCHEMES, scheme_for_model_type
from . import mtp
from .registry import Form, Group, Scheme, bias_name, compile_template, config_int
from .quant.fp8 import is_companion


# A tensor looks like an FFN projection when a module on its path is an MLP / FFN / expert block and its own
# module is named like a projection (a router, ``mlp.gate``, is not). Nothing that looks like this may be
# passed over silently: ``find_ffns`` lists the ones no FFN claimed.
_FFN_BLOCK = re.compile(r"(?:^|\.)(?:mlps?|ffn|feed_forward|experts?|shared_\w+|moe|\w*_moe|mlp_block)(?:\.|$)", re.I)
_FFN_LEAF = re.compile(r"(?:gate_up|up_gate|gate_proj|up_proj|down_proj|up|down|w[0-9]+|w13|w_in|w_out|fc[0-9]*|"
                       r"fc_in|fc_out|c_fc\w*|c_proj|wi|wo|input_linear|output_linear|dense_h_to_4h|dense_4h_to_h|"
                       r"linear_gate|linear_fc[0-9]*|proj_up\w*|proj_down|lin[0-9]+)(?:_proj)?", re.I)
_SUFFIXES = ("_bias", "_blocks", "_scales", "_scale", "_scale_inv")


def looks_like_ffn(name: str) -> bool:
    """Whether a tensor name looks like an FFN projection (see ``_FFN_BLOCK`` / ``_FFN_LEAF``)."""
    parts = name.split(".")
    if parts[-1] in ("weight", "bias", "weight_scale_inv", "weight_scale", "scales", "biases"):
        parts = parts[:-1]
    if not parts:
        return False
    leaf = parts[-1]
    for suffix in _SUFFIXES:
        leaf = leaf.removesuffix(suffix)
    return bool(_FFN_LEAF.fullmatch(leaf)) and bool(_FFN_BLOCK.search(".".join(parts[:-1])))


@dataclass(frozen=True)
class FFNSet:
    """The FFNs of a checkpoint under one scheme."""

    scheme: Scheme
    ffns: tuple[FFN, ...]
    activation: Activation
    tensors: frozenset[str]  # every tensor name that belongs to an FFN (weights and biases)
    unmatched: tuple[str, ...] = ()  # tensors that look like FFN projections but belong to no FFN found

    def unmatched_warning(self, limit: int = 4) -> str | None:
        """One line naming the FFN-like tensors no FFN claimed, or None."""
        if not self.unmatched:
            return None
        shown = listing(self.unmatched, limit)
        return (f"{len(self.unmatched)} FFN-like tensor{'s' * (len(self.unmatched) > 1)} matched no FFN and "
                f"{'are' if len(self.unmatched) > 1 else 'is'} treated as plain tensors: {shown} (an ungated MLP, or "
                "a naming no scheme knows: --gate/--up/--down templates or --scheme-file)")

    def by_ref(self) -> dict[FFNRef, FFN]:
        return {f.ref: f for f in self.ffns}


def _shape(name: str) -> str:
    """A name with every all-digit segment as ``#``: ``model.layers.#.mlp.experts.#.w1.weight``."""
    return ".".join("#" if s.isdigit() else s for s in name.split("."))


def _buckets(names) -> dict[str, list[str]]:
    """Names by their shape (see ``_shape``): a checkpoint has thousands of names but a few dozen shapes."""
    out: dict[str, list[str]] = defaultdict(list)
    for n in names:
        out[_shape(n)].append(n)
    return out


@functools.lru_cache(maxsize=None)
def _template_shape(template: str) -> str | None:
    """The shape of every name a template can match, when its placeholders fill whole segments and it has no
    all-digit segment of its own; else None (its names are then found by scanning)."""
    parts = []
    for s in template.split("."):
        if s in ("{layer}", "{expert}"):
            parts.append("#")
        elif "{" in s or s.isdigit():
            return None
        else:
            parts.append(s)
    return ".".join(parts)


def _candidates(template: str, names, buckets) -> list[str]:
    shape = _template_shape(template)
    if shape is not None:  # its names all sit in one bucket (maybe none)
        return buckets.get(shape, [])
    head = template[:template.index("{")]
    return [n for n in names if n.startswith(head)]


def _matches(names, scheme: Scheme, buckets=None) -> dict[tuple, dict[str, dict[str, str]]]:
    """(group index, stacked, layer, expert) -> form name -> role -> tensor name."""
    buckets = buckets if buckets is not None else _buckets(names)
    hits: dict[tuple, dict[str, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for gi, group in enumerate(scheme.groups):
        for form_name, form in group.forms.items():
            for role, template in form.templates().items():
                rx = compile_template(template)
                for name in _candidates(template, names, buckets):
                    m = rx.fullmatch(name)
                    if m:
                        d = m.groupdict()
                        expert = int(d["expert"]) if d.get("expert") is not None else None
                        hits[(gi, form.stacked, int(d["layer"]), expert)][form_name][role] = name
    return hits


_GROUP_TEMPLATES: dict[int, tuple[Group, tuple[tuple[str, str | None, str], ...]]] = {}


def _templates_of(group: Group) -> tuple[tuple[str, str | None, str], ...]:
    """(template, shape, head) of every template of ``group``'s forms (as ``_candidates`` reads them), worked out
    once per group object: ``choose_scheme`` matches every group of the library against each checkpoint."""
    hit = _GROUP_TEMPLATES.get(id(group))
    if hit is None or hit[0] is not group:  # the group itself is kept: its id is not reused while it is here
        if len(_GROUP_TEMPLATES) > 4096:  # user schemes' groups, made anew call after call
            _GROUP_TEMPLATES.clear()
        ts = [t for form in group.forms.values() for t in form.templates().values()]
        shapes = [_template_shape(t) for t in ts]
        hit = _GROUP_TEMPLATES[id(group)] = (group, tuple((t, shape, "" if shape is not None else t[:t.index("{")])
                                                          for t, shape in zip(ts, shapes)))
    return hit[1]


def _claims(group: Group, names, buckets) -> frozenset[str]:
    """Every tensor name one of the group's templates matches (its candidates as ``_candidates`` finds them)."""
    out: set[str] = set()
    for t, shape, head in _templates_of(group):
        for n in (buckets.get(shape, ()) if shape is not None else [n for n in names if n.startswith(head)]):
            if compile_template(t).fullmatch(n):
                out.add(n)
    return frozenset(out)


def choose_scheme(names, config: Mapping | None, within: Scheme | None = None, buckets=None) -> Scheme:
    """The groups that explain the checkpoint's tensor names, as one scheme named after its family.

    Every group of the library (or of ``within``) is matched on its own; a group whose tensors are a strict
    subset of another's is dropped (Hunyuan's ``linear_gate`` MLP also half-matches Llama's); of groups that
    match the very same tensors (v5 stacked experts and GPT-OSS's transposed ones share names), the one in
    the family config.json's ``model_type`` selects is kept (its first in the family's order: the form its
    checkpoints are saved in, so separate experts split from Aria's fc1/fc2 fuse back into fc1/fc2, not into
    transformers v5's names), else the first in table order. The result is named after the first family
    holding every kept group (the selected family first).

    Raises:
        SchemeError: no group matches.
    """
    names = list(names)
    buckets = buckets if buckets is not None else _buckets(names)
    preferred = scheme_for_model_type((config or {}).get("model_type"))
    extra = preferred.groups if preferred and preferred.by_model_type_only else ()
    claims = {g: c for g in (within.groups if within else (*extra, *LIBRARY)) if (c := _claims(g, names, buckets))}
    if not claims:
        if within is not None:
            first = next(iter(within.groups[0].forms.values())).templates()
            raise SchemeError(f"no tensor matches scheme {within.name!r}; check the templates (e.g. {first})")
        like = sorted(n for n in names if looks_like_ffn(n))
        sample = ", ".join(like[:3] or sorted(names)[:3])
        what = (f"{len(like)} FFN-like tensors such as {sample} (an ungated MLP, or a naming no scheme knows)"
                if like else f"names like {sample}")
        raise SchemeError(f"no gated FFN tensors found: {what} match no known scheme "
                          f"({', '.join(SCHEMES)}); pass --gate/--up/--down templates or --scheme-file")
    favoured = set(preferred.groups) if preferred else set()
    chosen = []
    for g, c in claims.items():
        if any(c < d for d in claims.values()):
            continue
        equal = [h for h, d in claims.items() if d == c]
        own = sorted((h for h in equal if h in favoured), key=(preferred.groups.index if preferred else id))
        if (own or equal)[0] is g:
            chosen.append(g)
    if within is not None:
        return dataclasses.replace(within, groups=tuple(chosen), by_model_type_only=False)
    roots = {(g.prefix, g.first_layer) for g in chosen}
    prefixes = sorted({p for p, _ in roots})
    if len({first for _, first in roots}) < len(roots):  # layers under two roots numbered alike: two models' names
        # in one file, or a mistake (a family's second stack of layers is numbered after the first: HRM's)
        fits = [f"{_name([g for g in chosen if g.prefix == p], preferred).name} ({p})" for p in prefixes]
        raise SchemeError(f"ambiguous FFN naming: the tensor names fit schemes {' and '.join(fits)}, under "
                          "different layer prefixes; choose one with --scheme")
    return _name(chosen, preferred)


def _name(groups: list[Group], preferred: Scheme | None) -> Scheme:
    """``groups`` as a scheme named after the first family holding them all (``preferred`` first)."""
    for family in ([preferred] if preferred else []) + list(SCHEMES.values()):
        if set(groups) <= set(family.groups):
            return Scheme(family.name, family.description, tuple(groups), family.model_types, ungated=family.ungated)
    kinds = sorted({g.name for g in groups})
    return Scheme("+".join(kinds), "groups " + ", ".join(kinds), tuple(groups))


def ffn_members(names, scheme: Scheme) -> dict[str, tuple[int, int | None]]:
    """Each of ``names`` that belongs to an FFN of ``scheme`` -> its (layer, expert), from the names alone:
    the tensors its templates match and those of the same module (``x.gate_proj.bias`` or ``.scales`` beside
    ``x.gate_proj.weight``). No shapes are needed: it reads what a shard not on disk holds from its index."""
    names = list(names)
    matched = {n: (layer, expert) for (_, _, layer, expert), forms in _matches(names, scheme).items()
               for roles in forms.values() for n in roles.values()}
    modules = {n.rpartition(".")[0]: where for n, where in matched.items()}
    return {n: where for n in names if (where := matched.get(n) or modules.get(n.rpartition(".")[0]))}


def find_ffns(ckpt, scheme: Scheme | None = None, layout: GateUpLayout | None = None,
              names: Sequence[str] | None = None) -> FFNSet:
    """Find every FFN in ``ckpt`` (a ``Checkpoint``).

    Args:
        ckpt: the checkpoint.
        scheme: the naming scheme; detected from names and config.json when None.
        layout: the gate/up layout of fused tensors, overriding the scheme's.
        names: the tensors to look among (default: all of ``ckpt``'s); ``verify --layers`` on part of the
            shards passes those of its layers, so a layer split across a shard that is here and one that
            is not is not found incomplete.

    Raises:
        SchemeError: nothing found, ambiguous, or inconsistent tensors (all problems listed).
    """
    names = list(ckpt) if names is None else list(names)
    buckets = _buckets(names)
    try:
        scheme = choose_scheme(names, ckpt.config, within=scheme, buckets=buckets)
    except SchemeError as e:
        raise SchemeError(f"{ckpt.path}: {e}") if scheme is not None else e from None
    hits = _matches(names, scheme, buckets)
    ffns: list[FFN] = []
    problems: list[str] = []
    keys = sorted(hits, key=lambda k: (k[2], k[0], k[3] or 0))
    complete = {k: [f for f, roles in hits[k].items() if set(roles) == set(scheme.groups[k[0]].forms[f].templates())]
                for k in keys}
    usual: dict[int, Counter] = defaultdict(Counter)  # group -> how often each form is complete
    for k in keys:
        usual[k[0]].update(complete[k])
    for key in keys:
        gi, stacked, layer, expert = key
        group, forms = scheme.groups[gi], hits[key]
        where = f"layer {layer}" + (f" expert {expert}" if expert is not None else "") + \
            ("" if group.kind != "shared" else " shared expert")
        if len(complete[key]) != 1:
            if complete[key]:
                problems.append(f"{where}: both {' and '.join(complete[key])} tensors are present; keep one form")
            else:
                f, roles = max(forms.items(), key=lambda kv: (usual[gi][kv[0]], len(kv[1])))
                missing = [t for r, t in group.forms[f].templates().items() if r not in roles]
                note = f" (other layers use the {f} form)" if usual[gi][f] else ""
                problems.append(f"{where}: has {', '.join(sorted(roles.values()))} but lacks "
                                f"{', '.join(m.format(layer=layer, expert=expert) for m in missing)}{note}")
            continue
        form_name = complete[key][0]
        ffns.extend(_build(ckpt, group, form_name, forms[form_name], layer, expert, layout or group.layout, problems))
    routed = {f.ref.layer for f in ffns if f.ref.kind == "expert"}
    ffns = [dataclasses.replace(f, ref=FFNRef(f.ref.layer, "dense", f.ref.expert))  # "shared" with no routed ones
            if f.ref.kind == "shared" and f.ref.layer not in routed else f for f in ffns]
    seen: dict[FFNRef, FFN] = {}
    for ffn in ffns:
        if ffn.ref in seen:
            problems.append(f"{ffn.ref}: found twice, as {seen[ffn.ref].names['down']} and {ffn.names['down']}; "
                            "pass --scheme, or --gate/--up/--down templates naming one of them")
        seen.setdefault(ffn.ref, ffn)
    if problems:
        raise SchemeError(f"{ckpt.path}: inconsistent FFN tensors under scheme {scheme.name!r}: " + "; ".join(sorted(problems)))
    tensors = frozenset(n for f in ffns for n in f.names.values())
    ungated = [compile_template(t) for t in scheme.ungated]  # declared by the family: no gated FFN
    heads = mtp.head_tensors(mtp.find_heads(names, ckpt.config))  # an MTP module's (mtp.*): the head's, said so
    unmatched = tuple(sorted(n for n in names if n not in tensors and looks_like_ffn(n) and n not in heads
                             and not is_companion(n, tensors) and not any(p.fullmatch(n) for p in ungated)))
    return FFNSet(scheme, tuple(sorted(ffns, key=lambda f: f.ref)), activation_from_config(ckpt.config), tensors,
                  unmatched)


def _build(ckpt, group: Group, form_name: str, roles: dict[str, str], layer: int, expert: int | None,
           layout: GateUpLayout, problems: list[str]) -> list[FFN]:
    form: Form = group.forms[form_name]
    names = dict(roles)
    for role, name in roles.items():
        b = bias_name(name)
        if b in ckpt:
            names[f"{role}_bias"] = b
    names.update({r: b for r, b in group.bias_names(form, layer, expert).items() if b in ckpt})
    shapes = {r: ckpt.info(n).shape for r, n in names.items()}
    try:
        first_layer, first_expert = group.offsets(mtp.numbering(ckpt.config))
        n_flat = config_int(ckpt.config, form.experts, f"the {form_name} form of {group.name!r}") \
            if form.flat and form.experts else None
    except SchemeError as e:
        problems.append(f"{names['down']}: {e}")
        return []
    lead = 1 if form.stacked and not form.flat else 0
    down = shapes["down"]
    if len(down) != 2 + lead:
        problems.append(f"{names['down']}: expected {2 + lead} dims, found {list(down)}")
        return []
    if n_flat is not None:  # (E * n, m): one expert's block of rows, then as a stack
        if not n_flat or down[0] % n_flat:
            problems.append(f"{names['down']}: {down[0]} rows do not divide into {n_flat} experts "
                            f"(config.json {form.experts})")
            return []
        down = (n_flat, down[0] // n_flat, down[1])
        lead = 1
    h, i = down[lead:][::-1] if form.turns("down") else down[lead:]  # (H, I), or (I, H) stored (in, out)
    if not (h and i):
        problems.append(f"{names['down']}: shape {list(shapes['down'])} has a zero dimension; an FFN needs d_model "
                        "and d_ffn")
        return []
    ints = sorted({ckpt.info(n).st_dtype for n in names.values()} - FLOAT_ST)
    if ints:
        problems.append(f"{names['down']} and its FFN: {', '.join(ints)} weights; FFN weights are floating point "
                        "(a quantized checkpoint? read it through its own format)")
        return []
    want = {"down": (i, h) if form.turns("down") else (h, i), "down_bias": (h,)}
    if form.fused:  # stored (in, out), gate and up share its columns: the layout's axis is the tensor's
        layout = layout.oriented(form.turns("gate_up"))
    fused_axis = 0 if layout.axis == "rows" else 1
    if form.fused:
        want["gate_up"] = (2 * i, h) if fused_axis == 0 else (h, 2 * i)
        want["gate_up_bias"] = (2 * i,)
        want.update(gate_bias=(i,), up_bias=(i,))  # stored apart (``Form.separate_biases``)
    else:
        for r in ("gate", "up"):
            want[r] = (h, i) if form.turns(r) else (i, h)
            want[f"{r}_bias"] = (i,)
    n_experts: int | None = down[0] if form.stacked else None
    before = len(problems)
    if form.fused and len(shapes["gate_up"]) == 2 + lead and shapes["gate_up"][lead + fused_axis] % 2:
        problems.append(f"{names['gate_up']}: odd number of gate/up rows ({shapes['gate_up'][lead + fused_axis]}); "
                        "gate and up must be equal halves: is this really a fused gate_up tensor?")
        return []
    for role, shape in shapes.items():
        expect = ((n_experts,) if form.stacked else ()) + want[role]
        if form.flat:  # the experts' blocks one after the other along dim 0
            expect = (expect[0] * expect[1], *expect[2:])
        if tuple(shape) != expect:
            problems.append(f"{names[role]}: shape {list(shape)}, expected {list(expect)} "
                            f"(from {names['down']} {list(shapes['down'])}"
                            + (f" and {n_experts} experts" if form.flat else "") + ")")
    if len(problems) > before:
        return []
    kind = group.kind
    if n_experts is not None:  # stacked: one FFN per index along dim 0 (a block of rows when flat)
        return [FFN(FFNRef(layer + first_layer, kind, first_expert + e), form_name, form, layout, names, e, h, i,
                    group) for e in range(n_experts)]
    number = expert + first_expert if expert is not None else -1
    return [FFN(FFNRef(layer + first_layer, kind, number), form_name, form, layout, names, None, h, i, group)]
