"""config.json of an MLX model: as mlx_lm writes it, and what export added to the source's.

``mlx_config`` is ``mlx_lm.convert``'s: generation_config's eos_token_id merged in (its ``load_config``),
``_name_or_path``/``vision_config`` dropped, ``quantization`` (and its copy ``quantization_config``) added,
keys sorted, 4-space indent. Export may add keys mlx_lm's ``ModelArgs`` need (``models.complete_config``,
``tie_word_embeddings``); the safetensors metadata records them (``ADDED_KEYS``, ``NULLED_KEYS``), so reading
the MLX model back gives the source's config.json. mlx_lm ignores that metadata.
"""

from __future__ import annotations

import json

ADDED_KEYS = "ffn_tools_added_config_keys"
NULLED_KEYS = "ffn_tools_null_config_keys"
SOURCE_TYPE = "ffn_tools_source_model_type"  # the model_type the source had where mlx_lm loads another


def added_metadata(source: dict, config: dict) -> dict[str, str]:
    """The safetensors metadata recording what export added to ``source`` to make ``config``: keys the
    source lacked, keys it had as null that were filled in, its model_type if mlx_lm needed another; empty
    when nothing was."""
    added = sorted(k for k in config if k not in source)
    nulled = sorted(k for k in config if k in source and source[k] is None and config[k] is not None)
    out = {k: ",".join(v) for k, v in ((ADDED_KEYS, added), (NULLED_KEYS, nulled)) if v}
    if source.get("model_type") != config.get("model_type") and isinstance(source.get("model_type"), str):
        out[SOURCE_TYPE] = source["model_type"]
    return out


def restore_source_config(config: dict, metadata: dict) -> dict:
    """The inverse of ``added_metadata``: ``config`` without the keys export added, its filled nulls nulled."""
    out = dict(config)
    for k in filter(None, metadata.get(ADDED_KEYS, "").split(",")):
        out.pop(k, None)
    for k in filter(None, metadata.get(NULLED_KEYS, "").split(",")):
        if k in out:
            out[k] = None
    if metadata.get(SOURCE_TYPE):
        out["model_type"] = metadata[SOURCE_TYPE]
    return out


def mlx_config(ckpt, config: dict, quantization: dict | None) -> str:
    """config.json as ``mlx_lm.convert`` writes it (see the module doc)."""
    config = dict(config)
    gen = ckpt.root / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (ValueError, AttributeError):
            eos = None
        if eos:
            config["eos_token_id"] = eos
    config.pop("_name_or_path", None)
    config.pop("vision_config", None)
    if quantization is not None:
        config["quantization"] = config["quantization_config"] = quantization
    return json.dumps(dict(sorted(config.items())), indent=4)
