"""Tied embeddings in ``verify``: an ``lm_head.weight`` stored on one side only, under a tie.

transformers, mlx_lm and vLLM tie the output head to the input embedding when the config says
``tie_word_embeddings``; a stored ``lm_head.weight`` is then not what the model uses. A checkpoint saved with
its tied head written out (Gemma, some exporters) and the same model saved without it are the same model: the
head on one side only passes, with a note, when it equals that side's embedding. One that differs is a failure
even though nothing reads it: a tie someone forgot to untie, or a head someone meant to keep.
"""

from __future__ import annotations

HEAD = "lm_head.weight"
# Where the input embedding lives, per naming (its shape must be the head's too).
EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight",
              "model.embeddings.weight", "transformer.word_embeddings.weight", "gpt_neox.embed_in.weight",
              "model.tok_embeddings.weight", "tok_embeddings.weight", "backbone.embeddings.weight",
              "transformer.embedding.word_embeddings.weight", "model.word_embeddings.weight")


def embedding_of(ckpt) -> str | None:
    """The name of ``ckpt``'s input embedding of the head's shape, or None."""
    shape = tuple(ckpt.info(HEAD).shape)
    return next((n for n in EMBEDDINGS if n in ckpt and tuple(ckpt.info(n).shape) == shape), None)


def reconcile(outside, ca, cb, ties: tuple[bool | None, bool | None]) -> list[str]:
    """Settle ``lm_head.weight`` listed on one side only where that side ties its head; returns notes.

    Args:
        outside: the ``OutsideResult`` (its ``only_a``/``only_b``/``differ`` are updated).
        ca, cb: the checkpoints.
        ties: each side's ``tie_word_embeddings`` as its client reads it (None: unknown).
    """
    import torch

    notes = []
    for side, ckpt, only, tied in (("A", ca, outside.only_a, ties[0]), ("B", cb, outside.only_b, ties[1])):
        if HEAD not in only or not tied:
            continue
        only.remove(HEAD)
        emb = embedding_of(ckpt)
        if emb is not None and torch.equal(ckpt[HEAD], ckpt[emb]):
            notes.append(f"{side} stores {HEAD}, bit-identical to its {emb}: under tie_word_embeddings its client "
                         "ties them, so both sides use the embedding as the head")
        else:
            outside.differ.append(f"{HEAD}: {side} stores one that differs from its embedding "
                                  f"({emb or 'not found'}) under tie_word_embeddings: its client ignores it and "
                                  "ties the head to the embedding; untie the config or drop the tensor")
    return notes
