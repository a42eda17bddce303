"""The GGUF writer's plus-one norms defined once (#53): the native recipe's steps are written from the ops verify
derives them with (``checks.rounded.plus_ops``: Cast, Affine; ``native.steps_of``), and ``native.run_steps`` runs
them in numpy as the ops run in torch, over every float16 and bfloat16 value. (That the file stays the
converter's byte for byte: test_gguf_native's Gemma 2 cases.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ffn_tools.checks.rounded import plus, plus_ops
from ffn_tools.converters.gguf import native
from ffn_tools.ops import Affine, Cast, Transpose


def every(dtype: str) -> np.ndarray:
    """Every value of a 16-bit float ``dtype`` as numpy reads it from a file (bfloat16: its float32, exact)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    return bits.view(np.float16) if dtype == "F16" else (bits.astype(np.uint32) << 16).view(np.float32)


def test_the_recipe_steps_are_the_ops():
    assert native.plus_steps("BF16") == [["cast", "F32"], ["affine", 1.0, 1.0], ["cast", "F32"]]
    assert native.plus_steps("F16") == [["affine", 1.0, 1.0], ["cast", "F32"]]  # added in float16
    assert native.steps_of(plus_ops(torch.float32, 0.5)) == [["affine", 1.0, 0.5], ["cast", "F32"]]
    with pytest.raises(ValueError, match="no recipe step runs"):
        native.steps_of((Transpose(),))
    with pytest.raises(ValueError, match="no recipe step runs"):
        native.steps_of((Cast("BF16"),))  # numpy has no bfloat16


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the NaNs among every value
@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_run_steps_is_the_ops_over_every_value(dtype):
    x = every(dtype)
    ours = native.run_steps(x, native.plus_steps(dtype))
    assert ours.dtype == np.float32
    t = torch.from_numpy(x.copy()) if dtype == "F16" else torch.from_numpy(x.copy()).to(torch.bfloat16)
    theirs = plus(t, 1.0).numpy()  # the ops, in torch
    assert np.array_equal(ours, theirs, equal_nan=True)
    # what the writer computed before its steps came from the ops: + 1 in the tensor's dtype as read
    before = (x + x.dtype.type(1)).astype(np.float32)
    assert np.array_equal(ours, before, equal_nan=True)
    if dtype == "F16":  # float16's own addition: some sums round in float16, not only in the final float32
        assert not np.array_equal(ours, x.astype(np.float32) + np.float32(1), equal_nan=True)


def test_an_affine_scale_runs_in_float32_and_stores_back():
    x = np.array([1.5, -2.25, 3.0], np.float16)
    ours = native.run_steps(x, native.steps_of((Affine(scale=3.0, shift=0.5),)))
    assert ours.dtype == np.float16
    assert np.array_equal(ours, Affine(scale=3.0, shift=0.5).apply([torch.from_numpy(x)])[0].numpy())
