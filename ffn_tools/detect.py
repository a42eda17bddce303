"""Find every FFN of a checkpoint by matching its tensor names against the registry's schemes.

Strict: every problem (a layer missing a projection, shapes that disagree, a layer both fused and
separate) is collected and reported in one error, sorted.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import SchemeError
from .ffn import FFN, Activation, FFNRef, activation_from_config
from .layouts import GateUpLayout
from .registry import SCHEMES, Form, Group, Scheme, bias_name, compile_template, scheme_for_model_type


@dataclass(frozen=True)
class FFNSet:
    """The FFNs of a checkpoint under one scheme."""

    scheme: Scheme
    ffns: tuple[FFN, ...]
    activation: Activation
    tensors: frozenset[str]  # every tensor name that belongs to an FFN (weights and biases)

    def by_ref(self) -> dict[FFNRef, FFN]:
        return {f.ref: f for f in self.ffns}


def _matches(names, scheme: Scheme) -> dict[tuple, dict[str, dict[str, str]]]:
    """(group index, stacked, layer, expert) -> form name -> role -> tensor name."""
    hits: dict[tuple, dict[str, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for gi, group in enumerate(scheme.groups):
        for form_name, form in group.forms.items():
            for role, template in form.templates().items():
                rx = compile_template(template)
                for name in names:
                    m = rx.fullmatch(name)
                    if m:
                        d = m.groupdict()
                        expert = int(d["expert"]) if d.get("expert") is not None else None
                        hits[(gi, form.stacked, int(d["layer"]), expert)][form_name][role] = name
    return hits


def _mapping(hits) -> frozenset:
    return frozenset((name, role, *key[1:]) for key, forms in hits.items()
                     for roles in forms.values() for role, name in roles.items())


def choose_scheme(names, config: Mapping | None) -> Scheme:
    """Pick the scheme that explains the checkpoint's tensor names.

    Raises:
        SchemeError: no scheme matches, or several match differently and config.json does not decide.
    """
    found = {}
    for s in SCHEMES.values():
        hits = _matches(names, s)
        if hits:
            found[s.name] = (s, frozenset(n for f in hits.values() for r in f.values() for n in r.values()), hits)
    if not found:
        sample = ", ".join(sorted(names)[:3])
        raise SchemeError(f"no FFN tensors found: names like {sample} match no known scheme "
                          f"({', '.join(SCHEMES)}); pass --gate/--up/--down templates or --scheme-file")
    best = [v for v in found.values() if not any(v[1] < w[1] for w in found.values())]
    preferred = scheme_for_model_type((config or {}).get("model_type"))
    if preferred and any(s is preferred for s, _, _ in best):
        return preferred
    if len({_mapping(h) for _, _, h in best}) == 1:
        return best[0][0]
    raise SchemeError("ambiguous FFN naming: the tensor names fit schemes "
                      f"{', '.join(s.name for s, _, _ in best)}; choose one with --scheme")


def find_ffns(ckpt, scheme: Scheme | None = None, layout: GateUpLayout | None = None) -> FFNSet:
    """Find every FFN in ``ckpt`` (a ``Checkpoint``).

    Args:
        ckpt: the checkpoint.
        scheme: the naming scheme; detected from names and config.json when None.
        layout: the gate/up layout of fused tensors, overriding the scheme's.

    Raises:
        SchemeError: nothing found, ambiguous, or inconsistent tensors (all problems listed).
    """
    names = list(ckpt)
    scheme = scheme or choose_scheme(names, ckpt.config)
    hits = _matches(names, scheme)
    if not hits:
        raise SchemeError(f"{ckpt.path}: no tensor matches scheme {scheme.name!r}; check the templates "
                          f"(e.g. {next(iter(scheme.groups[0].forms.values())).templates()})")
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
    if problems:
        raise SchemeError(f"{ckpt.path}: inconsistent FFN tensors under scheme {scheme.name!r}: " + "; ".join(sorted(problems)))
    tensors = frozenset(n for f in ffns for n in f.names.values())
    return FFNSet(scheme, tuple(sorted(ffns, key=lambda f: f.ref)), activation_from_config(ckpt.config), tensors)


def _build(ckpt, group: Group, form_name: str, roles: dict[str, str], layer: int, expert: int | None,
           layout: GateUpLayout, problems: list[str]) -> list[FFN]:
    form: Form = group.forms[form_name]
    names = dict(roles)
    for role, name in roles.items():
        b = bias_name(name)
        if b in ckpt:
            names[f"{role}_bias"] = b
    shapes = {r: ckpt.info(n).shape for r, n in names.items()}
    lead = 1 if form.stacked else 0
    down = shapes["down"]
    if len(down) != 2 + lead:
        problems.append(f"{names['down']}: expected {2 + lead} dims, found {list(down)}")
        return []
    h, i = down[lead:]
    want = {"down": (h, i), "down_bias": (h,)}
    fused_axis = 0 if layout.axis == "rows" else 1
    if form.fused:
        want["gate_up"] = (2 * i, h) if fused_axis == 0 else (h, 2 * i)
        want["gate_up_bias"] = (2 * i,)
    else:
        want.update(gate=(i, h), up=(i, h), gate_bias=(i,), up_bias=(i,))
    n_experts = down[0] if form.stacked else None
    before = len(problems)
    if form.fused and len(shapes["gate_up"]) == 2 + lead and shapes["gate_up"][lead + fused_axis] % 2:
        problems.append(f"{names['gate_up']}: odd number of gate/up rows ({shapes['gate_up'][lead + fused_axis]}); "
                        "gate and up must be equal halves: is this really a fused gate_up tensor?")
        return []
    for role, shape in shapes.items():
        expect = ((n_experts,) if form.stacked else ()) + want[role]
        if tuple(shape) != expect:
            problems.append(f"{names[role]}: shape {list(shape)}, expected {list(expect)} "
                            f"(from {names['down']} {list(down)})")
    if len(problems) > before:
        return []
    kind = group.kind
    if form.stacked:
        return [FFN(FFNRef(layer, kind, e), form_name, form, layout, names, e, h, i, group) for e in range(n_experts)]
    return [FFN(FFNRef(layer, kind, expert if expert is not None else -1), form_name, form, layout, names, None, h, i, group)]
