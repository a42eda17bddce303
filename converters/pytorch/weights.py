"""transformers running another format's weights: the client of formats whose own runtime is not here or is a
training framework (Flax after transformers 5, torch.distributed.checkpoint, Orbax). The checkpoint is read as its
format's view presents it (Hugging Face names, (out, in) weights), loaded into transformers' PyTorch class of its
config, and run there for ``--logits`` and ``--generate``; every report names the client "transformers (X
weights)". It computes as transformers does, so no setting reads otherwise than in transformers (``runtime``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ffn_tools.clients import NoClient
from ffn_tools.errors import FFNToolsError


class TransformersRuns(NoClient):
    """See the module docstring.

    Args:
        fmt: the format whose view is run ("flax", "dcp", "orbax").
        label: the format's own runtime, as its load check names it.
        why: why the load check does not run (a subclass that runs one overrides ``load_check``).
        what: the weights' kind in the client's name ("Flax" -> "transformers (Flax weights)").
        layouts: the layouts of the format's view that hold a whole model (None: any).
    """

    def __init__(self, fmt: str, label: str, why: str, what: str, kernels: tuple[str, ...] = (),
                 layouts: tuple[str, ...] | None = None):
        super().__init__(label, why, kernels)
        self.fmt, self.layouts = fmt, layouts
        self.name = f"transformers ({what} weights)"  # type: ignore[misc]  # per instance: NoClient's is "none"

    @property
    def runtime(self) -> str:
        return "transformers"  # its weights run in transformers' classes

    def view(self, path: Path):
        """The checkpoint at ``path`` as its format's view presents it (Hugging Face names and orientation)."""
        from ffn_tools.converters import get

        return get(self.fmt).open(Path(path))

    def ready_for_logits(self, ckpt, side: str) -> None:
        layout = getattr(ckpt, "layout", None)
        if not Path(ckpt.path).is_dir() or "model_type" not in (ckpt.config or {}) or (
                self.layouts is not None and layout not in self.layouts):
            where = f" of the {' or '.join(self.layouts)} layout" if self.layouts else ""
            raise FFNToolsError(f"--logits/--generate: {side} ({ckpt.path}) is not a {self.fmt} model directory{where} "
                                "with a config.json naming its model_type (ffn-tools --config FILE gives one); no "
                                "client here runs it")

    def _model(self, path: Path, dtype: str | None):
        import torch
        import transformers

        with self.view(path) as view:
            config = transformers.AutoConfig.for_model(**(view.config or {}))
            state = {n: view[n] for n in view}
        dt = getattr(torch, dtype) if dtype else next(iter(state.values())).dtype
        # built in the weights' dtype, as from_pretrained builds it: buffers transformers keeps in float32 (the
        # rotary inv_freq) stay there, where casting the built model would round them
        model: Any = transformers.AutoModelForCausalLM.from_config(config, dtype=dt)
        problems = []
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        if set(missing) - tied:
            problems.append(f"{self.name}: weights the checkpoint lacks: {sorted(set(missing) - tied)[:4]}")
        if unexpected:
            problems.append(f"{self.name}: weights its class does not know: {sorted(unexpected)[:4]}")
        if tied:
            model.tie_weights()
        return model.eval(), problems

    def logits(self, path: Path, tokens, dtype: str | None = None):
        import torch

        model, problems = self._model(path, dtype)
        with torch.no_grad():
            return model(tokens).logits.to(torch.float64), problems

    def generate(self, path: Path, prompts, new_tokens, score=None, dtype=None):
        from transformers import AutoTokenizer

        from .generation import run

        model, problems = self._model(path, dtype)
        if problems:
            raise FFNToolsError("; ".join(problems))
        return run(self.name, model, AutoTokenizer.from_pretrained(path), prompts, new_tokens, score)
