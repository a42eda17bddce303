"""Weights read back from a form that stores them plus a constant (llama.cpp's converter stores Gemma's norms so),
recorded in what an export of them writes (``convert x --to torch|mlx``), and compared by ``verify`` against their
source. Which format stores what so is its reader's to say (``Checkpoint.carried_metadata``); this module holds
the arithmetic and the record, and names no format.

The converter stores such a norm as ``w + 1`` in float32; read back it is ``fl(fl(w + 1) - 1)``, within half a
float32 ulp of ``w + 1`` of the source's ``w``: 2**-24 for ``|w + 1| < 1``, not bit for bit. The export says so in
its safetensors metadata (``PLUS_ONE``: name -> what was added), and verify of the source against that export
derives each one from A through the round trip's ops (``read_back_ops``: the converter's ``plus_ops``, then the
reader's ``- 1`` in float32) and compares it once, bit for bit: equal is
the documented bound held exactly (counted within tolerance, with a note), anything else (a zeroed norm, another
model's) differs.
"""

from __future__ import annotations

import json

from ..errors import listing

# safetensors metadata: {HF name: what the storing form added}; the key is spelled as exports already written carry it
PLUS_ONE = "ffn_tools_gguf_plus_one"


def plus_ops(dtype, shift: float) -> tuple:
    """The ops by which llama.cpp's converter stores a weight of torch ``dtype`` plus ``shift``: cast to float32
    unless float16 or float32 (``prepare_tensors``), ``+ shift`` in that dtype (the family's ``modify_tensors``;
    ``Affine`` adds in float32 and rounds once to it, which for a float16 weight is float16's own addition, checked
    over every float16), then float32 (1-D and norm tensors are stored F32)."""
    import torch

    from ..ops import Affine, Cast

    first = () if dtype in (torch.float16, torch.float32) else (Cast("F32"),)
    return (*first, Affine(shift=shift), Cast("F32"))


def read_back_ops(dtype, shift: float, to) -> tuple:
    """``plus_ops`` then the reader's ``- shift`` in float32, cast to torch dtype ``to``: a weight of ``dtype`` as
    a GGUF storing it plus ``shift`` gives it back (``fl(fl(w + shift) - shift)``)."""
    from ..io.dtypes import as_st
    from ..ops import Affine, Cast

    return (*plus_ops(dtype, shift), Affine(shift=-shift), Cast(as_st(to)))


def derive(ops: tuple, w):
    """``w`` through ``ops`` (an entry's ops, ``ffn_tools.ops``): the one tensor they make."""
    from ..ops import run

    return run(ops, [w])[0]


def plus(w, shift: float):
    """``w`` plus ``shift`` as llama.cpp's converter computes it (``plus_ops``)."""
    return derive(plus_ops(w.dtype, shift), w)


def record(shifts: dict[str, float]) -> tuple[dict[str, str], list[str]]:
    """The safetensors metadata recording the weights read back minus ``shifts`` in an export, and what the
    export's summary says; both empty when there are none."""
    if not shifts:
        return {}, []
    return {PLUS_ONE: json.dumps(dict(sorted(shifts.items())))}, [
        f"{len(shifts)} weights the GGUF stores plus one read back minus one in float32 (within 2**-24 of "
        f"|w + 1|, not bit for bit): recorded in the safetensors metadata as {PLUS_ONE}"]


def recorded_shifts(metadata: dict[str, str]) -> dict[str, float]:
    """The weights a checkpoint's metadata records as read back from a form storing them plus a constant."""
    try:
        shifts = json.loads(metadata.get(PLUS_ONE) or "{}")
    except ValueError:
        return {}
    return {str(k): float(v) for k, v in shifts.items()} if isinstance(shifts, dict) else {}


def compare_recorded(outside, ca, cb, shifts: dict[str, float]) -> list[str]:
    """B's weights read back from a form storing them plus a constant (``shifts``) against A's, as the round trip
    computes them: ``plus(a, shift) - shift`` in float32, bit for bit. Adds the outcome to ``outside``
    (whose comparison left them out) and returns the note saying how they were compared."""
    from .diagnose import first_difference  # torch: verify has it; an export that records shifts need not
    from .outside import DIFFER, WITHIN, Derived

    names = sorted(n for n in shifts if n in ca or n in cb)
    if not names or outside.skipped:
        return []
    held = 0
    for name in names:
        if name not in ca or name not in cb:  # left out of the comparison by name: said here
            (outside.only_b if name in cb else outside.only_a).append(name)
            continue
        a, b = ca[name], cb[name]
        if tuple(a.shape) != tuple(b.shape):
            outside.add(Derived(name, DIFFER, f"{name}: A is {list(a.shape)}, B is {list(b.shape)}"))
            continue
        want = derive(read_back_ops(a.dtype, shifts[name], b.dtype), a)  # B's dtype: float32, unless cast since
        why = first_difference(name, want, b)
        outside.add(Derived(name, DIFFER, f"{why} (B records it read back from a GGUF storing it plus one: compared "
                                          "with A's plus one minus one, in float32)") if why else Derived(name, WITHIN))
        held += not why
    outside.only_a.sort()
    outside.only_b.sort()
    return [f"{len(names)} of B's tensors were read back from a GGUF that stores them plus one (recorded in B's "
            f"metadata; Gemma's norms: {listing(names, 3)}): {held} are A's plus one minus one in float32, bit for "
            f"bit, within 2**-24 of |w + 1| of A's as documented, counted within tolerance"]
