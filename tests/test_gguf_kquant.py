"""``convert --to gguf --outtype q4_k_m`` (and every llama-quantize type) against the two-step llama.cpp path.

The reference is what a llama.cpp user runs: convert_hf_to_gguf.py's bf16 file, then llama-quantize on it. There
is no llama-quantize binary in llama-cpp-python; the library's ``llama_model_quantize`` is the function that
binary calls, here called directly (``REFERENCE``: llama-quantize's default parameters, its --override-kv for the
recipe ffn-tools records), in a process of its own. Ours must be that file, byte for byte; llama.cpp loads and
runs it; verify passes it and fails it when its gate and up are swapped.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from ffn_tools import converters
from ffn_tools.converters.gguf import kquant
from ffn_tools.converters.gguf.header import Reader
from ffn_tools.converters.gguf.reader import field_values
from ffn_tools.converters.gguf.writer import OUTTYPES
from ffn_tools.io.receipt import NAME as RECEIPT
from gguf_models import convert_reference
from helpers import once, run_cli, tree_digest

# llama-quantize's own steps: its default parameters, the type, --output-tensor-type / --token-embedding-type,
# --override-kv KEY=str:VALUE for each (key, value), an imatrix as (name, values) entries
REFERENCE = r"""
import ctypes, json, sys
import llama_cpp
import numpy as np
from gguf import GGMLQuantizationType
a = json.loads(sys.argv[1])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + a["ftype"])
for k in ("output_tensor_type", "token_embedding_type"):
    if a.get(k):
        setattr(p, k, int(getattr(GGMLQuantizationType, a[k].upper())))
kv = (llama_cpp.llama_model_kv_override * (len(a["kv"]) + 1))()
for o, (k, v) in zip(kv, a["kv"].items()):
    o.key = k.encode()
    if isinstance(v, int):
        o.tag, o.value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, v
    else:
        o.tag, o.value.val_str = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, v.encode()
p.kv_overrides = ctypes.cast(kv, type(p.kv_overrides))
if a.get("imatrix"):
    im = (llama_cpp.llama_model_imatrix_data * (len(a["imatrix"]) + 1))()
    arrays = [np.asarray(v, np.float32) for v in a["imatrix"].values()]
    for e, name, v in zip(im, a["imatrix"], arrays):
        e.name, e.data, e.size = name.encode(), v.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), v.size
    p.imatrix = ctypes.cast(im, type(p.imatrix))
sys.exit(llama_cpp.llama_model_quantize(a["input"].encode(), a["out"].encode(), ctypes.byref(p)))
"""


def llama_quantize(inp, out, ftype: str, kv: dict, imatrix: dict | None = None, **types):
    args = {"input": str(inp), "out": str(out), "ftype": ftype, "kv": kv, "imatrix": imatrix, **types}
    proc = subprocess.run([sys.executable, "-c", REFERENCE, json.dumps(args)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def wide(shared_dir):
    """A tiny bf16 Llama whose rows are multiples of 256 (K-quants' super-block: narrower rows fall back to
    other types), and convert_hf_to_gguf.py's bf16 file of it."""
    import gguf_models

    def make(tmp):
        gguf_models.build("llama", tmp / "model", torch.bfloat16, hidden_size=256, intermediate_size=512,
                          head_dim=64)
        convert_reference(tmp / "model", tmp / "bf16.gguf", "bf16")
    made = once(shared_dir / "kquant-llama", make)
    return made / "model", made / "bf16.gguf"


def metadata(path):
    return field_values(Reader(path, "r"))


def types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in Reader(path, "r").tensors}


# q4_k_m: llama.cpp's own mix; q3_k_m with both tensor types given (an i-quant, iq2_xxs with an imatrix: below)
@pytest.mark.parametrize("outtype,extra", [
    ("q4_k_m", ()), ("q3_k_m", ("--output-tensor-type", "q8_0", "--token-embedding-type", "q8_0"))])
def test_the_bytes_llama_quantize_writes_from_convert_hf_to_gguf(wide, tmp_path, outtype, extra):
    src, bf16 = wide
    before = tree_digest(src)
    out = tmp_path / "ours.gguf"
    r = json.loads(run_cli("-q", "convert", src, "--to", "gguf", "-o", out, "--outtype", outtype, *extra,
                           "--json").stdout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.gguf", f"ours.gguf.{RECEIPT}"]  # the intermediate: gone
    assert tree_digest(src) == before
    meta = metadata(out)
    recipe = {k: v for k, v in meta.items() if k.startswith(kquant.RECIPE + ".")}
    assert recipe[kquant.RECIPE + ".ftype"] == kquant.FTYPES[outtype]
    assert recipe[kquant.RECIPE + ".intermediate"] == "BF16"
    named = dict(zip(extra[::2], extra[1::2]))
    ref = llama_quantize(bf16, tmp_path.parent / f"{tmp_path.name}-ref.gguf", kquant.FTYPES[outtype], recipe,
                         output_tensor_type=named.get("--output-tensor-type"),
                         token_embedding_type=named.get("--token-embedding-type"))
    assert out.read_bytes() == ref.read_bytes()
    ref.unlink()
    got = types(out)
    assert r["types"] == {t: list(got.values()).count(t) for t in set(got.values())}
    if outtype == "q4_k_m":  # llama.cpp's mix: Q4_K, with Q6_K for the output and some ffn_down / attn_v
        assert got["blk.0.ffn_gate.weight"] == "Q4_K" and got["output.weight"] == "Q6_K"
    if named:
        assert got["output.weight"] == "Q8_0" and got["token_embd.weight"] == "Q8_0"
    assert any("llama.cpp's own quantizer" in c for c in r["changes"])
    assert not any("fell back" in c for c in r["changes"])  # 256-wide rows: every tensor in the recipe's types


def test_fallback_types_are_counted(gguf_model, tmp_path):
    """A 64-wide model's rows are no multiple of a K-quant's 256: llama.cpp's quantizer writes Q5_0 for Q4_K
    and Q8_0 for Q6_K, and the summary says how many, by type, rather than "quantized to Q4_K_M" alone."""
    out = tmp_path / "q4km.gguf"
    r = json.loads(run_cli("-q", "convert", gguf_model("llama"), "--to", "gguf", "-o", out, "--outtype", "q4_k_m",
                           "--json").stdout)
    got = types(out)
    # the mix wants K-quants for every matrix but output.weight (whose narrow rows it gives Q8_0 itself)
    blocks = [t for n, t in got.items() if n != "output.weight" and t != "F32"]
    assert blocks and not any(t.endswith("_K") for t in blocks)
    line = next(c for c in r["changes"] if "fell back" in c)
    assert line.startswith(f"llama.cpp's quantizer fell back to another type for {len(blocks)} of {len(got)} "
                           f"tensors, whose rows are not a multiple of the type's block"), line
    assert f"Q4_K -> Q5_0 x{blocks.count('Q5_0')} (blocks of 256)" in line
    assert f"Q6_K -> Q8_0 x{blocks.count('Q8_0')} (blocks of 256)" in line


def test_verify_passes_a_q4_k_m_and_fails_it_with_gate_and_up_swapped(wide, tmp_path):
    src, _ = wide
    out = tmp_path / "q4km.gguf"
    run_cli("-q", "convert", src, "--to", "gguf", "-o", out, "--outtype", "q4_k_m")
    r = json.loads(run_cli("verify", src, out, "--backend", "reference", "--logits", "--json").stdout)
    assert r["passed"] and r["load_check"]["ok"] and r["logits"]["client_b"] == "llama.cpp"
    swapped = tmp_path / "swapped.gguf"
    data = bytearray(out.read_bytes())
    at = {t.name: (int(t.data_offset), int(t.n_bytes)) for t in Reader(out, "r").tensors}
    (g, n), (u, m) = at["blk.1.ffn_gate.weight"], at["blk.1.ffn_up.weight"]
    assert n == m
    data[g:g + n], data[u:u + n] = data[u:u + n], data[g:g + n]
    swapped.write_bytes(bytes(data))
    result = run_cli("verify", src, swapped, "--backend", "reference", "--json", ok=None)
    assert result.exit_code == 1
    bad = json.loads(result.stdout)
    assert not bad["passed"]
    assert [f["ffn"] for f in bad["ffns"] if not f["passed"]] == ["layer 1"]


def write_imatrix(path, weights: dict[str, tuple[int, int]], seed: int = 0):
    """An importance matrix as llama-imatrix writes it (GGUF, general.type imatrix): for each weight name,
    ``X.in_sum2`` (sums of squared activations per input column, per expert) and ``X.counts``."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch="imatrix")  # llama-imatrix's general.architecture is not read by quantize
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["calibration.txt"])
    w.add_uint32("imatrix.chunk_count", 7)
    w.add_uint32("imatrix.chunk_size", 512)
    for name, (cols, experts) in weights.items():
        w.add_tensor(name + ".in_sum2", rng.uniform(0.1, 9.0, (experts, cols)).astype(np.float32))
        w.add_tensor(name + ".counts", np.full((experts, 1), 7.0, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_imatrix_is_read_as_llama_quantize_reads_it(wide, tmp_path):
    """An IQ2_XXS needs an importance matrix: refused without one (llama.cpp's own error, nothing left), made with
    one the bytes llama_model_quantize writes from the same values (sums over counts), its file, dataset and counts
    in llama-quantize's quantize.imatrix.* keys, the matrix's hash in the recipe."""
    src, bf16 = wide
    out = tmp_path / "iq2.gguf"
    result = run_cli("-q", "convert", src, "--to", "gguf", "-o", out, "--outtype", "iq2_xxs", ok=False)
    assert "imatrix" in result.output.lower() and not out.exists() and not list(tmp_path.iterdir())
    names = {f"blk.{i}.{n}.weight": (c, 1) for i in range(2) for n, c in
             [("attn_q", 256), ("attn_k", 256), ("attn_v", 256), ("attn_output", 256), ("ffn_gate", 256),
              ("ffn_up", 256), ("ffn_down", 512)]}
    names["output.weight"] = (256, 1)
    im = write_imatrix(tmp_path / "imatrix.gguf", names)
    run_cli("-q", "convert", src, "--to", "gguf", "-o", out, "--outtype", "iq2_xxs", "--imatrix", im)
    meta = metadata(out)
    assert meta["quantize.imatrix.file"] == str(im)
    assert meta["quantize.imatrix.dataset"] == "calibration.txt"
    assert meta["quantize.imatrix.entries_count"] == len(names) and meta["quantize.imatrix.chunks_count"] == 7
    assert len(meta[kquant.RECIPE + ".imatrix_sha256"]) == 64
    values, _ = kquant.read_imatrix(im)
    reader = Reader(im, "r")
    raw = {t.name: np.asarray(t.data, np.float32).reshape(-1) for t in reader.tensors}
    assert np.array_equal(values["blk.0.ffn_down.weight"], raw["blk.0.ffn_down.weight.in_sum2"] / np.float32(7.0))
    kv = {k: v for k, v in meta.items() if k.startswith(("quantize.imatrix.", kquant.RECIPE + "."))}
    ref = llama_quantize(bf16, tmp_path / "ref.gguf", "IQ2_XXS", kv,
                         imatrix={n: (raw[n + ".in_sum2"] / np.float32(7.0)).tolist() for n in names})
    assert out.read_bytes() == ref.read_bytes()
    assert types(out)["blk.0.ffn_gate.weight"] == "IQ2_XXS"


def test_quantize_options_refused_where_they_do_not_apply(wide, tmp_path):
    src, _ = wide
    out = tmp_path / "x.gguf"
    r = run_cli("convert", src, "--to", "gguf", "-o", out, "--outtype", "bf16", "--output-tensor-type", "q8_0", ok=False)
    assert "llama-quantize's options" in r.output
    r = run_cli("convert", src, "--to", "gguf", "-o", out, "--outtype", "q4_k_m", "--token-embedding-type", "q9_9",
                ok=False)
    assert "--token-embedding-type 'q9_9'" in r.output
    r = run_cli("convert", src, "--to", "mlx", "-o", tmp_path / "m", "--imatrix", src / "config.json", ok=False)
    assert "--imatrix does not apply to --to mlx" in r.output
    assert not list(tmp_path.iterdir())


def test_the_cli_offers_the_writer_types():
    """--outtype's choices are declared once, by the GGUF format's Option: the writer's types, and the flag the
    convert command draws from it offers exactly those."""
    from ffn_tools.cli.convert import command

    declared = next(o for o in converters.get("gguf").options if o.name == "outtype").choices
    assert declared is not None and set(declared) == set(OUTTYPES)
    offered = next(p.type.choices for p in command().params if p.name == "outtype")
    assert set(offered) == set(declared)
