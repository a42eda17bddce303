"""A Flax SwiGLU module's parameters as a PyTorch FFN, with ffn-tools.

    python examples/flax_swiglu.py [--seed 0] [--d-model 64] [--d-ffn 96] [--out DIR]

1. ``SwiGLU`` computes ``down(silu(gate(x)) * up(x))`` with three ``nn.Dense`` named gate, up, down
   (biases on, default initializers); it is initialised with ``jax.random.PRNGKey(seed)``.
2. Its parameters are saved with ``flax.serialization.to_bytes`` in the ffn-tools linen layout,
   ``{"params": {"layers_0": variables["params"]}}`` (more layers: ``layers_1``, ...; a bare
   ``variables`` tree reads as layer 0 too).
3. ffn-tools converts that file to PyTorch safetensors, as ``ffn-tools convert swiglu.msgpack --to torch
   -o torch_ffn`` does: tensors ``layers.0.{gate,up,down}.{weight,bias}``, weights (out, in) = kernel.T.
4. The PyTorch FFN runs on the same input and must give the Flax module's output; then the hand-worked
   case below is checked against its known answer.

Hand-worked case (kernels (in, out), zero biases), x = [[1, -1]]:
    gate(x) = [-3, 0, 3], up(x) = [2, 5, -1]
    h = silu(gate(x)) * up(x) = [-0.2845552, 0, -2.8577223]
    out = h @ W_down = [-3.1422775, 2.8577223]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from ffn_tools.converters import convert

HAND_X = [[1.0, -1.0]]
HAND_KERNELS = {"gate": [[1, 0, 2], [4, 0, -1]], "up": [[2, 5, -1], [0, 0, 0]], "down": [[1, 0], [0, 1], [1, -1]]}
HAND_H = [[-0.2845552, 0.0, -2.8577223]]
HAND_OUT = [[-3.1422775, 2.8577223]]


class SwiGLU(nn.Module):
    """out = down(silu(gate(x)) * up(x)); kernels are (in, out)."""

    d_model: int
    d_ffn: int

    @nn.compact
    def __call__(self, x):
        h = nn.silu(nn.Dense(self.d_ffn, name="gate")(x)) * nn.Dense(self.d_ffn, name="up")(x)
        return nn.Dense(self.d_model, name="down")(h)


def to_torch(variables: dict, workdir: Path) -> dict[str, torch.Tensor]:
    """Save a SwiGLU's variables as a linen-layout msgpack, convert it with ffn-tools, load the result."""
    tree = {"params": {"layers_0": variables["params"]}}
    src = workdir / "swiglu.msgpack"
    src.write_bytes(flax.serialization.to_bytes(tree))
    out = workdir / "torch_ffn"
    convert(src, "torch", out, force=True)
    return load_file(out / "model.safetensors")


def torch_swiglu(t: dict[str, torch.Tensor], x: torch.Tensor, prefix: str = "layers.0") -> torch.Tensor:
    """The PyTorch FFN: weights (out, in), as F.linear takes them."""
    def lin(role, v):
        return F.linear(v, t[f"{prefix}.{role}.weight"], t.get(f"{prefix}.{role}.bias"))

    return lin("down", F.silu(lin("gate", x)) * lin("up", x))


def compare_random(seed: int, d_model: int, d_ffn: int, workdir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(Flax output, PyTorch output) of a freshly initialised SwiGLU on a seeded input."""
    module = SwiGLU(d_model, d_ffn)
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (4, d_model), jnp.float32)
    variables = module.init(jax.random.PRNGKey(seed), x)
    y_flax = np.asarray(module.apply(variables, x))
    y_torch = torch_swiglu(to_torch(variables, workdir), torch.tensor(np.asarray(x))).numpy()
    return y_flax, y_torch


def hand_worked(workdir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(Flax output, PyTorch output) of the hand-worked case."""
    params = {role: {"kernel": jnp.asarray(k, jnp.float32), "bias": jnp.zeros(len(k[0]), jnp.float32)}
              for role, k in HAND_KERNELS.items()}
    variables = {"params": params}
    x = jnp.asarray(HAND_X, jnp.float32)
    y_flax = np.asarray(SwiGLU(2, 3).apply(variables, x))
    y_torch = torch_swiglu(to_torch(variables, workdir), torch.tensor(HAND_X)).numpy()
    return y_flax, y_torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-ffn", type=int, default=96)
    p.add_argument("--out", type=Path, help="Keep the files here (default: a temporary directory).")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        y_flax, y_torch = compare_random(args.seed, args.d_model, args.d_ffn, work)
        rel = float(np.abs(y_flax - y_torch).max() / np.abs(y_flax).max())
        print(f"random SwiGLU (seed {args.seed}, d_model {args.d_model}, d_ffn {args.d_ffn}): "
              f"max relative difference Flax vs PyTorch {rel:.2e}")
        h_flax, h_torch = hand_worked(work)
        print(f"hand-worked case: Flax {h_flax.tolist()}, PyTorch {h_torch.tolist()}, expected {HAND_OUT}")
        ok = rel <= 1e-5 and np.allclose(h_flax, HAND_OUT, rtol=0, atol=1e-6) \
            and np.allclose(h_torch, HAND_OUT, rtol=0, atol=1e-6)
    print("OK: the PyTorch FFN reproduces the Flax module" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
