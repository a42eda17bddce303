"""What runs a DCP checkpoint here: ``torch.distributed.checkpoint.load`` itself, for the load check (every key
the metadata lists loaded, one at a time, into a tensor of its declared shape and dtype); the model it holds runs as
its Hugging Face view's weights in transformers' class of its config (``--logits``, ``--generate``), as
``converters.flax.client`` runs Flax weights."""

from __future__ import annotations

from ffn_tools.checks.load import LoadCheck

from ..flax.client import FlaxWeights

NAME = "transformers (DCP weights)"


class DcpClient(FlaxWeights):
    """See the module docstring."""

    def __init__(self):
        super().__init__()
        self.label, self.name = "torch.distributed.checkpoint", NAME  # type: ignore[misc]

    def load_check(self, ckpt) -> LoadCheck:
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        stored = ckpt.stored
        problems = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": as meant
            for key, e in stored.entries.items():
                if e.dtype is None:
                    continue
                target = {key: torch.empty(e.shape, dtype=getattr(torch, e.dtype))}
                try:
                    dcp.load(target, checkpoint_id=str(stored.root), no_dist=True)
                except Exception as err:  # noqa: BLE001 - the client's own refusal, reported as such
                    problems.append(f"{key}: {' '.join(str(err).split())[:200]}")
        if problems:
            return LoadCheck(self.label, refused="; ".join(problems[:4]))
        keys = sum(e.dtype is not None for e in stored.entries.values())
        return LoadCheck(self.label, architecture=f"dcp.load of all {keys} keys, one at a time")

    def view(self, path):
        from pathlib import Path

        from . import FORMAT

        return FORMAT.open(Path(path))

    def ready_for_logits(self, ckpt, side: str) -> None:
        from ffn_tools.errors import FFNToolsError

        if "model_type" not in (ckpt.config or {}):
            raise FFNToolsError(f"--logits/--generate: {side} ({ckpt.path}) has no config.json naming its model_type; "
                                "give one with ffn-tools --config FILE")
