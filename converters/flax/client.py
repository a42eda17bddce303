"""What runs a Flax checkpoint here: no Flax runtime (transformers 5 removed its Flax classes), so its load check
does not run; its weights, read as the Flax view presents them (PyTorch names, (out, in) kernels), run as a
whole model in transformers' PyTorch class of its config, as transformers 4's ``from_flax=True`` loaded them
(``converters.pytorch.weights``): ``--logits`` and ``--generate`` say so by the client's name."""

from __future__ import annotations

from ..pytorch.weights import TransformersRuns


class FlaxWeights(TransformersRuns):
    """See the module docstring."""

    def __init__(self):
        super().__init__("flax", "flax", "no client loads Flax checkpoints here (transformers 5 has no Flax)", "Flax",
                         ("jax",), layouts=("hf",))
