"""A's and B's configs as their clients read them, compared key by key (``verify``'s config check).

A conversion can keep every weight bit for bit and still change the model: ``rope_theta``, ``rms_norm_eps``,
the head split, ``sliding_window``, softcapping, MoE routing keys all live in config.json. Each side's config
is normalized by its client's own reader, so spellings that mean the same thing compare equal and every
default is filled in:

- transformers' config class for the model_type (``CONFIG_MAPPING[type].from_dict``): v4/v5 renames
  (``rope_theta`` <-> ``rope_parameters``, ``torch_dtype`` <-> ``dtype``) and defaults come out the same;
- for an MLX side, also mlx_lm's ``ModelArgs`` of its model: B's config.json as mlx_lm reads it against A's
  config as an MLX export of A would hand it to mlx_lm (the exporter's own completion of the config).

Every key that differs fails, naming the key and both values, except the keys of ``NO_EFFECT`` (they provably
do not change what the model computes) and those the user accepts (``--allow-config KEY``). B's config dtype is
checked against the dtype B's weights are stored in: a narrower or different float dtype means the client loads
the weights with a lossy cast.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..errors import listing
from . import Check

log = logging.getLogger(__name__)

# Keys that do not change the function a client computes from the weights.
NO_EFFECT = {
    "transformers_version": "the writer's version",
    "_name_or_path": "where the config was loaded from",
    "_commit_hash": "the Hub revision it came from",
    "use_cache": "caching of keys and values during generation, not their values",
    "output_hidden_states": "what a forward returns beside the logits",
    "output_attentions": "what a forward returns beside the logits",
    "return_dict": "the container of the outputs",
    "torchscript": "export mode",
    "chunk_size_feed_forward": "the FFN computed in chunks: the same result",
    "id2label": "labels of classification heads (no causal-LM head reads them)",
    "label2id": "labels of classification heads",
    "problem_type": "the loss of classification heads",
    "initializer_range": "initialisation of weights the checkpoint does not hold (the load check fails those)",
    "pad_token_id": "the id batches are padded with (the embedding's padding_idx acts in training only); "
                    "generation_config.json's is compared with the side files",
    "attention_dropout": "dropout, off in inference",
    "hidden_dropout": "dropout, off in inference",
    "embd_pdrop": "dropout, off in inference",
    "resid_pdrop": "dropout, off in inference",
    "attn_pdrop": "dropout, off in inference",
    "dtype": "checked against the dtype of the stored weights instead",
    "torch_dtype": "checked against the dtype of the stored weights instead",
    "quantization": "checked with the quantized tensors",
    "quantization_config": "checked with the quantized tensors",
}
QUANT_KEYS = {"quantization", "quantization_config"}  # at any depth (mlx_lm.convert copies it into text_config)
# Only under the default rope (no scaling that reads it): the longest context a model is meant for.
DEFAULT_ROPE_ONLY = ("max_position_embeddings",)
FLOATS = ("F64", "F32", "F16", "BF16")
WIDER = {("F16", "F32"), ("BF16", "F32"), ("F16", "F64"), ("BF16", "F64"), ("F32", "F64")}  # stored -> config
NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float": "F32", "half": "F16"}


@dataclass
class ConfigResult(Check):
    """What the config check found. ``readers`` says how each side was read."""

    name: ClassVar[str] = "config"

    readers: list[str] = field(default_factory=list)
    compared: int = 0  # keys compared
    allowed: list[str] = field(default_factory=list)  # "key: A x, B y" accepted by --allow-config
    ties: tuple = (None, None)  # each side's tie_word_embeddings as its client reads it (None: unknown)
    # settings the clients run otherwise only past a sequence length: {"key", "tokens" (the longest sequence on
    # which they agree), "line"}; a pass up to the shortest such length (``unbind``: a failure instead)
    bounded: list[dict] = field(default_factory=list)

    @property
    def tokens(self) -> int | None:
        """The longest sequence on which A and B compute the same where a setting differs past it; None: no bound."""
        return min((b["tokens"] for b in self.bounded), default=None)

    def unbind(self) -> None:
        """Count each bounded difference as a problem (``--unbounded``: the same function at every length)."""
        self.problems += [f"{b['line']} (--unbounded)" for b in self.bounded]
        self.bounded = []

    def line(self) -> str:
        if self.skipped:
            return f"config: not compared ({self.skipped})"
        allowed = f", {len(self.allowed)} allowed by --allow-config" if self.allowed else ""
        head = (f"config: {self.compared} keys compared as {' and '.join(self.readers)} read them, "
                f"{len(self.problems)} differ{allowed}")
        return head + "".join(f"; bounded: {b['line']}" for b in self.bounded)

    def as_dict(self) -> dict:
        return {"readers": self.readers, "compared": self.compared, "problems": self.problems, "notes": self.notes,
                "allowed": self.allowed, "bounded": self.bounded, "skipped": self.skipped, "passed": self.verdict}


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def differences(a, b, path: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, A's value, B's value) for every leaf where ``a`` and ``b`` differ (a missing key is
    ``<absent>``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            key = f"{path}.{k}" if path else str(k)
            out += differences(a.get(k, _ABSENT), b.get(k, _ABSENT), key)
        return out
    if type(a) is bool or type(b) is bool:  # True == 1 in Python, not in a config
        return [] if type(a) is type(b) and a == b else [(path, a, b)]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [(path, a, b)]


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def transformers_view(config: dict) -> tuple[dict | None, str | None]:
    """``config`` through transformers' config class for its model_type: (normalized dict, None), or
    (None, why not) when transformers is missing, does not know the type, or refuses the config."""
    try:
        from transformers import CONFIG_MAPPING
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        return None, f"transformers is not installed ({e.name})"
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None, f"transformers has no config class for model_type {model_type!r}"
    try:
        hf_logging.set_verbosity_error()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = CONFIG_MAPPING[model_type].from_dict(decoded(dict(config))).to_dict()
    except Exception as e:  # noqa: BLE001 - the config class's own refusal, any type
        return None, (f"transformers' {CONFIG_MAPPING[model_type].__name__} refuses it ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:200]})")
    _drop_rope_aliases(out)
    heads, width = out.get("num_attention_heads"), out.get("hidden_size")
    if "head_dim" in out and out["head_dim"] is None and isinstance(heads, int) and heads and isinstance(width, int):
        out["head_dim"] = width // heads  # what the modeling code takes for a head_dim of None
    return out, None


SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decoded(node):
    """``node`` with transformers' JSON spelling of non-finite floats (``{"__float__": "Infinity"}``, as its
    ``save_pretrained`` writes them) turned into floats, as its ``from_pretrained`` reads them."""
    if isinstance(node, dict):
        if set(node) == {"__float__"} and node["__float__"] in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[node["__float__"]]
        return {k: decoded(v) for k, v in node.items()}
    return [decoded(v) for v in node] if isinstance(node, list) else node


def _drop_rope_aliases(node) -> None:
    """Drop v4's ``type`` beside an equal ``rope_type`` (the exporter spells both for mlx_lm; one meaning)."""
    if isinstance(node, dict):
        if "rope_type" in node and node.get("type") == node["rope_type"]:
            del node["type"]
        for v in node.values():
            _drop_rope_aliases(v)


def _rope_is_default(cfg: dict) -> bool:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values()):  # per layer type
        return all(not isinstance(v, dict) or v.get("rope_type", "default") == "default" for v in rope.values())
    return not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) == "default"


def generation_eos(ckpt):
    """generation_config.json's eos_token_id beside ``ckpt``, or None."""
    try:
        gen = json.loads((Path(ckpt.root) / "generation_config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return gen.get("eos_token_id") if isinstance(gen, dict) else None


def compare_keys(res: ConfigResult, a: dict, b: dict, allow, eos_a) -> None:
    """Add every difference between normalized ``a`` and ``b`` to ``res``."""
    default_rope = _rope_is_default(a) and _rope_is_default(b)
    seen = {p.split(":")[0] for p in res.problems} | {x.split(":")[0] for x in res.allowed}
    for key, va, vb in differences(a, b):
        top = key.split(".")[0]
        if top in NO_EFFECT or QUANT_KEYS & set(key.split(".")) or (top in DEFAULT_ROPE_ONLY and default_rope) \
                or key in seen:
            continue
        if top == "eos_token_id" and vb == eos_a:  # mlx_lm.convert merges generation_config's eos into config.json
            continue
        seen.add(key)
        line = f"{key}: A {_short(va)}, B {_short(vb)}"
        (res.allowed if key in allow or top in allow else res.problems).append(line)
    res.compared += len(set(a) | set(b))


def compare_configs(ca, cb, allow=()) -> tuple[ConfigResult, tuple[dict, dict] | None]:
    """Compare the configs of open checkpoints ``ca`` (A) and ``cb`` (B), each normalized by transformers' config
    class for its model type (the schema every Hugging Face-named checkpoint's config follows).

    Returns:
        The result, and the two normalized configs (None where the comparison stopped early: a side without a
        config, or one transformers refuses), for what B's client compares beyond them.
    """
    allow = set(allow)
    res = ConfigResult()
    a, b = ca.config, cb.config
    if not a or "model_type" not in a:
        if b and "model_type" in b:
            res.notes.append("A has no config.json naming a model_type; B's is not compared")
        res.skipped = "A has no config.json naming a model_type"
        return res, None
    if not b or "model_type" not in b:
        res.problems.append("A has a config.json and B has none naming a model_type: B's client cannot build "
                            "the model")
        return res, None
    (na, why_a), (nb, why_b) = transformers_view(a), transformers_view(b)
    if nb is None and why_b and "refuses" in why_b:
        res.problems.append(f"B's config.json: {why_b}")
        return res, None
    if na is None or nb is None:
        res.notes.append(f"compared as written: {why_a or why_b}")
        na, nb = dict(a), dict(b)
        res.readers.append("config.json")
    else:
        res.readers.append(f"transformers' {type_name(a)}")
    compare_keys(res, na, nb, allow, generation_eos(ca))
    res.ties = tuple(n.get("tie_word_embeddings") for n in (na, nb))
    return res, (na, nb)


def note_unused(res: ConfigResult, allow) -> None:
    """A note for each ``--allow-config`` key that matched no difference."""
    allow = set(allow)
    unused = sorted(allow - {x.split(":")[0] for x in res.allowed} - {x.split(":")[0].split(".")[0] for x in res.allowed})
    if unused:
        res.notes.append(f"--allow-config {listing(unused)}: no such difference")


def type_name(config: dict) -> str:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[config["model_type"]].__name__
