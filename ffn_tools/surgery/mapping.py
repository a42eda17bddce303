"""The mapping an expert surgery records in its output: each MoE layer's experts, new index -> source index.

It is written twice: into the weight files' safetensors metadata (``METADATA_KEY``, so a single-file output
carries it) and, in a directory output, as ``FILE`` beside them; the receipt records the command that made it.
A surgery of an output that holds one composes them: the mapping always points at the first source.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import FFNToolsError

METADATA_KEY = "ffn_tools_expert_map"
FILE = "expert_map.json"

Mapping = dict[int, tuple[int, ...]]  # layer -> source expert of each new index


def as_json(mapping: Mapping, experts: int, command: str) -> dict:
    """The recorded form: ``{"command", "source_experts", "layers": {"0": [source, ...]}}``."""
    return {"command": command, "source_experts": experts,
            "layers": {str(k): list(v) for k, v in sorted(mapping.items())}}


def recorded(ckpt) -> dict | None:
    """The mapping ``ckpt`` records (its metadata, or ``FILE`` beside its weights), as ``as_json`` wrote it, or
    None where it records none.

    Raises:
        FFNToolsError: one recorded that is not such a mapping.
    """
    text = ckpt.metadata.get(METADATA_KEY)
    where = f"{ckpt.path}: metadata {METADATA_KEY}"
    if text is None:
        beside = Path(ckpt.root) / FILE
        if not beside.is_file():
            return None
        text, where = beside.read_text(), str(beside)
    try:
        data = json.loads(text)
        layers = {int(k): tuple(int(e) for e in v) for k, v in data["layers"].items()}
        int(data["source_experts"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FFNToolsError(f"{where}: not an expert mapping ({e})") from None
    return {**data, "layers": layers}


def composed(before: dict | None, mapping: Mapping) -> tuple[Mapping, int | None]:
    """``mapping`` (new -> this input's index) composed with the input's own ``before`` (this input's index ->
    its source's): new -> first source; and the first source's expert count (None: the input is the source)."""
    if before is None:
        return mapping, None
    prior = before["layers"]
    if set(prior) != set(mapping):
        raise FFNToolsError(f"the input records an expert mapping of layers {sorted(prior)}, but its MoE layers are "
                            f"{sorted(mapping)}")
    return {k: tuple(prior[k][e] for e in v) for k, v in mapping.items()}, int(before["source_experts"])
