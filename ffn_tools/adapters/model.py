"""An adapter as ffn-tools holds it: low-rank factors of the base's weights, in the base's own names.

Every adapter format (PEFT, mlx_lm, llama.cpp's GGUF LoRA) reads into, and writes from, this one form:

    Lora.target  the base tensor it changes, named as the base checkpoint names it (Hugging Face PyTorch names:
                 ``model.layers.0.mlp.gate_proj.weight``, a stacked v5 expert tensor ``...mlp.experts.gate_up_proj``)
    Lora.a, .b   PyTorch orientation: A (r, in), B (out, r); for a stacked target one pair per expert,
                 A (E, r, in), B (E, out, r)
    Lora.scale   the number the runtime multiplies B·A by (PEFT: lora_alpha / r, or / sqrt(r) with rsLoRA;
                 mlx_lm: its ``scale``; llama.cpp: alpha / r)

so that every runtime's delta is the same expression, ``scale · B · A`` (``Lora.delta``): the update the base weight
(out, in) receives. Factors are held in memory (an adapter is small next to its base); converting keeps their
dtype and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import FFNToolsError

if TYPE_CHECKING:
    import torch


class AdapterError(FFNToolsError):
    """An adapter cannot be read, re-laid out, merged or written as asked."""


@dataclass(frozen=True)
class Lora:
    """One target's low-rank update (see the module docstring).

    Attributes:
        target: the base tensor name.
        a, b: the factors, PyTorch orientation; 3-D for a stacked target (experts on dim 0).
        scale: what the runtime multiplies ``b @ a`` by.
        alpha: the alpha the source states (PEFT's lora_alpha, llama.cpp's adapter.lora.alpha), None where the
            format stores only a scale (mlx_lm).
        rslora: PEFT's scale is alpha / sqrt(r) rather than alpha / r.
        delta_rounded: the adapter's runtime rounds ``scale·B·A`` to the base weight's dtype before adding it, so
            its merge (and its live forward, which adds the same rounded delta) rounds twice: PEFT's
            ``target_parameters`` (``ParamWrapper.get_delta_weight`` casts the delta to the parameter's dtype),
            unlike its ``target_modules``, whose float32 delta is added to the weight in one rounding. verify allows
            that second rounding for this target only.
    """

    target: str
    a: "torch.Tensor"
    b: "torch.Tensor"
    scale: float
    alpha: float | None = None
    rslora: bool = False
    delta_rounded: bool = False

    def __post_init__(self) -> None:
        a, b = self.a, self.b
        if a.ndim != b.ndim or a.ndim not in (2, 3) or a.shape[-2] != b.shape[-1] or a.shape[:-2] != b.shape[:-2]:
            raise AdapterError(f"{self.target}: LoRA factors A{list(a.shape)} and B{list(b.shape)} do not fit "
                               "(want A (r, in), B (out, r), or with an experts dim first)")

    @property
    def rank(self) -> int:
        return int(self.a.shape[-2])

    @property
    def experts(self) -> int | None:
        """E for a stacked target, else None."""
        return int(self.a.shape[0]) if self.a.ndim == 3 else None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the base tensor it changes: (out, in), or (E, out, in)."""
        return (*self.a.shape[:-2], int(self.b.shape[-2]), int(self.a.shape[-1]))

    def delta(self, dtype=None) -> "torch.Tensor":
        """``scale · B · A`` in float32 (or ``dtype``): the update of the base tensor, its shape."""
        import torch

        dtype = dtype or torch.float32
        return (self.b.to(dtype) @ self.a.to(dtype)) * self.scale

    def expert(self, e: int, target: str) -> "Lora":
        """Expert ``e`` of a stacked target, as a 2-D LoRA of ``target``."""
        return replace(self, target=target, a=self.a[e], b=self.b[e])


@dataclass
class Adapter:
    """An adapter read from disk, or made by a re-layout.

    Attributes:
        path: where it was read (for messages).
        format: the adapter format's name ("peft", "mlx", "gguf").
        loras: target -> Lora, in the order the source lists them.
        config: the base model's config.json where the adapter carries or was given one (model_type, layers,
            sizes), else None.
        meta: what the format keeps that ffn-tools does not interpret, carried to an output of the same format
            (PEFT's task_type and base_model_name_or_path, mlx_lm's training options).
    """

    path: Path
    format: str
    loras: dict[str, Lora]
    config: dict | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def dtype(self):
        """The factors' dtype (the first one's; formats write one)."""
        return next(iter(self.loras.values())).a.dtype if self.loras else None

    def with_loras(self, loras: dict[str, Lora]) -> "Adapter":
        return replace(self, loras=loras)
