"""MLX -> Hugging Face: the tensors mlx_lm's ``sanitize`` computed, traced back (``converters/mlx/inverse.py``).

torch -> MLX -> torch gives the source's names and bytes wherever sanitize only moved data (DeepSeek-V3's
``embed_q``/``unembed_out`` from ``kv_b_proj``, conv weights turned, ``language_model.`` prefixes, flat or fused
experts), and transformers loads it. Where sanitize added a constant that rounded (Qwen3-Next's norms ``+ 1.0``)
the view says so by name, and the tensors read back are what the MLX model computes with: exporting them again
gives the same MLX bytes. What sanitize drops stays dropped, listed.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from helpers import assert_identical, once, tensors

from ffn_tools.converters import convert, open_any
from ffn_tools.errors import FFNToolsError
from ffn_tools.io.readers import open_checkpoint
from ffn_tools.converters.pytorch.client import check_transformers

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from ffn_tools.converters.mlx import inverse  # noqa: E402
from ffn_tools.converters.mlx.probe import NotRearranged, Probe  # noqa: E402
from ffn_tools.ops import Copy  # noqa: E402
from ffn_tools.plan import Entry  # noqa: E402
from test_zoo_mlx import REFUSED, _built, _candidates, _exported, allowed  # noqa: E402
# allowed(model_type): the setting mlx_lm and transformers run otherwise (jamba's norm_topk_prob), allowed on both
# ways: these tests check names and bytes; test_zoo_mlx, that each way is refused unless told

# model_type -> the source tensors mlx_lm's sanitize drops (asserted: they are exactly the ones missing).
DROPPED = {"ernie4_5_moe": ["model.layers.1.mlp.moe_statics.e_score_correction_bias"]}
# model_types whose sanitize adds 1.0 to the norms (asserted: exactly those tensors are read back rounded).
NORMS_PLUS_ONE = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}
NORM = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
        ".k_norm.weight")
# what sanitize computes, by type (asserted: read back from the MLX tensors named so)
GATHERED = {"deepseek_v3": ("embed_q", "unembed_out"), "glm4_moe_lite": ("embed_q", "unembed_out"),
            "lfm2_moe": ("conv.conv",), "falcon_h1": ("conv1d",), "jamba": ("conv1d",), "qwen3_next": ("conv1d",),
            "qwen3_5_text": ("conv1d",)}
KEY_TYPES = ["deepseek_v3", "glm4_moe_lite", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lfm2_moe",
             "falcon_h1", "jamba"]


@pytest.fixture(scope="module")
def sources(request):
    """``sources(type, dtype) -> Path``: the tiny zoo checkpoint of ``type`` (test_zoo_mlx's, made once per run),
    in float32 or cast to bfloat16 (read-only)."""

    def get(model_type: str, dtype: str = "float32") -> Path:
        src, _ = _built(request, model_type)
        if dtype == "float32":
            return src
        return once(src.parent / dtype, lambda tmp: convert(src, "torch", tmp, dtype=dtype))

    return get


def _mlx(request, sources, model_type: str, dtype: str, tmp_path: Path) -> Path:
    """The MLX export of ``sources(model_type, dtype)``: in float32 test_zoo_mlx's, made once per run."""
    if dtype == "float32":
        return _exported(request, model_type)
    convert(sources(model_type, dtype), "mlx", tmp_path / "mlx", allow_config=allowed(model_type))
    return tmp_path / "mlx"


def _round_trip(request, sources, model_type: str, dtype: str, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(the MLX export of ``sources(model_type, dtype)`` (``_mlx``), its ``convert --to torch``, that converted back
    to MLX): in float32 from test_zoo_mlx's export, made once per run (read-only; test_every_zoo_export_reads_back
    and test_deepseek_v3_round_trip_is_bit_exact_and_verifies read back the same export)."""
    mlx = _mlx(request, sources, model_type, dtype, tmp_path)
    allow = allowed(model_type)
    if dtype != "float32":
        convert(mlx, "torch", tmp_path / "back", allow_config=allow)
        convert(tmp_path / "back", "mlx", tmp_path / "again", allow_config=allow)
        return mlx, tmp_path / "back", tmp_path / "again"
    back = once(mlx.parent / "mlx-back", lambda tmp: convert(mlx, "torch", tmp, allow_config=allow))
    return mlx, back, once(mlx.parent / "mlx-again", lambda tmp: convert(back, "mlx", tmp, allow_config=allow))


def _rounded_ok(model_type: str, names: set[str], src: dict, back: dict, mlx: Path, again: Path) -> None:
    """The tensors read back rounded are the norms sanitize adds 1.0 to; MLX of the read-back model is the
    MLX model it was read from, bit for bit (what mlx_lm computes with is kept exactly)."""
    want = {n for n in src if n.endswith(NORM) and src[n].dim() == 1} if model_type in NORMS_PLUS_ONE else set()
    assert names <= want, sorted(names - want)
    for n in want:
        x, y = src[n], back[n]
        assert x.dtype == y.dtype and torch.equal(x + 1.0, y + 1.0), n  # the same value plus one: x + 1 rounded
    assert_identical(tensors(again), tensors(mlx))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", KEY_TYPES)
def test_torch_mlx_torch_gives_the_source(model_type, dtype, sources, tmp_path, request):
    src = sources(model_type, dtype)
    mlx, back, again = _round_trip(request, sources, model_type, dtype, tmp_path)
    with open_any(mlx) as view:
        assert view.inverse.skipped is None and not view.inverse.refused
        for n in view:
            view.read_raw(n)
        rounded = set(view.rounded)
        gathered = {o for s in view.inverse.sources.values() if s.kind == "gathered" for o in s.outputs}
    assert all(any(g in o for o in gathered) for g in GATHERED.get(model_type, ())), sorted(gathered)
    a, b = tensors(src), tensors(back)
    exact = {n: t for n, t in a.items() if n not in rounded}
    assert sorted(a) == sorted(b)
    assert_identical({n: b[n] for n in exact}, exact)
    _rounded_ok(model_type, rounded, a, b, mlx, again)
    assert json.loads((back / "config.json").read_text())["model_type"] == model_type
    assert check_transformers(open_checkpoint(back)).ok
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = AutoModelForCausalLM.from_pretrained(back, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_deepseek_v3_round_trip_is_bit_exact_and_verifies(sources, tmp_path, request):
    """The bar: kv_b_proj comes back from embed_q and unembed_out byte for byte, and verify pairs it."""
    import ffn_tools

    src, mlx = sources("deepseek_v3"), _exported(request, "deepseek_v3")
    raw = tensors(mlx)
    assert "model.layers.0.self_attn.embed_q.weight" in raw and "model.layers.0.self_attn.kv_b_proj.weight" not in raw
    with open_any(mlx) as view:
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        assert view.made_from(name) == ("model.layers.0.self_attn.embed_q.weight",
                                        "model.layers.0.self_attn.unembed_out.weight")
        assert view.info(name).start is None and view.quantized(name) is None
    assert allowed("deepseek_v3") == []  # so its export's convert --to torch is this one (_round_trip's)
    _, back, _ = _round_trip(request, sources, "deepseek_v3", "float32", tmp_path)
    assert_identical(tensors(back), tensors(src))
    report = ffn_tools.verify(src, mlx, backends=["reference"], tokens=4)
    assert report.passed, report.failures()


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_5_moe_text", "mixtral"])
def test_quantized_mlx_reads_back_with_the_source_names(model_type, sources, tmp_path):
    src = sources(model_type)
    convert(src, "mlx", tmp_path / "q", quantize=True, q_group_size=32)
    convert(tmp_path / "q", "torch", tmp_path / "back")
    a, b = tensors(src), tensors(tmp_path / "back")
    assert sorted(a) == sorted(b)
    for n, t in a.items():
        err = (b[n].double() - t.double()).abs().max().item()
        assert b[n].shape == t.shape and err < 0.1 * max(1.0, t.abs().max().item()), (n, err)
    with open_any(tmp_path / "q") as view:
        q = [n for n in view if view.quantized(n)]
        assert q and all(view.quantized_parts(n) is not None for n in q if view.inverse.sources[n].kind != "gathered")
    meta = json.loads(open_checkpoint(tmp_path / "back").metadata["ffn_tools_dequantized_from"])
    assert meta["format"] == "mlx" and meta["weights"] == len(q)


def _zoo_types() -> list[str]:
    return [t for t in _candidates() if t not in REFUSED]


@pytest.mark.parametrize("model_type", _zoo_types())
def test_every_zoo_export_reads_back(model_type, sources, request, tmp_path):
    """Every zoo type the MLX zoo test exports: the source's names and bytes come back, but for what
    ``DROPPED`` and ``NORMS_PLUS_ONE`` say, and transformers' load check passes."""
    src, built = _built(request, model_type)
    if not built["tested"]:
        pytest.skip("not gated, or not tiny (test_zoo covers it)")
    mlx = _exported(request, model_type)
    with open_any(mlx) as view:
        assert view.inverse.skipped is None and not view.inverse.refused, view.inverse.refused
        assert view.inverse.dropped == DROPPED.get(model_type, [])
        back = {n: view[n].clone() for n in view}
        rounded = set(view.rounded)
    a = tensors(src)
    assert sorted(a) == sorted([*back, *view.inverse.dropped])
    assert_identical({n: back[n] for n in back if n not in rounded}, {n: a[n] for n in back if n not in rounded})
    if rounded:  # converted back and forth as test_torch_mlx_torch_gives_the_source does (_round_trip)
        _, _, again = _round_trip(request, sources, model_type, "float32", tmp_path)
        _rounded_ok(model_type, rounded, a, back, mlx, again)
    else:
        assert model_type not in NORMS_PLUS_ONE


def test_without_transformers_model_the_mlx_names_stay(tmp_path, monkeypatch, caplog, request):
    """Where transformers cannot build the source's model, nothing is traced: MLX names, experts unstacked."""
    mlx = _exported(request, "deepseek_v3")

    def refuse(config):
        raise FFNToolsError("transformers cannot build 'deepseek_v3' (test)")

    monkeypatch.setattr(inverse, "source_layout", refuse)
    with caplog.at_level(logging.INFO), open_any(mlx) as view:
        assert view.inverse.skipped == "transformers cannot build 'deepseek_v3' (test)"
        assert "model.layers.0.self_attn.embed_q.weight" in view
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in view  # the stack unstacked by name
    assert "MLX names kept" in caplog.text


class _Model:
    """A stand-in mlx_lm model whose sanitize is ``fn``."""

    def __init__(self, fn):
        self.fn = fn

    def sanitize(self, weights):
        return self.fn(dict(weights))


def _probe(fn, shapes):
    view = [Entry(n, "F32", s, (n,), (Copy(),), sources=(("F32", tuple(s)),), text="")
            for n, s in shapes.items()]
    return Probe(lambda: _Model(fn), shapes, view, "F32")


def test_probe_inverts_data_movement_and_offsets():
    probe = _probe(lambda w: {"t": w["a"].reshape(2, 3, 4).swapaxes(1, 2), "n": w["b"] + 1.0}, {"a": (6, 4), "b": (5,)})
    t = probe.trace("t")
    assert t.offsets is None and probe.owners(t) == ["a"] and probe.covered("a", [t]) == 24
    assert sorted(t.sources.tolist()) == list(range(24))
    n = probe.trace("n")
    assert n.offsets.tolist() == [1.0] * 5 and probe.owners(n) == ["b"]


@pytest.mark.parametrize("fn,why", [
    (lambda w: {"t": w["a"] * 2.0}, "not moved from the input"),  # a folded multiplier
    (lambda w: {"t": (w["a"] + w["a"][::-1]) / 2}, "combines input values"),  # a mean that can look like a move
    (lambda w: {"t": w["a"].astype(mx.float16)}, "sanitize"),  # a cast that rounds the probe
])
def test_probe_refuses_what_is_not_a_rearrangement(fn, why):
    with pytest.raises(NotRearranged, match=why):
        _probe(fn, {"a": (64, 64)}).trace("t")


@pytest.mark.parametrize("original", [False, True], ids=["module-names", "original-format"])
def test_stacked_experts_come_back_as_the_source_saved_them(original, tmp_path):
    """torch -> MLX -> torch of a transformers-5 MoE gives the source's tensors back under its own names: stacked
    ``experts.gate_up_proj`` (E, 2I, H) / ``down_proj`` where it was saved with ``save_original_format=False``
    (per expert before: the export now records how the source named them), per expert where it was saved in the
    original format (save_pretrained's default); the changes line says which; verify passes against the source."""
    from helpers import run_cli
    from tiny_models import make_model

    from ffn_tools.converters.mlx.inverse import MODULE_NAMES, ORIGINAL, SAVED_AS

    src, mlx, back = tmp_path / "src", tmp_path / "mlx", tmp_path / "back"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_model("qwen3_moe").save_pretrained(src, save_original_format=original)
    stacked = [n for n in tensors(src) if n.endswith("experts.gate_up_proj")]
    assert bool(stacked) is not original, sorted(tensors(src))  # the two forms transformers 5 writes
    convert(src, "mlx", mlx)
    with open_checkpoint(mlx) as raw_mlx:  # the record mlx_lm ignores
        assert raw_mlx.metadata[SAVED_AS] == (ORIGINAL if original else MODULE_NAMES)
    summary = convert(mlx, "torch", back)
    assert_identical(tensors(back), tensors(src))  # names, shapes, dtypes, bytes
    said = [line for line in summary["changes"] if line.startswith("experts read back")]
    assert said == [("experts read back per expert in transformers' original format (experts.N.gate_proj.weight ...), "
                     if original else "experts read back stacked under transformers' own module names "
                     "(experts.gate_up_proj, experts.down_proj), ") + "as the source was saved (recorded by the MLX "
                    "export)"], summary["changes"]
    r = run_cli("verify", str(src), str(back), "--backend", "reference", "--tokens", "4", ok=None)
    assert r.exit_code == 0 and "PASS" in r.output, r.output
