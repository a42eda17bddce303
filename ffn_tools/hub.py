"""Hugging Face Hub ids where a checkpoint path is taken: ``org/name`` or ``org/name@revision``.

A path that exists is always a path. One that does not, and reads like a repo id, is resolved with
``huggingface_hub.snapshot_download`` (which honours HF_HOME, HF_HUB_OFFLINE and the local cache), fetching
only what ffn-tools reads: weights, their index, config and generation config, tokenizer files.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from .errors import CheckpointError

REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?")
PATTERNS = ["README.md", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.msgpack",
            "*.msgpack.index.json", "*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "params.json"]


def looks_like_repo_id(text: str) -> bool:
    """``org/name`` or ``org/name@rev`` (and not an existing path)."""
    return bool(REPO_ID.fullmatch(text)) and not Path(text).exists()


def resolve(text: str) -> Path:
    """The local directory of a checkpoint path or Hub id.

    Raises:
        CheckpointError: neither a path nor a repo id the Hub (or the offline cache) has.
    """
    path = Path(text)
    m = None if path.exists() else REPO_ID.fullmatch(text)  # an existing path is a path (``looks_like_repo_id``)
    if m is None:
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"{text}: no such path; as a Hub repo id it needs huggingface_hub: "
                              "pip install huggingface_hub") from None
    try:
        return Path(snapshot_download(m.group("repo"), revision=m.group("rev"), allow_patterns=PATTERNS))
    except Exception as e:  # noqa: BLE001 - the hub client's own errors: not found, offline, gated, network
        reason = textwrap.shorten(" ".join(str(e).split()), 300, placeholder=" ...")  # whole words
        raise CheckpointError(f"{text}: no such path, and not a Hub repo the cache or the Hub has "
                              f"({type(e).__name__}: {reason})") from None
