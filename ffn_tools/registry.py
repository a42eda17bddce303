"""Where FFN tensors live, declared as data: naming schemes with ``{layer}`` / ``{expert}`` templates.

A ``Scheme`` is a naming family (Hugging Face Llama-style, Meta-native, Mixtral, Qwen-MoE, ...). It has one
``Group`` per kind of FFN it contains (dense MLPs, routed experts, the shared expert), and each group lists
the *forms* its tensors can take, so that splitting and fusing move between forms of the same scheme:

    separate          gate, up, down per FFN
    fused             gate_up (layout: ``Group.layout``) and down per FFN
    stacked           experts stacked on dim 0: gate_up (E, 2I, H) and down (E, H, I), transformers v5
    stacked-separate  experts stacked on dim 0, separate: gate, up (E, I, H) and down (E, H, I), MLX

Weights are PyTorch (out, in). A bias is named like its weight with ``.weight`` -> ``.bias`` (or, for a
name without ``.weight``, with ``_bias`` appended, as GPT-OSS stores stacked expert biases).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SchemeError
from .layouts import CONCAT, GateUpLayout

KINDS = ("dense", "expert", "shared")
FORMS = ("separate", "fused", "stacked", "stacked-separate")
# The roles each form names.
FORM_ROLES = {"separate": {"gate", "up", "down"}, "fused": {"gate_up", "down"}, "stacked": {"gate_up", "down"},
              "stacked-separate": {"gate", "up", "down"}}
ROLES = ("gate", "up", "down", "gate_up")
PLACEHOLDERS = ("layer", "expert")


@dataclass(frozen=True)
class Form:
    """Tensor-name templates of one FFN in one storage form (unused roles are None).

    ``transposed``: the weights are stored (in, out), as GPT-OSS, Llama-4 and Aria store stacked experts:
    gate_up (E, H, 2I) with the layout's ``columns`` axis, down (E, I, H). Readers transpose them back.
    """

    gate: str | None = None
    up: str | None = None
    down: str | None = None
    gate_up: str | None = None
    stacked: bool = False
    transposed: bool = False

    @property
    def fused(self) -> bool:
        return self.gate_up is not None

    def templates(self) -> dict[str, str]:
        """role -> weight-name template, for the roles this form has."""
        return {r: t for r in ROLES if (t := getattr(self, r)) is not None}


@dataclass(frozen=True)
class Group:
    """One kind of FFN in a scheme and the forms its tensors take.

    ``name`` says where the group lives relative to its layer (``mlp.experts``); a checkpoint's FFNs are
    the union of the groups that match it (see ``detect``), named after the family that holds them all.
    """

    kind: str
    forms: dict[str, Form]
    layout: GateUpLayout = CONCAT
    name: str = ""
    prefix: str = ""  # the layer prefix its templates start with (``model.layers.{layer}``), for messages

    def __hash__(self) -> int:
        return hash((self.kind, self.name, self.prefix, tuple(sorted(self.forms.items())), self.layout))


@dataclass(frozen=True)
class Scheme:
    """A naming family. ``model_types`` are config.json ``model_type`` values that select it."""

    name: str
    description: str
    groups: tuple[Group, ...]
    model_types: tuple[str, ...] = field(default=())
    by_model_type_only: bool = False  # its names also mean something ungated (fc1/fc2): match only when selected


def bias_name(weight_name: str) -> str:
    """The bias tensor that belongs to a weight tensor."""
    return weight_name[: -len("weight")] + "bias" if weight_name.endswith(".weight") else weight_name + "_bias"


@functools.lru_cache(maxsize=None)
def compile_template(template: str) -> re.Pattern:
    """A regex matching the tensor names of a template, with named groups for its placeholders.

    Cached: detection and verify match every template against every tensor name.

    Raises:
        SchemeError: the template has no {layer}, or an unknown {placeholder}.
    """
    unknown = set(re.findall(r"\{(\w*)\}", template)) - set(PLACEHOLDERS)
    if unknown or "{layer}" not in template:
        raise SchemeError(f"template {template!r}: needs {{layer}} and may use {{expert}}; "
                          f"unknown placeholders: {', '.join(sorted(unknown)) or 'none'}")
    pattern = re.escape(template)
    for p in PLACEHOLDERS:
        pattern = pattern.replace(re.escape("{" + p + "}"), f"(?P<{p}>[0-9]+)")
    return re.compile(pattern)


def custom_scheme(gate: str | None = None, up: str | None = None, down: str | None = None,
                  gate_up: str | None = None, layout: GateUpLayout = CONCAT) -> Scheme:
    """A one-group scheme from ``--gate/--up/--down`` (or ``--gate-up``) templates.

    Raises:
        SchemeError: a template is missing or malformed.
    """
    if not down or not ((gate and up) or gate_up):
        raise SchemeError("custom templates need --down and either both --gate and --up or --gate-up")
    kind = "expert" if "{expert}" in (gate or gate_up or "") else "dense"
    forms = {}
    if gate and up:
        forms["separate"] = Form(gate=gate, up=up, down=down)
    if gate_up:
        forms["fused"] = Form(gate_up=gate_up, down=down)
    for f in forms.values():
        for t in f.templates().values():
            compile_template(t)
    return Scheme("custom", "templates given on the command line", (Group(kind, forms, layout),))


def load_scheme_file(path: str | Path) -> Scheme:
    """Read a scheme from JSON.

    Either the short form ``{"gate": T, "up": T, "down": T}`` (or ``"gate_up"``), or the full form
    ``{"name": ..., "groups": [{"kind": "dense", "forms": {"separate": {"gate": T, ...}},
    "layout": {"order": "gate-up", "arrangement": "concat", "tp": 1}}]}``.

    Raises:
        SchemeError: the file is missing, not JSON, or does not describe a scheme.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SchemeError(f"{path}: cannot read scheme file ({e})") from None
    if not isinstance(data, dict):
        raise SchemeError(f"{path}: a scheme file holds a JSON object")
    if "groups" not in data:
        if not data.get("down") or not ((data.get("gate") and data.get("up")) or data.get("gate_up")):
            raise SchemeError(f"{path}: a scheme file needs \"down\" and either \"gate\" and \"up\" or "
                              f"\"gate_up\" (templates with {{layer}}), or \"groups\"; found keys {sorted(data)}")
        return custom_scheme(**{k: data.get(k) for k in ROLES})
    try:
        groups = []
        if not data["groups"]:
            raise SchemeError(f"{path}: \"groups\" is empty; declare at least one group of FFN names")
        for g in data["groups"]:
            forms = {name: Form(stacked=name.startswith("stacked"), **spec) for name, spec in g["forms"].items()}
            bad = set(forms) - set(FORMS)
            if g["kind"] not in KINDS or bad:
                raise SchemeError(f"{path}: kind must be one of {KINDS}, forms among {FORMS}")
            for name, f in forms.items():
                need = FORM_ROLES[name]
                if set(f.templates()) != need:
                    raise SchemeError(f"{path}: form {name!r} of the {g['kind']} group needs exactly "
                                      f"{', '.join(sorted(need))}; found {', '.join(sorted(f.templates())) or 'none'}")
                for t in f.templates().values():
                    compile_template(t)
            groups.append(Group(g["kind"], forms, GateUpLayout(**g.get("layout", {}))))
        return Scheme(str(data.get("name", path.stem)), f"from {path}", tuple(groups),
                      tuple(data.get("model_types", ())))
    except (KeyError, TypeError) as e:
        raise SchemeError(f"{path}: malformed scheme ({type(e).__name__}: {e}); see --help for the format") from None


def scheme_for_model_type(model_type: str | None) -> Scheme | None:
    """The family a config's ``model_type`` selects, if any."""
    for s in SCHEMES.values():
        if model_type in s.model_types:
            return s
    return None



# The data: every group and family (``families``), read by detection through these names.
from .families import LAYER_PREFIXES, LIBRARY, SCHEMES  # noqa: E402, F401  (re-exported; families needs the classes above)
