"""K-quants and i-quants in one command: llama.cpp's own quantizer run on the GGUF the converter wrote.

``convert SRC --to gguf --outtype q4_k_m`` is, for a user of llama.cpp, two tools and a whole-model F16 file:
convert_hf_to_gguf.py, then ``llama-quantize F16.gguf OUT.gguf Q4_K_M``. Which type each tensor gets (Q6_K for
``output`` and half the ``ffn_down`` and ``attn_v`` of Q4_K_M, fallbacks where a row is not a multiple of 256,
imatrix requirements) is llama.cpp's ``llama_tensor_get_type``, inside ``llama_model_quantize``: a second copy
of those rules would drift with every release, and the library has no per-tensor entry that takes them. So the
writer writes the converter's bf16/f16 file (``--outtype auto``: bf16 for a bf16 model, else f16) into the output's
temporary directory, this module runs ``llama_model_quantize`` (what ``llama-quantize`` calls, through
llama-cpp-python, with ``llama_model_quantize_default_params`` as llama-quantize starts from) on it, and the
intermediate is removed whether or not that succeeded: the output is the bytes ``llama-quantize`` writes from
convert_hf_to_gguf.py's file, plus the recipe (``ffn_tools.quantize.*`` keys, written through the quantizer's
own ``kv_overrides``, as ``llama-quantize --override-kv`` would).

``--imatrix FILE`` reads llama.cpp's GGUF importance matrix (``llama-imatrix``'s output: ``X.in_sum2`` and
``X.counts`` per weight) as llama-quantize does: per expert, the sums over the count, 1 where the count is 0;
its file name, first dataset, entry and chunk counts go into ``quantize.imatrix.*`` as llama-quantize writes them.

Run by ``writer`` as ``python -m ffn_tools.converters.gguf.kquant REQUEST.json``; prints one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# --outtype -> llama.cpp's llama_ftype name (llama-quantize's QUANT_OPTIONS, lower-cased; its aliases q3_k, q4_k,
# q5_k). f32, f16, bf16 and q8_0 are the converter's own (the package's ``OUTTYPES``), as convert_hf_to_gguf.py
# writes them.
FTYPES = {
    "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "mxfp4_moe": "MXFP4_MOE",
    "q2_k": "Q2_K", "q2_k_s": "Q2_K_S", "q3_k": "Q3_K_M", "q3_k_s": "Q3_K_S", "q3_k_m": "Q3_K_M", "q3_k_l": "Q3_K_L",
    "q4_k": "Q4_K_M", "q4_k_s": "Q4_K_S", "q4_k_m": "Q4_K_M", "q5_k": "Q5_K_M", "q5_k_s": "Q5_K_S",
    "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "iq1_s": "IQ1_S", "iq1_m": "IQ1_M", "iq2_xxs": "IQ2_XXS", "iq2_xs": "IQ2_XS",
    "iq2_s": "IQ2_S", "iq2_m": "IQ2_M", "iq3_xxs": "IQ3_XXS", "iq3_xs": "IQ3_XS", "iq3_s": "IQ3_S", "iq3_m": "IQ3_M",
    "iq4_nl": "IQ4_NL", "iq4_xs": "IQ4_XS", "tq1_0": "TQ1_0", "tq2_0": "TQ2_0",
}
# the ggml types --output-tensor-type / --token-embedding-type take (llama-quantize's parse_ggml_type: any
# type ggml quantizes to; gguf-py's GGMLQuantizationType names them)
TENSOR_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "iq4_nl", "iq4_xs", "tq1_0",
                "tq2_0", "mxfp4")
RECIPE = "ffn_tools.quantize"  # the recipe's keys: RECIPE.ftype, .intermediate, .output_tensor_type, ...


def recipe(outtype: str, intermediate: str, output_tensor_type: str | None, token_embedding_type: str | None,
           imatrix: Path | None) -> dict[str, str]:
    """The recipe's metadata: key -> string value (each at most 127 bytes: ``llama_model_kv_override.val_str``)."""
    r = {f"{RECIPE}.ftype": FTYPES[outtype], f"{RECIPE}.intermediate": intermediate.upper()}
    if output_tensor_type:
        r[f"{RECIPE}.output_tensor_type"] = output_tensor_type.upper()
    if token_embedding_type:
        r[f"{RECIPE}.token_embedding_type"] = token_embedding_type.upper()
    if imatrix is not None:
        r[f"{RECIPE}.imatrix_sha256"] = hashlib.sha256(Path(imatrix).read_bytes()).hexdigest()
    return r


def read_imatrix(path: Path) -> tuple[dict[str, "np.ndarray"], dict]:
    """``path``'s importance matrix as llama-quantize computes it: weight name -> float32 values (per expert,
    the sums over that expert's count, 1 where the count is 0); and the metadata llama-quantize writes for it.

    Raises:
        ValueError: not a GGUF importance matrix (the legacy ``.dat`` format included: convert it with
            llama-imatrix's ``--in-file``/``-o``), an entry without its counts.
    """
    import numpy as np
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a GGUF importance matrix ({e}); a legacy .dat imatrix converts to GGUF with "
                         "llama-imatrix --in-file OLD.dat -o NEW.gguf") from None
    tensors = {t.name: t for t in reader.tensors}
    sums = {n.removesuffix(".in_sum2"): t for n, t in tensors.items() if n.endswith(".in_sum2")}
    if not sums:
        raise ValueError(f"{path}: no X.in_sum2 tensors: not an importance matrix llama-imatrix wrote")
    values = {}
    for name, t in sorted(sums.items()):
        counts = tensors.get(name + ".counts")
        if counts is None:
            raise ValueError(f"{path}: {name}.in_sum2 without {name}.counts")
        c = np.asarray(counts.data, np.float32).reshape(-1)
        s = np.asarray(t.data, np.float32).reshape(len(c), -1)
        v = np.ones_like(s)
        seen = c > 0
        v[seen] = s[seen] / c[seen, None]
        values[name] = np.ascontiguousarray(v.reshape(-1), np.float32)

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    datasets = field("imatrix.datasets") or []
    meta = {"quantize.imatrix.file": str(path), "quantize.imatrix.entries_count": len(values),
            "quantize.imatrix.chunks_count": int(field("imatrix.chunk_count") or 0)}
    if datasets:
        meta["quantize.imatrix.dataset"] = str(datasets[0])
    return values, meta


def quantize(request: dict) -> dict:
    """Run ``llama_model_quantize`` on ``request["input"]`` into ``request["out"]``; the tensors written."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{FTYPES[request['outtype']]}")
    from gguf import GGMLQuantizationType

    for key in ("output_tensor_type", "token_embedding_type"):
        if request.get(key):
            setattr(params, key, int(getattr(GGMLQuantizationType, request[key].upper())))
    kv = dict(request.get("recipe") or {})
    keep: list = []  # ctypes buffers the params point into, alive until the call returns
    if request.get("imatrix"):
        values, meta = read_imatrix(Path(request["imatrix"]))
        entries = (llama_cpp.llama_model_imatrix_data * (len(values) + 1))()
        for i, (name, v) in enumerate(values.items()):
            keep.append(v)
            entries[i].name = name.encode()
            entries[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = v.size
        params.imatrix = ctypes.cast(entries, type(params.imatrix))
        keep.append(entries)
        kv = {**meta, **kv}
    overrides = (llama_cpp.llama_model_kv_override * (len(kv) + 1))()
    for o, (key, value) in zip(overrides, kv.items()):
        o.key = key.encode()
        if isinstance(value, int):
            o.tag, o.value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, value
        else:
            data = str(value).encode()
            if len(data) >= 128:
                raise ValueError(f"metadata {key}: {len(data)} bytes, llama.cpp's overrides hold 127")
            o.tag, o.value.val_str = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, data
    params.kv_overrides = ctypes.cast(overrides, type(params.kv_overrides))

    log: list[str] = []
    done = _watch(request, log)

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):  # llama.cpp's log: kept for an error, counted for progress
        line = text.decode("utf-8", "replace")
        log.append(line)
        done(line)

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    rc = llama_cpp.llama_model_quantize(str(request["input"]).encode(), str(request["out"]).encode(),
                                        ctypes.byref(params))
    done(None)
    if rc != 0:
        lines = [x.strip() for x in "".join(log).splitlines() if x.strip()]
        why = next((x for x in reversed(lines) if "error" in x.lower() or "failed" in x.lower()),
                   lines[-1] if lines else f"status {rc}")
        return {"error": f"llama_model_quantize: {why}"}
    from .header import Reader

    reader = Reader(request["out"], "r")
    tensors = [{"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
                "bytes": int(t.n_bytes)} for t in reader.tensors]
    return {"tensors": tensors, "ftype": FTYPES[request["outtype"]], "fallbacks": fallbacks("".join(log))}


TENSOR_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")
# llama-quant.cpp's tensor_type_fallback, one line per tensor whose rows its type's blocks do not divide
FALLBACK_LINE = re.compile(r"warning: (\S+)\s+- ncols\s+\d+ not divisible by\s+(\d+) \(required for type\s+(\S+)\)"
                           r".*?-> falling back to\s+(\S+)")


def fallbacks(log: str) -> list[dict]:
    """The tensors llama.cpp's quantizer gave another type than its recipe's, from its log: name, the type
    wanted, the one written, and the block size the rows were not a multiple of."""
    return [{"name": m[1], "block": int(m[2]), "wanted": m[3].upper(), "written": m[4].upper()}
            for m in FALLBACK_LINE.finditer(log)]


def _watch(request: dict, log: list[str]):
    """A function of each log line that moves the progress bar by the tensors llama.cpp reports done
    (``[ i/ n] name ...``); None closes it."""
    from ffn_tools.progress import Progress

    if not request.get("progress"):
        return lambda line: None
    total = Path(request["input"]).stat().st_size
    bar = Progress(total, "Quantizing")
    lock = threading.Lock()
    state = {"done": 0}

    def seen(line):
        with lock:
            if line is None:
                bar.update(total - state["done"])
                bar.close()
                return
            m = TENSOR_LINE.match(line.strip())
            if m:
                now = total * int(m.group(1)) // max(int(m.group(2)), 1)
                bar.update(now - state["done"])
                state["done"] = now
    return seen


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    try:
        result = quantize(request)
    except (OSError, ValueError) as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result))
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
