"""A checkpoint loaded as transformers loads it (``from_pretrained``), and what went wrong loading it: what the
client's logits, masked logits, activations and generation all run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast


def load_model(path: Path, dtype: str | None):
    """``AutoModelForCausalLM.from_pretrained`` in ``dtype`` (None: the config's), and what went wrong loading it
    (weights missing, left over, of the wrong shape), as lines."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # loading problems are returned, as failures
    hf_logging.disable_progress_bar()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype) if dtype else "auto",
                                                  output_loading_info=True)
    model, info = cast("tuple[Any, dict]", loaded)  # transformers types the model alone; the flag adds the dict
    problems = [f"transformers: {what} {_clip(info.get(key) or [])}"
                for key, what in (("missing_keys", "initialised weights the checkpoint lacks:"),
                                  ("unexpected_keys", "ignored weights it does not know:"),
                                  ("mismatched_keys", "re-initialised weights of the wrong shape:"))
                if info.get(key)]
    return model, problems


def _clip(items, n: int = 4) -> str:
    items = sorted(items)
    return ", ".join(items[:n]) + (f" ... ({len(items)} in all)" if len(items) > n else "")
