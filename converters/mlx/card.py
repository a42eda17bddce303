"""The model card README.md ``mlx_lm.convert`` writes beside an MLX model.

From a local directory mlx_lm writes huggingface_hub's empty template with ``library_name: mlx``,
``pipeline_tag: text-generation`` and the ``mlx`` tag. From a Hub repo it takes the repo's card, adds those
and ``base_model: <repo id>``, and drops the card's text. A checkpoint ffn-tools fetched from the Hub is a
snapshot in the Hub cache (``models--org--name/snapshots/<rev>``): it gets the second kind.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

TEMPLATE = "---\nlanguage: en\nlibrary_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n---\n"
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+")


def hub_repo(root: Path) -> str | None:
    """The Hub repo id of a directory inside the Hub cache, else None."""
    m = _SNAPSHOT.search(Path(root).resolve().as_posix()) or _SNAPSHOT.search(Path(root).as_posix())
    return f"{m['org']}/{m['name']}" if m else None


def model_card(ckpt) -> str:
    """README.md text for the MLX model made from ``ckpt`` (see the module doc)."""
    repo = hub_repo(ckpt.root)
    if repo is None:
        return TEMPLATE
    from huggingface_hub import ModelCard, ModelCardData

    readme = Path(ckpt.root) / "README.md"
    card = ModelCard(readme.read_text()) if readme.is_file() else ModelCard.from_template(ModelCardData(language="en"))
    data = cast(ModelCardData, card.data)  # a ModelCard's data class; huggingface_hub types it as RepoCard's CardData
    data.library_name = "mlx"
    data.pipeline_tag = "text-generation"
    if data.tags is None:
        data.tags = ["mlx"]
    elif "mlx" not in data.tags:
        data.tags += ["mlx"]
    data.base_model = repo
    card.text = ""
    return str(card)


def transformers_card(ckpt) -> str | None:
    """The input's model card with MLX's labels replaced by transformers' (``library_name: mlx`` and the
    ``mlx`` tag, as mlx_lm writes them), so an uploaded PyTorch repo is not labelled MLX; None: nothing to
    change."""
    readme = Path(ckpt.root) / "README.md"
    if not readme.is_file():
        return None
    text = readme.read_text()
    head = re.match(r"---\n(.*?\n)---\n", text, re.S)
    if head is None:
        return None
    front = re.sub(r"(?m)^library_name:\s*mlx\s*$", "library_name: transformers", head[1])
    front = re.sub(r"(?m)^\s*-\s*mlx\s*\n", "", front)
    front = re.sub(r"(?m)^tags:\s*\n(?!\s*-)", "", front)  # a tags list left empty
    return None if front == head[1] else f"---\n{front}---\n{text[head.end():]}"
