"""What runs a Flax checkpoint here: no Flax runtime (transformers 5 removed its Flax classes), so its load check
does not run; its weights, read as the Flax view presents them (PyTorch names, (out, in) kernels), run as a
whole model in transformers' PyTorch class of its config, as transformers 4's ``from_flax=True`` loaded them:
``--logits`` and ``--generate`` say so by the client's name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ffn_tools.clients import NoClient
from ffn_tools.errors import FFNToolsError

NAME = "transformers (Flax weights)"


class FlaxWeights(NoClient):
    """See the module docstring."""

    def __init__(self):
        super().__init__("flax", "no client loads Flax checkpoints here (transformers 5 has no Flax)", ("jax",))
        self.name = NAME  # type: ignore[misc]  # per instance: NoClient's is "none"

    def ready_for_logits(self, ckpt, side: str) -> None:
        if not Path(ckpt.path).is_dir() or "model_type" not in (ckpt.config or {}) or ckpt.layout != "hf":
            raise FFNToolsError(f"--logits/--generate: {side} ({ckpt.path}) is not a Flax model directory of the "
                                "hf layout with a config.json naming its model_type; no client here runs it")

    @property
    def runtime(self) -> str:
        return "transformers"  # its weights run in transformers' classes

    def view(self, path: Path):
        """The checkpoint at ``path`` as its format's view presents it (Hugging Face names and orientation)."""
        from . import FORMAT

        return FORMAT.open(Path(path))

    def _model(self, path: Path, dtype: str | None):
        import torch
        import transformers

        with self.view(path) as view:
            config = transformers.AutoConfig.for_model(**(view.config or {}))
            model: Any = transformers.AutoModelForCausalLM.from_config(config)
            state = {n: view[n] for n in view}
        problems = []
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        if set(missing) - tied:
            problems.append(f"{self.name}: weights the checkpoint lacks: {sorted(set(missing) - tied)[:4]}")
        if unexpected:
            problems.append(f"{self.name}: weights its class does not know: {sorted(unexpected)[:4]}")
        if tied:
            model.tie_weights()
        dt = getattr(torch, dtype) if dtype else next(iter(state.values())).dtype
        return model.to(dt).eval(), problems

    def logits(self, path: Path, tokens, dtype: str | None = None):
        import torch

        model, problems = self._model(path, dtype)
        with torch.no_grad():
            return model(tokens).logits.to(torch.float64), problems

    def generate(self, path: Path, prompts, new_tokens, score=None, dtype=None):
        from transformers import AutoTokenizer

        from ffn_tools.converters.pytorch.generation import run

        model, problems = self._model(path, dtype)
        if problems:
            raise FFNToolsError("; ".join(problems))
        return run(self.name, model, AutoTokenizer.from_pretrained(path), prompts, new_tokens, score)
