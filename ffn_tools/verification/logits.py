"""``verify --logits``: both whole models through their real clients on one fixed token batch.

PyTorch checkpoint directories load with transformers' ``AutoModelForCausalLM.from_pretrained`` (dtype
from config.json); MLX directories with mlx_lm (``mlx_lm.utils.load_model``: the model without needing
tokenizer files). A checkpoint a client loads only partly (weights missing, unused or of the wrong shape,
which transformers would fill with random values) fails rather than being compared. The metrics are those
of the FFN check (max |b - a|, cosine, the tolerance ratio) plus top-1 agreement, which is reported; the
verdict uses the tolerance row widened for whole models (``tolerances.widened``), and no finer than the
precision a client computes in where it computes below the weights' (``CLIENT_PRECISION``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, cast

import torch

from ..errors import FFNToolsError
from ..io.store import Format
from ..tolerances import DTYPE_TOLERANCES, Tolerance
from .functional import compare

log = logging.getLogger(__name__)

BATCH = (2, 16)  # (sequences, tokens)
CLIENTS = {"transformers": "transformers AutoModelForCausalLM", "mlx_lm": "mlx_lm", "llama.cpp": "llama-cpp-python"}
# (client, the FFN's activation as the kernels name it) -> the dtype the client computes it in, where coarser
# than float32: llama.cpp's CPU backend computes GELU (erf and tanh) through a float16 table (ggml-cpu's
# GGML_GELU_FP16: input and output rounded to float16), so its logits of a float32 Gemma differ from
# transformers' by float16 roundings (measured: 2.8e-4 on the tiny Gemma 2, 1.7e-5 with transformers' GELU
# rounded so too).
CLIENT_PRECISION = {("llama.cpp", "gelu"): "float16", ("llama.cpp", "gelu_tanh"): "float16"}


def client_floor(tol: Tolerance, clients: tuple[str, str], function: str | None) -> tuple[Tolerance, str | None]:
    """``tol``, or the row of the dtype a client computes the FFN's activation ``function`` in where that is
    coarser (``CLIENT_PRECISION``), with a note saying why."""
    for client in dict.fromkeys(clients):
        dtype = CLIENT_PRECISION.get((client, function or ""))
        floor = DTYPE_TOLERANCES.get(dtype or "")
        if floor is not None and floor.atol > tol.atol:
            row = Tolerance(max(tol.atol, floor.atol), max(tol.rtol, floor.rtol),
                            min(tol.min_cosine, floor.min_cosine), f"{tol.row}, {client}'s {function} in {dtype}")
            return (row,
                    f"logits: {client} computes the FFN's {function} in {dtype} (a lookup table), so the logits are "
                    f"compared within the {dtype} row")
    return tol, None


def client_for(ckpt, side: str) -> str:
    """Which client loads ``ckpt`` as a whole model.

    Raises:
        FFNToolsError: neither does (a Flax checkpoint, an FFN-only extract, a single file, no config).
    """
    path = Path(ckpt.path)
    cfg = ckpt.config or {}
    if ckpt.format is Format.GGUF:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as e:
            raise FFNToolsError(f"--logits: {side} is a GGUF and llama-cpp-python is not installed ({e}): "
                                "pip install 'ffn-tools[gguf]'") from None
        return "llama.cpp"
    if not path.is_dir() or "model_type" not in cfg:
        raise FFNToolsError(f"--logits: {side} ({path}) is not a model directory with a config.json naming its "
                            "model_type; whole-model logits need a directory transformers or mlx_lm can load")
    if ckpt.format is Format.MLX:
        try:
            import mlx_lm  # noqa: F401
        except ImportError as e:
            raise FFNToolsError(f"--logits: {side} is an MLX checkpoint and mlx_lm is not installed ({e})") from None
        return "mlx_lm"
    if ckpt.format.pytorch:
        return "transformers"
    raise FFNToolsError(f"--logits: {side} ({path}) is a {ckpt.format} checkpoint; no client here runs it as a "
                        "whole model (transformers reads PyTorch, mlx_lm reads MLX)")


def token_batch(vocab_size: int, seed: int, length: int | None = None) -> torch.Tensor:
    """The fixed (2, 16) batch of token ids, seeded (``length`` tokens per sequence instead of 16)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (BATCH[0], length or BATCH[1]), generator=gen)


def _transformers_logits(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # loading problems are reported below, as failures
    hf_logging.disable_progress_bar()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype="auto", output_loading_info=True)
    model, info = cast("tuple[Any, dict]", loaded)  # transformers types the model alone; the flag adds the dict
    problems = [f"transformers: {what} {_clip(info.get(key) or [])}"
                for key, what in (("missing_keys", "initialised weights the checkpoint lacks:"),
                                  ("unexpected_keys", "ignored weights it does not know:"),
                                  ("mismatched_keys", "re-initialised weights of the wrong shape:"))
                if info.get(key)]
    with torch.no_grad():
        return model.eval()(tokens).logits.to(torch.float64), problems


def _mlx_logits(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(path)
    except ValueError as e:  # strict loading: missing or unexpected parameters
        return torch.empty(0), [f"mlx_lm: {str(e).splitlines()[0][:300]}"]
    out = model(mx.array(tokens.numpy()))
    return torch.from_numpy(np.array(out.astype(mx.float32))).to(torch.float64), []


def _llama_cpp_logits(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """llama.cpp's logits of every position, one sequence at a time, its KV cache in float32 (its default f16
    cache would add its own rounding to what is compared); in a process of its own (``llama_cpp_run``)."""
    import json
    import tempfile

    import numpy as np

    from .llama_cpp_run import run

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "tokens.json").write_text(json.dumps(tokens.tolist()))
        run(str(path), str(Path(d) / "tokens.json"), str(Path(d) / "logits.npy"))
        return torch.from_numpy(np.load(Path(d) / "logits.npy")), []


def _run(fn, client: str, path: Path, side: str, tokens: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """One client's logits; a client that cannot run the model here is trouble, not a difference."""
    try:
        return fn(path, tokens)
    except Exception as e:  # the client's own errors: unknown model_type, ops missing on this device, ...
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        hint = ("; MLX's CPU backend runs these ops in float32 only: an export with --dtype float32 runs here"
                if client == "mlx_lm" and "float32" in first else "")
        raise FFNToolsError(f"--logits: {client} could not run {side} ({path}) here: {first}{hint}") from None


def _clip(items, n: int = 4) -> str:
    items = sorted(items)
    return ", ".join(items[:n]) + (f" ... ({len(items)} in all)" if len(items) > n else "")


def compare_logits(a, b, clients: tuple[str, str], tol: Tolerance, seed: int, vocab: list,
                   length: int | None = None) -> dict:
    """Logits of A and B on the same token batch, compared.

    Args:
        a, b: the checkpoints' paths.
        clients: the client of each (``client_for``).
        tol: the row; ``engine.EXACT`` where the same client runs bit-identical weights.
        seed: seed of the token batch.
        vocab: A's and B's vocabulary sizes (their configs').
        length: tokens per sequence (None: 16), to reach past a sliding window or a rope's original context.

    Returns:
        {client_a, client_b, shape, max_abs, cosine, ratio, top1_agreement, tolerance, passed, problems}.

    Raises:
        FFNToolsError: the two configs disagree on the vocabulary size.
    """
    if vocab[0] != vocab[1] or not isinstance(vocab[0], int):
        raise FFNToolsError(f"--logits: vocabulary sizes differ or are unknown (A {vocab[0]}, B {vocab[1]})")
    tokens = token_batch(vocab[0], seed, length)
    run = {"transformers": _transformers_logits, "mlx_lm": _mlx_logits, "llama.cpp": _llama_cpp_logits}
    (la, pa), (lb, pb) = (_run(run[c], c, Path(p), side, tokens) for c, p, side in zip(clients, (a, b), "AB"))
    problems = [f"A: {p}" for p in pa] + [f"B: {p}" for p in pb]
    out: dict = {"client_a": clients[0], "client_b": clients[1], "shape": list(tokens.shape) + [vocab[0]],
           "max_abs": math.nan, "cosine": math.nan, "ratio": math.nan, "top1_agreement": 0.0,
           "tolerance": tol.as_dict(), "problems": problems, "passed": False}
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
