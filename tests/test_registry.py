"""Naming is one kind of data: the built-in families (ffn_tools/schemes/families.json) and a user's --scheme-file
are the same JSON form, read by one reader (``families``); detection interprets what it reads."""

from __future__ import annotations

import json

import pytest

from ffn_tools import families
from ffn_tools.detect import choose_scheme, find_ffns
from ffn_tools.errors import SchemeError
from ffn_tools.io.readers import open_checkpoint
from ffn_tools.library import LAYER_PREFIXES, LIBRARY, SCHEMES, custom_scheme, load_scheme_file
from ffn_tools.registry import CANONICAL_ROLES, FORM_ROLES, PROJECTIONS, ROLES
from helpers import run_cli

BUILTIN = json.loads(families.BUILTIN.read_text())


def _names(*templates: str, layers: int = 2, experts: int = 3) -> list[str]:
    return sorted({t.format(l=l, e=e) for t in templates for l in range(layers) for e in range(experts)})


def _scheme_file(tmp_path, data) -> str:
    path = tmp_path / "scheme.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_the_registry_serves_the_builtin_file():
    prefixes, groups, schemes = families.load_library(families.BUILTIN)
    assert tuple(p for p, _ in prefixes) == LAYER_PREFIXES == tuple(
        p if isinstance(p, str) else p["prefix"] for p in BUILTIN["layer_prefixes"]) and schemes == SCHEMES
    assert list(SCHEMES) == [s["name"] for s in BUILTIN["schemes"]] and set(groups) == set(BUILTIN["groups"])
    for entry in BUILTIN["schemes"]:  # named groups expand under every layer prefix, groups outer, in file order
        own = [p if isinstance(p, str) else p["prefix"] for p in entry.get("layer_prefixes", LAYER_PREFIXES)]
        if all(isinstance(g, str) for g in entry["groups"]):
            assert [(g.name, g.prefix) for g in SCHEMES[entry["name"]].groups] == \
                [(n, p) for n in entry["groups"] for p in own]
    assert [g.prefix for g in SCHEMES["ffn-tools"].groups] == ["", "", ""]  # whole names: placed once
    assert len(set(LIBRARY)) == len(LIBRARY) and not set(SCHEMES["moshi"].groups) & set(LIBRARY)
    selected = [m for s in SCHEMES.values() for m in s.model_types]
    assert len(selected) == len(set(selected))


def test_every_family_is_a_scheme_file_a_user_could_write(tmp_path):
    for entry in BUILTIN["schemes"]:
        assert load_scheme_file(_scheme_file(tmp_path, entry)) == SCHEMES[entry["name"]], entry["name"]
        inline = [{"name": g, **BUILTIN["groups"][g]} if isinstance(g, str) else g for g in entry["groups"]]
        assert load_scheme_file(_scheme_file(tmp_path, {**entry, "groups": inline})) == SCHEMES[entry["name"]]


def test_one_roles_table():
    assert ROLES == (*PROJECTIONS, "gate_up") and PROJECTIONS == ("gate", "up", "down")
    assert CANONICAL_ROLES == ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
    assert all(set(roles) <= set(ROLES) for roles in FORM_ROLES.values())
    assert all(set(f.templates()) == set(FORM_ROLES[n]) for g in LIBRARY for n, f in g.forms.items())


@pytest.mark.parametrize("arch, scheme, groups", [
    ("llama", "hf", ["mlp"]), ("phi3", "hf", ["mlp"]), ("mixtral", "mixtral", ["block_sparse_moe.experts.w"]),
    ("qwen2_moe", "qwen-moe", ["mlp.experts", "mlp.shared_expert"])])
def test_real_checkpoints_get_the_same_families(model_dir, arch, scheme, groups):
    with open_checkpoint(model_dir(arch)) as c:
        found = find_ffns(c)
    assert found.scheme.name == scheme and sorted({g.name for g in found.scheme.groups}) == groups


P = "model.layers.{l}"
STACKED = (f"{P}.mlp.experts.gate_up_proj", f"{P}.mlp.experts.down_proj")
EXPERTS = tuple(f"{P}.mlp.experts.{{e}}.{r}_proj.weight" for r in ("gate", "up", "down"))


@pytest.mark.parametrize("templates, model_type, scheme, prefix", [
    (STACKED, None, "v5-experts", "model.layers.{layer}"),  # the same names: table order, then model_type
    (STACKED, "gpt_oss", "gpt-oss", "model.layers.{layer}"),
    ((f"{P}.mlp.fc1.weight", f"{P}.mlp.fc2.weight"), "moshi", "moshi", "model.layers.{layer}"),
    (EXPERTS, None, "v5-experts", "model.layers.{layer}"),
    (EXPERTS, "qwen3_moe", "qwen-moe", "model.layers.{layer}"),
    (tuple(f"model.language_model.layers.{{l}}.mlp.{r}_proj.weight" for r in ("gate", "up", "down")), None, "hf",
     "model.language_model.layers.{layer}"),
    (tuple(f"layers.{{l}}.{r}.weight" for r in ("gate", "up", "down")), None, "ffn-tools", "")])
def test_detection_breaks_ties_as_the_table_says(templates, model_type, scheme, prefix):
    chosen = choose_scheme(_names(*templates), {"model_type": model_type} if model_type else None)
    assert chosen.name == scheme and {g.prefix for g in chosen.groups} == {prefix}


def test_by_model_type_only_names_need_their_model_type():
    with pytest.raises(SchemeError, match="no gated FFN tensors found"):
        choose_scheme(_names(f"{P}.mlp.fc1.weight", f"{P}.mlp.fc2.weight"), None)


def test_a_user_file_uses_prefixes_and_builtin_groups(tmp_path):
    short = load_scheme_file(_scheme_file(tmp_path, {
        "gate": "{prefix}.ffn.W_gate.weight", "up": "{prefix}.ffn.W_up.weight", "down": "{prefix}.ffn.W_down.weight"}))
    assert short.name == "custom" and [g.prefix for g in short.groups] == list(LAYER_PREFIXES)
    names = _names(*(f"model.language_model.layers.{{l}}.ffn.W_{r}.weight" for r in ("gate", "up", "down")))
    found = choose_scheme(names, None, within=short)
    assert [g.prefix for g in found.groups] == ["model.language_model.layers.{layer}"]
    mine = load_scheme_file(_scheme_file(tmp_path, {
        "name": "mine", "model_types": ["my_moe"], "layer_prefixes": ["blocks.{layer}"],
        "groups": ["mlp.experts", {"name": "ffn", "kind": "dense", "layout": {"order": "up-gate"}, "forms": {
            "fused": {"gate_up": "{prefix}.ffn.w13.weight", "down": "{prefix}.ffn.w2.weight"}}}]}))
    assert [(g.name, g.prefix) for g in mine.groups] == [("mlp.experts", "blocks.{layer}"), ("ffn", "blocks.{layer}")]
    assert mine.groups[0].forms["stacked"].gate_up == "blocks.{layer}.mlp.experts.gate_up_proj"
    assert mine.groups[1].layout.order == "up-gate" and mine.model_types == ("my_moe",)


def test_command_line_templates_are_the_short_form():
    s = custom_scheme("{prefix}.mlp.W_gate.weight", "{prefix}.mlp.W_up.weight", "{prefix}.mlp.W_down.weight")
    assert s.name == "custom" and len(s.groups) == len(LAYER_PREFIXES) and s.groups[0].kind == "dense"
    with pytest.raises(SchemeError) as e:
        custom_scheme("x.{layer}.{expert}.g", "x.{layer}.{expert}.u", "x.{layer}.d")
    assert str(e.value) == ("groups[0].forms.separate: every template of this expert form names its {expert}; "
                            "missing from down")


@pytest.mark.parametrize("data, message", [
    ('{"gate": 1, "gate": 2}', "key 'gate' appears twice in one object"),
    ([1], "a scheme file holds a JSON object"),
    ({"groups": []}, '"groups" is empty; declare at least one group of FFN names'),
    ({"groups": ["mlp.expert"]}, "groups[0]: no built-in group 'mlp.expert'; did you mean 'mlp.experts'?"),
    ({"model_type": ["x"], "groups": ["mlp"]}, "model_type: unknown key; did you mean 'model_types'?"),
    ({"gate": "a.{layer}.g", "up": "a.{layer}.u", "down": "a.{layers}.d"},
     "down: template 'a.{layers}.d': unknown placeholder {layers}; templates use {layer}, {expert} and {prefix}"),
    ({"groups": [{"kind": "expert", "forms": {"stacked": {"gate_up": "e.{layer}.gu",
                                                          "down": "e.{layer}.{expert}.d"}}}]},
     "groups[0].forms.stacked: a stacked form has no {expert}; found it in down"),
    ({"groups": [{"kind": "expert", "forms": {"stacked": {"gate_up": "e.{layer}.gu", "down": "e.{layer}.d",
                                                          "transposed": True}}}]},
     'groups[0].forms.stacked: stored (in, out), gate and up share the columns of gate_up: the group needs '
     '"layout": {"axis": "columns"}'),
    ({"groups": [{"kind": "dense", "forms": {"fused": {"gate_up": "{prefix}.w13", "down": "x.{layer}.w2"}}}]},
     "groups[0]: start every template of the group with {prefix}, or none"),
    ({"layer_prefixes": ["blocks"], "groups": ["mlp"]},
     "layer_prefixes: a layer prefix holds {layer} once and no other placeholder: 'blocks'"),
    ({"groups": [{"kind": "dense", "forms": {"fused": {"gate_up": "x.{layer}.w13", "down": "x.{layer}.w2"}},
                  "layout": {"tp": 2}}]}, 'groups[0].layout: "tp": 2 needs "arrangement": "tp"'),
    ({"groups": [{"kind": "expert", "forms": {"flat-separate": {"gate": "x.{layer}.w1", "up": "x.{layer}.v1",
                                                                "down": "x.{layer}.w2"}}}]},
     'groups[0].forms.flat-separate: a flat form names the config.json key holding the number of experts: '
     '"experts": "num_experts"; found None'),
    ({"groups": [{"kind": "expert", "forms": {"stacked": {"gate_up": "x.{layer}.gu", "down": "x.{layer}.d",
                                                          "experts": "n"}}}]},
     "groups[0].forms.stacked.experts: only a flat form (experts flattened into dim 0) reads the number of experts "
     "from config.json"),
    ({"groups": [{"kind": "expert", "forms": {"stacked": {"gate_up": "x.{layer}.gu", "down": "x.{layer}.d",
                                                          "transposed": ["gate"]}}}]},
     "groups[0].forms.stacked.transposed: true, false, or a list of the roles stored (in, out) among gate_up, "
     "down; found ['gate']"),
    ({"groups": [{"kind": "shared", "first_expert": "n", "forms": {"separate": {
        "gate": "x.{layer}.g", "up": "x.{layer}.u", "down": "x.{layer}.d"}}}]},
     "groups[0].first_expert: numbers experts; the group is shared"),
    ({"layer_prefixes": [{"prefix": "h.{layer}"}], "groups": ["mlp"]},
     'layer_prefixes[0]: {"prefix": "model.H.layers.{layer}", "first_layer": "<config key>"} names a second stack '
     "of layers; found {'prefix': 'h.{layer}'}"),
    ({"groups": [{"kind": "dense", "forms": {"fused": {"gate_up": "x.{layer}.gu", "down": "x.{layer}.d",
                                                       "separate_biases": True}}}]},
     "groups[0].forms: a fused form with separate_biases names its biases as the separate form does: declare that "
     "form too"),
    ({"groups": [{"kind": "dense", "forms": {"separate": {"gate": "x.{layer}.g", "up": "x.{layer}.u",
                                                          "down": "x.{layer}.d", "separate_biases": True}}}]},
     "groups[0].forms.separate.separate_biases: true on a fused form whose gate and up biases are stored apart "
     "(named as the group's separate form names them); found True"),
    ({"groups": ["mlp"], "ungated": "x.{layer}.fc1.weight"},
     "ungated: a list of templates of tensors that are no gated FFN; found 'x.{layer}.fc1.weight'"),
    ({"groups": ["mlp"], "ungated": ["router.fc1.weight"]},
     "ungated[0]: template 'router.fc1.weight': needs {layer} (or a leading {prefix}, which holds it) once, and may "
     "use {expert} once"),
    ({"groups": ["mlp"], "model_types": ["m"], "own_forms": {"n": "fused"}},
     "own_forms.n: not one of the scheme's model_types"),
    ({"groups": ["mlp"], "model_types": ["m"], "own_forms": {"m": ["fused", "joined"]}},
     "own_forms.m: a form or a list of forms among separate, fused, stacked, stacked-separate, flat-separate; found "
     "['fused', 'joined']"),
])
def test_scheme_file_errors_name_the_key(tmp_path, data, message):
    path = _scheme_file(tmp_path, data)
    with pytest.raises(SchemeError) as e:
        load_scheme_file(path)
    assert str(e.value) == f"{path}: {message}"


def test_every_problem_of_a_file_at_once(tmp_path):
    path = _scheme_file(tmp_path, {"groups": [{"kind": "dens",
                                               "forms": {"separate": {"gate": "a.{layer}.g", "up": 3}}}]})
    with pytest.raises(SchemeError) as e:
        load_scheme_file(path)
    assert str(e.value) == (
        f"{path}: 3 problems: groups[0].kind: one of dense, expert, shared; found 'dens'; groups[0].forms.separate: "
        "form 'separate' of the dens group needs exactly down, gate, up; found gate, up; groups[0].forms.separate.up: "
        "a template is a tensor name with {layer}; found 3")


def test_a_bad_scheme_file_is_a_usage_error(tmp_path, model_dir):
    path = _scheme_file(tmp_path, {"groups": ["mlp"], "model_types": "llama"})
    r = run_cli("inspect", model_dir("llama"), "--scheme-file", path, ok=False)
    assert r.exit_code == 2
    assert f"Error: {path}: model_types: a list of config.json model_type values; found 'llama'" in r.output


def test_the_library_is_checked_as_a_whole(tmp_path):
    data = json.loads(families.BUILTIN.read_text())
    data["groups"]["unused"] = data["groups"]["mlp"]
    data["schemes"][1]["model_types"].append("llama")
    data["schemes"][2]["groups"][0] = "mlp.expert"
    path = tmp_path / "families.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemeError) as e:
        families.load_library(path)
    assert str(e.value) == (
        f"{path}: 3 problems: schemes[1] (v5-experts): model_type 'llama' already selects 'hf'; "
        "schemes[2] (qwen-moe).groups[0]: no built-in group 'mlp.expert'; did you mean 'mlp.experts'?; "
        'groups.unused: no scheme names this group')


def _flat_checkpoint(tmp_path, experts=4, h=8, i=6, config=True):
    """DBRX's naming: w1, v1 (E * I, H) and w2 stored (in, out), (E * I, H); and the torch tensors per expert."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    g, u, d = torch.randn(experts, i, h), torch.randn(experts, i, h), torch.randn(experts, h, i)
    p = "transformer.blocks.0.ffn.experts.mlp"
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file({f"{p}.w1": g.flatten(0, 1), f"{p}.v1": u.flatten(0, 1), f"{p}.w2": d.transpose(1, 2).flatten(0, 1)},
              tmp_path / "model.safetensors")
    if config:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "dbrx",
                                                          "ffn_config": {"moe_num_experts": experts}}))
    return tmp_path, (g, u, d)


def test_flat_experts_read_as_their_modeling_code_views_them(tmp_path):
    from ffn_tools.ffn import canonical_weights

    path, (g, u, d) = _flat_checkpoint(tmp_path)
    with open_checkpoint(path) as c:
        found = find_ffns(c)
        assert found.scheme.name == "dbrx" and len(found.ffns) == 4
        for f in found.ffns:
            w = canonical_weights(c, f)
            e = f.ref.expert
            assert torch_equal(w["gate"], g[e]) and torch_equal(w["up"], u[e]) and torch_equal(w["down"], d[e])


def test_flat_experts_need_their_count(tmp_path):
    path, _ = _flat_checkpoint(tmp_path, config=False)
    (path / "config.json").write_text(json.dumps({"model_type": "dbrx"}))
    with open_checkpoint(path) as c, pytest.raises(SchemeError) as e:
        find_ffns(c)
    assert "the flat-separate form of 'ffn.experts.mlp' reads config.json key 'ffn_config.moe_num_experts'" \
        in str(e.value)


def test_flat_experts_round_trip_through_the_stacked_form(tmp_path):
    from ffn_tools.gateup import fuse_gateup, split_gateup
    from helpers import assert_identical, tensors

    path, _ = _flat_checkpoint(tmp_path / "src")
    fuse_gateup(path, tmp_path / "fused")
    assert sorted(tensors(tmp_path / "fused")) == ["transformer.blocks.0.ffn.experts.down_proj",
                                                   "transformer.blocks.0.ffn.experts.gate_up_proj"]
    split_gateup(tmp_path / "fused", tmp_path / "back")
    assert_identical(tensors(path), tensors(tmp_path / "back"))


def test_a_second_stack_of_layers_is_numbered_after_the_first(tmp_path):
    names = _names(*(f"model.{s}_module.layers.{{l}}.mlp.{r}_proj.weight" for s in "LH"
                     for r in ("gate", "up", "down")))
    with pytest.raises(SchemeError, match="ambiguous FFN naming"):  # two roots numbered alike
        choose_scheme(_names(f"{P}.mlp.gate_proj.weight", f"{P}.mlp.up_proj.weight", f"{P}.mlp.down_proj.weight")
                      + [n.replace("model.layers", "model.model.layers") for n in _names(
                          f"{P}.mlp.gate_proj.weight", f"{P}.mlp.up_proj.weight", f"{P}.mlp.down_proj.weight")],
                      None)
    chosen = choose_scheme(names, {"model_type": "hrm_text"})
    assert chosen.name == "hrm" and [g.first_layer for g in chosen.groups] == [None, "num_layers_per_stack"]
    assert [g.offsets({"num_layers_per_stack": 2}) for g in chosen.groups] == [(0, 0), (2, 0)]


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_a_family_declares_its_ungated_look_alikes(tmp_path):
    """Tensors a scheme declares ungated (a router's MLP) are outside the FFNs, not unmatched; undeclared, they are."""
    import torch
    from safetensors.torch import save_file

    p = "model.layers.0.mlp"
    w = {f"{p}.gate_proj.weight": torch.ones(6, 4), f"{p}.up_proj.weight": torch.ones(6, 4),
         f"{p}.down_proj.weight": torch.ones(4, 6), f"{p}.gate.router_mlp.fc1.weight": torch.ones(4, 4)}
    tmp_path.mkdir(exist_ok=True)
    save_file(w, tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path) as c:
        assert find_ffns(c).unmatched == (f"{p}.gate.router_mlp.fc1.weight",)
        (tmp_path / "s").mkdir()
        mine = load_scheme_file(_scheme_file(tmp_path / "s", {"groups": ["mlp"],
                                                              "ungated": ["{prefix}.mlp.gate.router_mlp.fc1.weight"]}))
        found = find_ffns(c, mine)
    assert found.unmatched == () and len(found.ffns) == 1 and f"{p}.gate.router_mlp.fc1.weight" not in found.tensors
    assert "model.layers.{layer}.mlp.gate.router_mlp.fc1.weight" in mine.ungated
