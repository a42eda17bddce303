"""config.json of an hf-layout Flax export: the source's, plus the keys transformers 4's Flax models read.

The only client of a Flax export is transformers 4 (``FlaxLlamaForCausalLM`` & co.; transformers 5 has no
Flax models). Version 5 writes RoPE as ``rope_parameters`` and the dtype as ``dtype``; version 4 reads
``rope_theta``, ``rope_scaling``, ``partial_rotary_factor`` and ``torch_dtype``, and where they are missing
falls back to its defaults: a Llama 3 with ``rope_theta`` 500000 would run with 10000, other logits than
torch's. ``v4_config`` adds those keys from the v5 ones (never replacing a value the config holds) and
records in config.json itself which it added (``ADDED_KEYS``) or filled in where the config had null
(``NULLED_KEYS``); ``restore_source_config`` (the Flax reader) undoes exactly that, so reading the export
back gives the config it was made from.

The record lives in config.json, not in the msgpack (a tree holds arrays only) nor in a sidecar file: it
travels with the config it describes (a config.json copied or uploaded alone still reads back right),
transformers 4 keeps unknown keys as inert attributes, the linen layout's ``ffn_tools_manifest`` sits there
too, and a sidecar would be carried into every later conversion as an unknown side file.
"""

from __future__ import annotations

from typing import overload

from ffn_tools.errors import CheckpointError

ADDED_KEYS = "ffn_tools_added_config_keys"  # the same names as the MLX export's record (in its metadata)
NULLED_KEYS = "ffn_tools_null_config_keys"
RECORD = (ADDED_KEYS, NULLED_KEYS)
DEFAULT_ROPE = "default"  # rope_type without scaling: transformers 4's rope_scaling None
NOT_SCALING = ("rope_theta", "partial_rotary_factor")  # rope_parameters keys v4 reads beside rope_scaling


def v4_keys(config: dict) -> dict:
    """The transformers-4 spellings of ``config``'s v5 keys: ``rope_theta``, ``rope_scaling`` (None for the
    default RoPE, so not given), ``partial_rotary_factor`` from a flat ``rope_parameters``; ``torch_dtype``
    from ``dtype``. ``rope_parameters`` nested per layer type has no v4 spelling shared by all models: none."""
    out: dict = {}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and not any(isinstance(v, dict) for v in rope.values()):
        for key in NOT_SCALING:
            if rope.get(key) is not None:
                out[key] = rope[key]
        if rope.get("rope_type", rope.get("type", DEFAULT_ROPE)) != DEFAULT_ROPE:
            out["rope_scaling"] = {k: v for k, v in rope.items() if k not in NOT_SCALING}
    if config.get("dtype") is not None:
        out["torch_dtype"] = config["dtype"]
    return out


@overload
def v4_config(config: dict) -> dict: ...
@overload
def v4_config(config: None) -> None: ...
def v4_config(config: dict | None) -> dict | None:
    """``config`` with the v4 keys it lacks (or holds as null) added, and the record of them (see the module
    doc); ``config`` itself when none is missing."""
    if config is None:
        return None
    add = {k: v for k, v in v4_keys(config).items() if config.get(k) is None}
    if not add:
        return dict(config)
    out = {**config, **add}
    for key, names in ((ADDED_KEYS, [k for k in add if k not in config]),
                       (NULLED_KEYS, [k for k in add if k in config])):
        if names:
            out[key] = sorted(names)
    return out


@overload
def restore_source_config(config: dict, where: str = ...) -> dict: ...
@overload
def restore_source_config(config: None, where: str = ...) -> None: ...
def restore_source_config(config: dict | None, where: str = "config.json") -> dict | None:
    """The inverse of ``v4_config``: ``config`` without the keys export added and the record, filled nulls nulled.

    Raises:
        CheckpointError: a record that is not a list of key names (naming ``where``).
    """
    if config is None or not any(k in config for k in RECORD):
        return config
    out = dict(config)
    record = {k: out.pop(k, []) for k in RECORD}
    for key, names in record.items():
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise CheckpointError(f"{where}: {key} must be a list of config keys (found {str(names)[:40]}); "
                                  "ffn-tools writes it; remove it to read the config as it is")
    for k in record[ADDED_KEYS]:
        out.pop(k, None)
    for k in record[NULLED_KEYS]:
        if k in out:
            out[k] = None
    return out


def added(config: dict | None) -> list[str]:
    """The keys ``v4_config`` added to or filled in ``config`` (from its record), sorted."""
    if not config:
        return []
    return sorted(n for k in RECORD for n in config.get(k, []))
