"""``mlx_lm.convert`` as ``verify --locate``'s independent floor: B's MLX form re-derived from A by mlx_lm's own
converter, not ffn-tools', so that a defect in ffn-tools' MLX export (in B and in ffn-tools' floor alike) shows.

An anchor wrong about its input is no floor: mlx_lm.convert 0.32.2 copies a transformers-5 config.json without
its top-level ``rope_theta`` (transformers 5 keeps it in ``rope_parameters``), so mlx_lm would run the anchor at
its default 10000. Where ffn-tools' own derivation (``like``) has a setting the anchor's config lacks, the anchor's
tensors are taken with that configuration, as mlx_lm must read A's, and the words say which settings.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path


def anchor(a: Path, recipe: dict, out: Path, like: Path | None) -> str | None:
    """The anchor written to ``out`` (see the module docstring): its words, or None where mlx_lm.convert is not
    installed. ``recipe``: MLX's convert options (dtype, quantize, q_bits, q_group_size, q_mode)."""
    try:
        from mlx_lm import __version__, convert
    except ImportError:
        return None
    quantize = bool(recipe.get("quantize"))
    kw = {k: recipe[k] for k in ("q_bits", "q_group_size", "q_mode") if quantize and recipe.get(k) is not None}
    words = f"mlx_lm.convert {__version__}"
    source, lifted = _staged(a, like, out.parent / f"{out.name}-input")
    if lifted:
        words += f" (given A's {', '.join(lifted)} as mlx_lm must read them, which A's config.json holds otherwise)"
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines: never into verify's --json
        convert(hf_path=str(source), mlx_path=str(out), dtype=recipe.get("dtype"), quantize=quantize, **kw)
    if like is not None and (like / "config.json").is_file():
        mine, theirs = (json.loads((p / "config.json").read_text()) for p in (like, out))
        dropped = _missing(mine, theirs)
        if dropped:
            (out / "config.json").write_text(json.dumps({**theirs, **{k: mine[k] for k in dropped}}, indent=2))
            words += (f" (its tensors with A's {', '.join(dropped)}, which its config.json lacks: mlx_lm would read "
                      "its default)")
    return words


def _missing(mine: dict, theirs: dict) -> list[str]:
    return sorted(k for k in mine if k not in theirs and k not in ("quantization", "quantization_config"))


def _staged(a: Path, like: Path | None, where: Path) -> tuple[Path, list[str]]:
    """A as mlx_lm.convert is given it: A itself, or where ffn-tools' derivation (``like``) has top-level settings
    A's config.json holds otherwise (transformers 5: ``rope_parameters.rope_theta``, ``num_local_experts``), A's
    files linked beside a config.json that also has them; and the settings so added."""
    if like is None or not (like / "config.json").is_file() or not (a / "config.json").is_file():
        return a, []
    mine, theirs = (json.loads((p / "config.json").read_text()) for p in (like, a))
    lifted = _missing(mine, theirs)
    if not lifted:
        return a, []
    where.mkdir(parents=True)
    for f in a.iterdir():
        if f.name != "config.json":
            (where / f.name).symlink_to(f.resolve())
    (where / "config.json").write_text(json.dumps({**theirs, **{k: mine[k] for k in lifted}}, indent=2))
    return where, lifted
