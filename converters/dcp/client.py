"""What runs a DCP checkpoint here: ``torch.distributed.checkpoint.load`` itself, for the load check (every key
the metadata lists loaded into a tensor of its declared shape and dtype, a GiB at a time); the model it holds runs as
its Hugging Face view's weights in transformers' class of its config (``--logits``, ``--generate``:
``converters.pytorch.weights``)."""

from __future__ import annotations

from ffn_tools.checks.load import LoadCheck

from ..pytorch.weights import TransformersRuns

GROUP = 1 << 30  # bytes the load check loads at once


class DcpClient(TransformersRuns):
    """See the module docstring."""

    def __init__(self):
        super().__init__("dcp", "torch.distributed.checkpoint", "", "DCP")

    def load_check(self, ckpt) -> LoadCheck:
        """``dcp.load`` of every tensor key the metadata lists into a tensor of its declared shape and dtype, in
        groups of at most ``GROUP`` bytes (memory: a group, never the model)."""
        import math
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        stored = ckpt.stored
        groups: list[list] = [[]]
        size = 0
        for key, e in stored.entries.items():
            if e.dtype is None:
                continue
            n = math.prod(e.shape) * getattr(torch, e.dtype).itemsize
            if groups[-1] and size + n > GROUP:
                groups.append([])
                size = 0
            groups[-1].append((key, e))
            size += n
        problems = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": as meant
            for group in groups:
                target = {key: torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for key, e in group}
                try:
                    dcp.load(target, checkpoint_id=str(stored.root), no_dist=True)
                except Exception as err:  # noqa: BLE001 - the client's own refusal, reported as such
                    problems.append(f"{', '.join(k for k, _ in group[:3])}: {' '.join(str(err).split())[:200]}")
        if problems:
            return LoadCheck(self.label, refused="; ".join(problems[:4]))
        keys = sum(len(g) for g in groups)
        return LoadCheck(self.label, architecture=f"dcp.load of all {keys} keys, {GROUP >> 30} GiB at a time")
