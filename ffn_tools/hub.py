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
        raise CheckpointError(f"{text}: no such path; as a Hub repo id, {_why(e, m.group('rev'))}") from None


def _why(e: Exception, revision: str | None) -> str:
    """What ``snapshot_download``'s error means for the user: the Hub has no such repo (or revision), or it was
    never asked (offline) or could not be reached, and the local cache has no copy."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    cause = e.__cause__ or e.__context__
    reason = textwrap.shorten(" ".join(str(cause or e).split()), 200, placeholder=" ...")  # whole words
    if isinstance(e, LocalEntryNotFoundError):
        if constants.HF_HUB_OFFLINE:
            return ("the local Hugging Face cache has no copy and Hub access is off (HF_HUB_OFFLINE is set): unset it "
                    "to download, or give a local path")
        return (f"the Hub is unreachable ({type(cause).__name__ if cause else 'offline'}: {reason}) and the local "
                "cache has no copy: check the network connection (or HF_ENDPOINT), or give a local path")
    if isinstance(e, GatedRepoError):
        return "the Hub's repo is gated: accept its terms on the Hub and log in (hf auth login), or give a local path"
    if isinstance(e, RevisionNotFoundError):
        return f"the Hub's repo has no revision {revision!r}"
    if isinstance(e, RepositoryNotFoundError):
        return "the Hub has no such repo (or it is private: log in with hf auth login)"
    return f"it could not be fetched ({type(e).__name__}: {reason})"
