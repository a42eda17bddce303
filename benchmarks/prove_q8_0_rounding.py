"""The proof behind ``converters/gguf/native.q8_0``'s rounding: for every float32 ``y`` of magnitude up to 128.5,
both signs, ``int8(y + copysign(HALF_BELOW, y))`` (one add, then the cast's truncation) equals
``int8(np_roundf(y))`` (gguf-py's roundf, the one llama.cpp's ``quantize_row_q8_0_ref`` matches).

A Q8_0 block's ``y = x / d`` lies within 127 plus rounding, so this range holds every value the quantizer rounds.
It checks all 2.2 billion of them, in chunks of 16M, and exits 1 on the first chunk with a difference (about 30 s
on one core). ``tests/test_gguf_native.py`` checks the ties and their neighbours on every run; this is the whole
range, run by hand.

    .venv/bin/python -P benchmarks/prove_q8_0_rounding.py
"""

from __future__ import annotations

import sys
import time

import numpy as np


def main() -> None:
    from ffn_tools.converters.gguf.native import HALF_BELOW
    from ffn_tools.converters.gguf.source import installed_dir

    root = installed_dir()
    if root is not None:
        sys.path.insert(0, str(root / "gguf-py"))  # the gguf-py the converter runs with
    from gguf.quants import np_roundf

    half = np.float32(HALF_BELOW)
    assert half == np.nextafter(np.float32(0.5), np.float32(0)), half
    top = int(np.float32(128.5).view(np.uint32))
    step, checked, t0 = 1 << 24, 0, time.perf_counter()
    for start in range(0, top + 1, step):
        y = np.arange(start, min(start + step, top + 1), dtype=np.uint32).view(np.float32)
        for v in (y, -y):
            ours = (v + np.copysign(half, v)).astype(np.int8)
            theirs = np_roundf(v).astype(np.int8)
            if not np.array_equal(ours, theirs):
                bad = v[ours != theirs][:5]
                sys.exit(f"differ at {bad.tolist()} (chunk from bit pattern {start:#x})")
            checked += v.size
    print(f"{checked:,} float32 values, |y| <= 128.5: roundf by one add equals gguf-py's np_roundf on all of them "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
