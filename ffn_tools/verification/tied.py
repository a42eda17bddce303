"""Tied embeddings in ``verify``: an ``lm_head.weight`` stored on one side only, under a tie.

transformers, mlx_lm and vLLM tie the output head to the input embedding when the config says
``tie_word_embeddings``; a stored ``lm_head.weight`` is then not what the model uses. A checkpoint saved with
its tied head written out (Gemma, some exporters) and the same model saved without it are the same model.

Which tensor is the tied head is decided before anything is compared (``TiedHead.decide``): the head stored on
one side only, which the comparison by name then leaves out. It is compared once, against what it derives from
(``TiedHead.compare``): where the side storing it ties its head, B's head against A's embedding (A's head as A's
client ties it), A's against its own embedding (what A's client uses instead), bit for bit, or within the
tolerance row where the dtypes differ; one that differs fails naming it even though nothing reads it (a tie
someone forgot to untie, or a head someone meant to keep). Where that side does not tie its head (or its client's
tie is unknown), the head is a tensor on one side only, listed so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..checks.diagnose import first_difference
from ..checks.outside import DIFFER, IDENTICAL, WITHIN, Derived, outside_tolerance
from ..tolerances import tolerance_for
from .quant import quantization, tensor_bits

if TYPE_CHECKING:
    from ..checks.outside import OutsideResult

HEAD = "lm_head.weight"
# Where the input embedding lives, per naming (its shape must be the head's too).
EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight",
              "model.embeddings.weight", "transformer.word_embeddings.weight", "gpt_neox.embed_in.weight",
              "model.tok_embeddings.weight", "tok_embeddings.weight", "backbone.embeddings.weight",
              "transformer.embedding.word_embeddings.weight", "model.word_embeddings.weight")


def embedding_of(ckpt, shape: tuple[int, ...] | None = None) -> str | None:
    """The name of ``ckpt``'s input embedding of ``shape`` (default: its own head's), or None."""
    shape = tuple(ckpt.info(HEAD).shape) if shape is None else shape
    return next((n for n in EMBEDDINGS if n in ckpt and tuple(ckpt.info(n).shape) == shape), None)


@dataclass(frozen=True)
class TiedHead:
    """The head one side stores and the other does not (``side``: "A" or "B"; None: no such head), decided
    before any comparison, compared once where that side's client ties it (see the module docstring)."""

    side: str | None = None

    @classmethod
    def decide(cls, outside: tuple[frozenset[str], frozenset[str]], taken: frozenset[str]) -> "TiedHead":
        """From A's and B's tensors ``outside`` the FFNs, those another transform derives left out (``taken``)."""
        if HEAD in taken or (HEAD in outside[0]) == (HEAD in outside[1]):
            return cls(None)
        return cls("A" if HEAD in outside[0] else "B")

    def left_out(self) -> frozenset[str]:
        return frozenset({HEAD}) if self.side else frozenset()

    def compare(self, outside: "OutsideResult", sides) -> list[str]:
        """The head against what it derives from, into ``outside`` (``sides``: ``expected.Sides``); returns
        notes."""
        if self.side is None:
            return []
        if not sides.ties[0 if self.side == "A" else 1]:  # a head of its own: on one side only
            only = outside.only_b if self.side == "B" else outside.only_a
            only[:] = sorted([*only, HEAD])
            return []
        d, emb = derived_head(self.side, sides.ca, sides.cb, sides.atol, sides.rtol)
        outside.add(d)
        if d.outcome == DIFFER:
            return []
        how = "bit-identical to" if d.outcome == IDENTICAL else "within tolerance of"
        return [f"{self.side} stores {HEAD}, {how} its {emb}{' as A stores it' * (self.side == 'B')}: under "
                "tie_word_embeddings its client ties them, so both sides use the embedding as the head"]


def derived_head(side: str, ca, cb, atol: float | None, rtol: float | None) -> tuple[Derived, str | None]:
    """``side``'s stored head against A's embedding (A's head as A's client ties it): bit for bit where their
    dtypes agree and neither is quantized, else within the tolerance row (of its quantization's bits); and the
    embedding's name (None: A has none of the head's shape)."""
    holder = ca if side == "A" else cb
    emb = embedding_of(ca, tuple(holder.info(HEAD).shape))
    untie = "its client ignores it and ties the head to the embedding; untie the config or drop the tensor"
    if emb is None:
        return Derived(HEAD, DIFFER, f"{HEAD}: {side} stores one under tie_word_embeddings and A has no embedding "
                                     f"of its shape {list(holder.info(HEAD).shape)} to derive it from: {untie}"), None
    bits = tensor_bits(holder, HEAD, None if holder.resolves_quantization else (quantization(holder) or {}).get("bits"))
    a, b = ca[emb], holder[HEAD]
    exact = bits is None and a.dtype == b.dtype
    why = (first_difference(HEAD, a, b) if exact
           else outside_tolerance(HEAD, a, b, tolerance_for([a.dtype, b.dtype], bits, atol=atol, rtol=rtol)))
    if why:
        return Derived(HEAD, DIFFER, f"{HEAD}: {side} stores one that differs from its embedding ({emb} as A "
                                     f"stores it) under tie_word_embeddings ({why}): {untie}"), emb
    return Derived(HEAD, IDENTICAL if exact else WITHIN), emb
