"""Reading compressed-tensors pack-quantized weights: ffn_tools' dequantization against compressed-tensors'
own ``PackedQuantizationCompressor.decompress``, on the same packed tensors, in the same run.

One (rows, cols) bf16 weight per shape is quantized int4 group 128 (asymmetric and symmetric) and int8 group
128 with compressed-tensors' own ``calculate_qparams`` and compressor; both readers then dequantize it
(the fastest of ``--repeat`` runs: the least disturbed on a shared machine). Printed: milliseconds each and the
ratio ffn_tools / compressed-tensors (below 1: faster), and that the two results are bit-identical.

    .venv/bin/python benchmarks/bench_ctensors.py [--tiny] [--repeat N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3  # the least disturbed run: this machine is shared


def main() -> None:
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from ffn_tools.quant import ctdecode, ctensors
    from ffn_tools.quant.base import Module
    from ffn_tools.quant.ctconfig import Args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    shapes = [(256, 512)] if a.tiny else [(4096, 4096), (14336, 4096)]
    rows = []
    for rows_, cols in shapes:
        torch.manual_seed(0)
        w = (torch.randn(rows_, cols) * 0.02).to(torch.bfloat16)
        for bits, sym in ((4, False), (4, True), (8, False)):
            args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=128)
            scheme = QuantizationScheme(targets=["Linear"], weights=args)
            g = w.unflatten(-1, (cols // 128, 128))
            scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
            sd = {"weight": w, "weight_scale": scale, **({} if sym else {"weight_zero_point": zp})}
            packed = PackedQuantizationCompressor.compress(sd, scheme)
            m = Module("x.weight", ctensors.CT_INT, {p: p for p in packed}, (rows_, cols), "BF16",
                       Args("pack-quantized", bits, "group", 128, sym, "g"))
            ours = ctdecode.dequantize(m, packed)
            theirs = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
            same = torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
            t_ours = _time(lambda: ctdecode.dequantize(m, packed), a.repeat)
            t_ct = _time(lambda: PackedQuantizationCompressor.decompress(packed, scheme), a.repeat)
            row = {"shape": [rows_, cols], "scheme": m.scheme.name, "ffn_tools_ms": round(t_ours, 2),
                   "compressed_tensors_ms": round(t_ct, 2), "ratio": round(t_ours / t_ct, 3), "bit_identical": same}
            rows.append(row)
            print(f"{rows_}x{cols} {m.scheme.name:<42} ffn_tools {t_ours:8.2f} ms  compressed-tensors {t_ct:8.2f} ms  "
                  f"ratio {t_ours / t_ct:5.2f}  {'bit-identical' if same else 'DIFFER'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
