"""``verify --logits``: both whole models through their real clients on one fixed token batch.

Each side runs in its own client (``Client.logits``: transformers' ``from_pretrained``, mlx_lm's
``load_model``, llama.cpp). A checkpoint a client loads only partly (weights missing, unused or of the wrong
shape, which transformers would fill with random values) fails rather than being compared. The metrics are
those of the FFN check (max |b - a|, cosine, the tolerance ratio) plus top-1 agreement, which is reported; the
verdict uses the tolerance row widened for whole models (``tolerances.widened``), and no finer than the
precision a client computes in where it computes below the weights' (``Client.precision``). Where B records an
expert mapping (``prune-experts``, ``reorder-experts``), A runs with the experts B dropped masked out of its
routing (``expert_map.masking``, ``Client.masked_logits``), each layer's routing mass lost reported.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from ..clients import Client, runtime
from ..errors import FFNToolsError
from ..tolerances import DTYPE_TOLERANCES, Tolerance, widened
from . import expert_map
from .functional import compare

log = logging.getLogger(__name__)

BATCH = (2, 16)  # (sequences, tokens)


def client_floor(tol: Tolerance, clients: tuple[Client, Client], function: str | None) -> tuple[Tolerance, str | None]:
    """``tol``, or the row of the dtype a client computes the FFN's activation ``function`` in where that is
    coarser (``Client.precision``), with a note saying why."""
    for client in {c.name: c for c in clients}.values():
        dtype = client.precision.get(function or "")
        floor = DTYPE_TOLERANCES.get(dtype or "")
        if floor is not None and floor.atol > tol.atol:
            row = Tolerance(max(tol.atol, floor.atol), max(tol.rtol, floor.rtol),
                            min(tol.min_cosine, floor.min_cosine), f"{tol.row}, {client.name}'s {function} in {dtype}")
            return (row,
                    f"logits: {client.name} computes the FFN's {function} in {dtype} (a lookup table), so the logits "
                    f"are compared within the {dtype} row")
    return tol, None


def client_for(ckpt, side: str, name: str | None = None) -> Client:
    """The client that runs ``ckpt`` as a whole model (runtime ``name`` of its format, None: its first;
    ``clients.runtime``), once it says it can here.

    Raises:
        FFNToolsError: none does (a Flax checkpoint, an FFN-only extract, a single file, no config, the client
            not installed).
    """
    if ckpt.format is None:
        raise FFNToolsError(f"--logits: {side} ({ckpt.path}) was opened without its format; no client is known")
    client = runtime(ckpt.format, name)
    client.ready_for_logits(ckpt, side)
    return client


def token_batch(vocab_size: int, seed: int, length: int | None = None) -> torch.Tensor:
    """The fixed (2, 16) batch of token ids, seeded (``length`` tokens per sequence instead of 16)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (BATCH[0], length or BATCH[1]), generator=gen)


def could_not_run(flag: str, client: Client, side: str, path: Path, e: Exception) -> tuple[str, str]:
    """A client's own error running a model (unknown model_type, ops missing on this device, ...) as the line
    saying so, without the client's hint, and the error's first line (with its last where the first ends in a
    colon: nanobind's "incompatible function arguments. The following argument types are supported:" says what
    it was given last, "Invoked with types: mlx.core.array, NoneType")."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else type(e).__name__
    if first.endswith(":") and len(lines) > 1:
        first = f"{first} ... {lines[-1]}"
    first = first[:300]
    return f"{flag}: {client.name} could not run {side} ({path}) here: {first}", first


def _run(client: Client, path: Path, side: str, tokens: torch.Tensor,
         dtype: str | None, masked=None) -> tuple[torch.Tensor, list[str]]:
    """One client's logits (run as ``masked``, an ``expert_map.Masking``, says for ``side``: its routing mass
    lost kept in ``masked.lost``); a client that cannot run the model here is trouble, not a difference."""
    try:
        if masked is not None and (masked.ungrouped or (side == "A" and masked.dropped)):
            la, problems, lost, mass = client.masked_logits(path, tokens, dtype, masked.dropped if side == "A" else {},
                                                            masked.ungrouped)
            masked.lost.update(lost if side == "A" else {})
            masked.mass.update(mass if side == "A" else {})
            return la, problems
        return client.logits(path, tokens, dtype)
    except Exception as e:
        line, first = could_not_run("--logits", client, side, path, e)
        raise FFNToolsError(line + client.hint(first)) from None


def compare_logits(a, b, clients: tuple[Client, Client], tol: Tolerance, seed: int, vocab: list,
                   length: int | None = None, dtype: str | None = None) -> dict:
    """Logits of A and B on the same token batch, compared.

    Args:
        a, b: the checkpoints' paths.
        clients: the client of each (``client_for``).
        tol: the row; ``engine.EXACT`` where the same client runs bit-identical weights.
        seed: seed of the token batch.
        vocab: A's and B's vocabulary sizes (their configs').
        length: tokens per sequence (None: 16), to reach past a sliding window or a rope's original context.
        dtype: the float dtype both clients compute in where they can (None: their weights').

    Returns:
        {client_a, client_b, shape, max_abs, cosine, ratio, top1_agreement, tolerance, passed, problems}.

    Raises:
        FFNToolsError: the two configs disagree on the vocabulary size.
    """
    if vocab[0] != vocab[1] or not isinstance(vocab[0], int):
        raise FFNToolsError(f"--logits: vocabulary sizes differ or are unknown (A {vocab[0]}, B {vocab[1]})")
    tokens = token_batch(vocab[0], seed, length)
    masked = expert_map.masking(a, b)  # B records an expert mapping: A run as it says
    if masked is not None and tol.atol == 0:  # bit-identical weights, but fewer or reordered router rows
        tol = widened(DTYPE_TOLERANCES[masked.row])
    (la, pa), (lb, pb) = (_run(c, Path(p), side, tokens, dtype, masked) for c, p, side in zip(clients, (a, b), "AB"))
    problems = [f"A: {p}" for p in pa] + [f"B: {p}" for p in pb]
    out: dict = {"client_a": clients[0].name, "client_b": clients[1].name, "shape": list(tokens.shape) + [vocab[0]],
           "max_abs": math.nan, "cosine": math.nan, "ratio": math.nan, "top1_agreement": 0.0,
           "tolerance": tol.as_dict(), "problems": problems, "passed": False}
    if masked is not None:
        out.update(client_a=f"{clients[0].name}, {masked.describe()}", masked=masked.as_dict())
    if la.shape != lb.shape or la.numel() == 0:
        problems.append(f"logits of shape {list(la.shape)} (A) and {list(lb.shape)} (B) cannot be compared")
        return out
    m = compare("logits", "", lb, la, tol)
    out.update(max_abs=m.max_abs, cosine=m.cosine, ratio=m.ratio,
               top1_agreement=float((la.argmax(-1) == lb.argmax(-1)).double().mean()))
    if not m.passed and tol.atol == 0:
        problems.append(f"the same client on bit-identical weights gives different logits (max abs difference "
                        f"{m.max_abs:.3g}, cosine {m.cosine:.7f}, top-1 agreement {out['top1_agreement']:.1%}): "
                        "what differs is the model its config describes")
    elif not m.passed:
        problems.append(f"max abs difference {m.max_abs:.3g} ({m.ratio:.2f}x the tolerance), cosine {m.cosine:.7f} "
                        f"(min {tol.min_cosine:.10g}); top-1 agreement {out['top1_agreement']:.1%}")
    out["passed"] = not problems
    for k in ("max_abs", "cosine", "ratio"):
        out[k] = None if not math.isfinite(out[k]) else out[k]
    return out
