"""The one reader of scheme JSON: the built-in families (``schemes/families.json``), a user's ``--scheme-file``
and ``--gate/--up/--down`` templates are the same form, checked by the same code; this module only interprets.

A scheme (what ``--scheme-file`` holds; each entry of ``schemes`` in the built-in file) names its groups of FFN
tensors (dense, routed experts, shared) and the forms each can take (separate, fused, stacked, ...) as
templates with ``{layer}``/``{expert}``/``{prefix}`` placeholders, and how a fused tensor holds gate and up (a
``GateUpLayout``); docs/ffns.md ("Scheme files") describes every key. This module reads them (``load_library``
for the built-in file; ``library`` holds the result and reads a user's).

The built-in file is ``{"layer_prefixes": [...], "groups": {name: group}, "schemes": [scheme, ...]}``: groups
are declared once and named by the schemes; the schemes' order is the table order detection falls back on.
Every problem of a file is reported at once, each under the key it is at (``groups[1].forms.fused``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from difflib import get_close_matches
from pathlib import Path

from .errors import SchemeError
from .layouts import CONCAT, GateUpLayout, LayoutError
from .registry import FORM_ROLES, FORMS, KINDS, ROLES, Form, Group, Scheme

Prefix = tuple[str, "str | None"]  # a layer prefix and the config key its layers are numbered from (or None)

BUILTIN = Path(__file__).with_name("schemes") / "families.json"
SCHEME_KEYS = ("name", "description", "model_types", "by_model_type_only", "layer_prefixes", "groups", "ungated",
               "own_forms")
GROUP_KEYS = ("name", "description", "kind", "forms", "layout", "first_expert")
FORM_KEYS = (*ROLES, "transposed", "experts", "separate_biases")
PREFIX_KEYS = ("prefix", "first_layer")
LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(GateUpLayout))
LIBRARY_KEYS = ("layer_prefixes", "groups", "schemes")
_PLACEHOLDER = re.compile(r"\{(\w*)\}")
_PLACED: dict[tuple[Group, tuple[Prefix, ...]], list[Group]] = {}  # _place: each group under its layer prefixes


class Problems:
    """Every problem of one source, each under the key path it is at; raised together by ``check``."""

    def __init__(self, source: str | None):
        self.source = source
        self.found: list[str] = []

    def __call__(self, where: str, message: str) -> None:
        self.found.append(f"{where}: {message}" if where else message)

    def check(self) -> None:
        if self.found:
            head = f"{self.source}: " if self.source else ""
            many = f"{len(self.found)} problems: " if len(self.found) > 1 else ""
            raise SchemeError(head + many + "; ".join(self.found))

    def checked(self, scheme: Scheme | None) -> Scheme:
        """``scheme`` once ``check`` found no problem (``_scheme`` returns None only after reporting one).

        Raises:
            SchemeError: every problem found; or, should a reader return None without reporting why, that
                the input does not describe a scheme.
        """
        self.check()
        if scheme is None:
            raise SchemeError(f"{self.source or 'the templates'}: does not describe a scheme")
        return scheme


def _at(where: str, key) -> str:
    """The key path of ``key`` under ``where``: ``groups[1].forms.fused``, ``groups["mlp.experts"]``."""
    if isinstance(key, int) or "." in str(key):
        return f"{where}[{key if isinstance(key, int) else json.dumps(key)}]"
    return f"{where}.{key}" if where else str(key)


def _unknown_keys(data: dict, known: tuple[str, ...], where: str, problems: Problems) -> None:
    for k in data:
        if k not in known:
            near = get_close_matches(str(k), known, n=1)
            problems(_at(where, k), "unknown key" + (f"; did you mean {near[0]!r}?" if near else
                                                     f"; known keys: {', '.join(known)}"))


def read_json(path: Path):
    def pairs(items):
        seen = [k for k, _ in items]
        twice = sorted({k for k in seen if seen.count(k) > 1})
        if twice:
            raise SchemeError(f"{path}: key {twice[0]!r} appears twice in one object")
        return dict(items)

    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=pairs)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SchemeError(f"{path}: cannot read scheme file ({e})") from None


def _template(t, where: str, problems: Problems) -> str | None:
    if not isinstance(t, str) or not t:
        problems(where, f"a template is a tensor name with {{layer}}; found {t!r}")
        return None
    found = _PLACEHOLDER.findall(t)
    unknown = sorted(set(found) - {"layer", "expert", "prefix"})
    if unknown:
        problems(where, f"template {t!r}: unknown placeholder {', '.join('{' + u + '}' for u in unknown)}; "
                        "templates use {layer}, {expert} and {prefix}")
    elif found.count("layer") + found.count("prefix") != 1 or found.count("expert") > 1:
        problems(where, f"template {t!r}: needs {{layer}} (or a leading {{prefix}}, which holds it) once, and may "
                        "use {expert} once")
    elif "prefix" in found and not t.startswith("{prefix}"):
        problems(where, f"template {t!r}: {{prefix}} stands for the start of the name (a layer prefix)")
    else:
        return t
    return None


def _layout(data, where: str, problems: Problems) -> GateUpLayout:
    if not isinstance(data, dict):
        problems(where, f"a layout is an object with keys among {', '.join(LAYOUT_KEYS)}; found {data!r}")
        return CONCAT
    _unknown_keys(data, LAYOUT_KEYS, where, problems)
    given = {k: v for k, v in data.items() if k in LAYOUT_KEYS}
    if "tp" in given and (not isinstance(given["tp"], int) or isinstance(given["tp"], bool)):
        problems(_at(where, "tp"), f"the number of tensor-parallel ranks, a whole number; found {given['tp']!r}")
        return CONCAT
    if given.get("tp", 1) != 1 and given.get("arrangement") != "tp":
        problems(where, f'"tp": {given["tp"]} needs "arrangement": "tp"')
        return CONCAT
    try:
        return GateUpLayout(**given)
    except LayoutError as e:
        problems(where, str(e))
        return CONCAT


def _form(name: str, data, kind: object, where: str, problems: Problems) -> Form | None:
    # ``kind`` as the file gives it: ``_group`` reports it when it is not one of KINDS, and still reads the forms
    if not isinstance(data, dict):
        problems(where, f"a form is an object of role templates ({', '.join(FORM_ROLES[name])}); found {data!r}")
        return None
    _unknown_keys(data, FORM_KEYS, where, problems)
    need, roles = FORM_ROLES[name], {r: data[r] for r in ROLES if r in data}
    if set(roles) != set(need):
        problems(where, f"form {name!r} of the {kind} group needs exactly {', '.join(sorted(need))}; "
                        f"found {', '.join(sorted(roles)) or 'none'}")
    templates = {r: t for r, t in roles.items() if _template(t, _at(where, r), problems)}
    flat = name.startswith("flat")
    stacked, transposed, experts = name.startswith("stacked") or flat, data.get("transposed", False), \
        data.get("experts")
    turned: tuple[str, ...] = ()
    if isinstance(transposed, list) and transposed and all(r in need for r in transposed):
        turned, transposed = tuple(r for r in need if r in transposed), False
    elif not isinstance(transposed, bool):
        problems(_at(where, "transposed"), f"true, false, or a list of the roles stored (in, out) among "
                                           f"{', '.join(need)}; found {transposed!r}")
    if flat and (not isinstance(experts, str) or not experts):
        problems(where, 'a flat form names the config.json key holding the number of experts: "experts": '
                        f'"num_experts"; found {experts!r}')
    elif not flat and experts is not None:
        problems(_at(where, "experts"), "only a flat form (experts flattened into dim 0) reads the number of "
                                        "experts from config.json")
    uses = [r for r, t in templates.items() if "{expert}" in t]
    if uses and (stacked or kind == "dense"):  # stacked experts are dim 0 of one tensor; a dense FFN has none
        problems(where, f"{'a stacked form' if stacked else 'a dense group'} has no {{expert}}; found it in "
                        f"{', '.join(uses)}")
    elif (uses or kind == "expert") and not stacked and len(uses) != len(templates):  # one tensor per expert
        problems(where, f"every template of this {kind} form names its {{expert}}; missing from "
                        f"{', '.join(r for r in templates if r not in uses)}")
    apart = data.get("separate_biases", False)
    if apart is not False and (apart is not True or name != "fused"):
        problems(_at(where, "separate_biases"), "true on a fused form whose gate and up biases are stored apart "
                                                f"(named as the group's separate form names them); found {apart!r}")
    if set(templates) != set(need) or not isinstance(transposed, bool) or (flat and not isinstance(experts, str)) \
            or apart not in (False, True):
        return None
    return Form(**templates, stacked=stacked, transposed=transposed, turned=turned, flat=flat,
                experts=experts if flat else None, separate_biases=apart is True and name == "fused")


def _group(data, where: str, problems: Problems, name: str = "") -> Group | None:
    """A group as declared: templates may still start with ``{prefix}`` (see ``_place``)."""
    if not isinstance(data, dict):
        problems(where, f'a group is an object with "kind" and "forms", or the name of a built-in group; found '
                        f"{data!r}")
        return None
    _unknown_keys(data, GROUP_KEYS, where, problems)
    if name and data.get("name", name) != name:
        problems(_at(where, "name"), f"a built-in group is named by its key ({name!r})")
    name = name or data.get("name", "")
    kind, forms_data = data.get("kind"), data.get("forms")
    if kind not in KINDS:
        problems(_at(where, "kind"), f"one of {', '.join(KINDS)}; found {kind!r}")
    if not isinstance(forms_data, dict) or not forms_data:
        problems(_at(where, "forms"), f"an object of at least one form among {', '.join(FORMS)}; found "
                                      f"{forms_data!r}")
        forms_data = {}
    for k in ("name", "description", "first_expert"):
        if not isinstance(data.get(k, ""), str) or (k == "first_expert" and k in data and not data[k]):
            problems(_at(where, k), f"a {'config.json key' if k == 'first_expert' else 'string'}; found {data[k]!r}")
    first_expert = data.get("first_expert")
    if first_expert is not None and kind != "expert":
        problems(_at(where, "first_expert"), f"numbers experts; the group is {kind}")
    layout = _layout(data.get("layout", {}), _at(where, "layout"), problems)
    forms = {}
    for form_name, spec in forms_data.items():
        at = _at(_at(where, "forms"), form_name)
        if form_name not in FORMS:
            problems(at, f"unknown form; forms are {', '.join(FORMS)}")
        elif (form := _form(form_name, spec, kind, at, problems)) is not None:
            forms[form_name] = form
            if form.turns("gate_up") and form.fused and layout.axis != "columns":
                problems(at, 'stored (in, out), gate and up share the columns of gate_up: the group needs '
                             '"layout": {"axis": "columns"}')
    if any(f.separate_biases for f in forms.values()) and "separate" not in forms:
        problems(_at(where, "forms"), "a fused form with separate_biases names its biases as the separate form "
                                      "does: declare that form too")
    prefixed = {t.startswith("{prefix}") for f in forms.values() for t in f.templates().values()}
    if len(prefixed) > 1:
        problems(where, "start every template of the group with {prefix}, or none")
    if kind not in KINDS or len(forms) != len(forms_data) or len(prefixed) > 1 or \
            (any(f.separate_biases for f in forms.values()) and "separate" not in forms) or \
            (first_expert is not None and (not isinstance(first_expert, str) or kind != "expert")):
        return None
    return Group(kind, forms, layout, name, first_expert=first_expert)


def _place(group: Group, prefixes: tuple[Prefix, ...]) -> list[Group]:
    """``group`` under each layer prefix (itself, when its templates name the whole tensor)."""
    if not any(t.startswith("{prefix}") for f in group.forms.values() for t in f.templates().values()):
        return [group]
    if (group, prefixes) not in _PLACED:  # families share groups: each is placed once
        _PLACED[group, prefixes] = [
            dataclasses.replace(group, forms={n: f.placed(p) for n, f in group.forms.items()}, prefix=p,
                                first_layer=first)
            for p, first in prefixes]
    return _PLACED[group, prefixes]


def _prefixes(data, where: str, problems: Problems) -> tuple[Prefix, ...] | None:
    """Layer prefixes, each with the config key its layers are numbered from (None: from 0)."""
    if not isinstance(data, list) or not data or not all(isinstance(p, (str, dict)) for p in data):
        problems(where, f'a list of layer prefixes such as "model.layers.{{layer}}"; found {data!r}')
        return None
    out: list[Prefix] = []
    for k, p in enumerate(data):
        if isinstance(p, dict):
            _unknown_keys(p, PREFIX_KEYS, _at(where, k), problems)
            first = p.get("first_layer")
            if not isinstance(first, str) or not first or not isinstance(p.get("prefix"), str):
                problems(_at(where, k), '{"prefix": "model.H.layers.{layer}", "first_layer": "<config key>"} names '
                                        f"a second stack of layers; found {p!r}")
                return None
            out.append((p["prefix"], first))
        else:
            out.append((p, None))
    bad = [p for p, _ in out if _PLACEHOLDER.findall(p) != ["layer"]]
    if bad:
        problems(where, f"a layer prefix holds {{layer}} once and no other placeholder: {', '.join(map(repr, bad))}")
    if len({p for p, _ in out}) != len(out):
        problems(where, "a layer prefix is listed twice")
    return None if bad else tuple(dict.fromkeys(out))


def _short_form(data: dict, where: str, problems: Problems) -> dict | None:
    """``{"gate", "up", "down"}`` (or ``"gate_up"``) as the full form: one group."""
    if not data.get("down") or not ((data.get("gate") and data.get("up")) or data.get("gate_up")):
        problems(where, 'a scheme file needs "down" and either "gate" and "up" or "gate_up" (templates with '
                        f'{{layer}}), or "groups"; found keys {sorted(data)}')
        return None
    roles = {r: data.pop(r) for r in ROLES if r in data}
    if ("gate" in roles) != ("up" in roles):
        problems(where, '"gate" and "up" go together (or use "gate_up")')
    checked = [_template(t, _at(where, r), problems) for r, t in roles.items()]
    if not all(checked) or ("gate" in roles) != ("up" in roles):
        return None
    forms = {}
    if "gate" in roles:
        forms["separate"] = {r: roles.get(r) for r in FORM_ROLES["separate"]}
    if "gate_up" in roles:
        forms["fused"] = {r: roles.get(r) for r in FORM_ROLES["fused"]}
    lead = str(roles.get("gate") or roles.get("gate_up"))
    group = {"kind": "expert" if "{expert}" in lead else "dense", "forms": forms}
    if "layout" in data:
        group["layout"] = data.pop("layout")
    return {"name": "custom", **data, "groups": [group]}


def read_scheme(data, where: str, problems: Problems, named: dict[str, Group], prefixes: tuple[Prefix, ...],
            name: str, description: str, used: set[str] | None = None) -> Scheme | None:
    before = len(problems.found)
    if not isinstance(data, dict):
        problems(where, f"a scheme is a JSON object; found {type(data).__name__}")
        return None
    if "groups" not in data:
        data = _short_form(dict(data), where, problems)
        if data is None:
            return None
    _unknown_keys(data, SCHEME_KEYS, where, problems)
    name, description = data.get("name", name), data.get("description", description)
    model_types, only = data.get("model_types", []), data.get("by_model_type_only", False)
    for key, value in (("name", name), ("description", description)):
        if not isinstance(value, str) or not value:
            problems(_at(where, key), f"a non-empty string; found {value!r}")
    if not isinstance(model_types, list) or not all(isinstance(m, str) and m for m in model_types):
        problems(_at(where, "model_types"), f"a list of config.json model_type values; found {model_types!r}")
        model_types = []
    if not isinstance(only, bool) or (only and not model_types):
        problems(_at(where, "by_model_type_only"), 'true or false; true needs "model_types" (what selects the scheme)')
    if "layer_prefixes" in data:
        prefixes = _prefixes(data["layer_prefixes"], _at(where, "layer_prefixes"), problems) or prefixes
    entries = data["groups"]
    if not isinstance(entries, list) or not entries:
        problems(where, '"groups" is empty; declare at least one group of FFN names' if entries == [] else
                 f'"groups" is a list of groups; found {entries!r}')
        return None
    groups = []
    for i, entry in enumerate(entries):
        at = _at(_at(where, "groups"), i)
        if isinstance(entry, str):
            group = named.get(entry)
            if group is None:
                near = get_close_matches(entry, list(named), n=1)
                problems(at, f"no built-in group {entry!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
            elif used is not None:
                used.add(entry)
        else:
            group = _group(entry, at, problems)
        if group is not None:
            groups.extend(_place(group, prefixes))
    ungated = data.get("ungated", [])
    if not isinstance(ungated, list):
        problems(_at(where, "ungated"), f"a list of templates of tensors that are no gated FFN; found {ungated!r}")
        ungated = []
    ungated = [t for k, t in enumerate(ungated) if _template(t, _at(_at(where, "ungated"), k), problems)]
    own_forms = _own_forms(data.get("own_forms", {}), model_types, _at(where, "own_forms"), problems)
    if len(problems.found) > before:
        return None
    placed = tuple(dict.fromkeys(t.replace("{prefix}", p) if t.startswith("{prefix}") else t
                                 for t in ungated for p, _ in (prefixes if t.startswith("{prefix}") else [("", None)])))
    return Scheme(name, description, tuple(groups), tuple(model_types), only, placed, own_forms)


def _own_forms(data, model_types: list[str], where: str, problems: Problems) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``own_forms``: model_type -> the form (or forms) its modeling class loads the dense and shared FFNs in."""
    if not isinstance(data, dict):
        problems(where, f'an object of model_type -> form(s), e.g. {{"phi3": "fused"}}; found {data!r}')
        return ()
    out = []
    for model_type, forms in data.items():
        at = _at(where, model_type)
        forms = [forms] if isinstance(forms, str) else forms
        if model_type not in model_types:
            problems(at, "not one of the scheme's model_types")
        elif not isinstance(forms, list) or not forms or not all(f in FORMS for f in forms):
            problems(at, f"a form or a list of forms among {', '.join(FORMS)}; found {data[model_type]!r}")
        else:
            out.append((model_type, tuple(forms)))
    return tuple(out)


def load_library(path: Path = BUILTIN) -> tuple[tuple[Prefix, ...], dict[str, Group], dict[str, Scheme]]:
    """The built-in file: its layer prefixes, its groups (as declared) and its schemes, in table order.

    Raises:
        SchemeError: the file does not describe a library (every problem, by key).
    """
    problems = Problems(str(path))
    data = read_json(path)
    if not (isinstance(data, dict) and set(data) == set(LIBRARY_KEYS) and isinstance(data["groups"], dict)
            and isinstance(data["schemes"], list)):
        raise SchemeError(f"{path}: a library is an object of layer_prefixes (a list), groups (an object of named "
                          "groups) and schemes (a list)")
    prefixes = _prefixes(data["layer_prefixes"], "layer_prefixes", problems) or ()
    groups = {n: g for n, spec in data["groups"].items() if (g := _group(spec, _at("groups", n), problems, n))}
    schemes: dict[str, Scheme] = {}
    selected: dict[str, str] = {}
    used: set[str] = set()
    for i, spec in enumerate(data["schemes"]):
        at = f"schemes[{i}]" + (f" ({spec['name']})" if isinstance(spec, dict) and "name" in spec else "")
        s = read_scheme(spec, at, problems, groups, prefixes, "", "", used)
        if s is None:
            continue
        if s.name in schemes:
            problems(at, f"a second scheme named {s.name!r}")
        for m in s.model_types:
            if m in selected:
                problems(at, f"model_type {m!r} already selects {selected[m]!r}")
            selected.setdefault(m, s.name)
        schemes.setdefault(s.name, s)
    for n in groups:
        if n not in used:
            problems(_at("groups", n), "no scheme names this group")
    problems.check()
    return prefixes, groups, schemes
