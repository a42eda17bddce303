"""Activations of an mlx_lm model (``verify --locate``): its decoder layers' parts wrapped in taps that keep what
they compute, read by their module names as mlx_lm's model classes name them (the keys
``ffn_tools.verification.locate`` names).

mlx_lm's MoE blocks weight their routed experts' outputs inside the block's own call (``SwitchGLU`` gives each
chosen expert's output, not their combination), so the routed experts' combined output is not a part here: the
report says mlx_lm gives no such part, and the block's output (``ffn``) holds it with the shared expert's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ATTN_NORMS = ("input_layernorm", "attention_norm")
ATTENTIONS = ("self_attn", "attention")
FFN_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm", "ffn_norm")
FFNS = ("mlp", "block_sparse_moe", "feed_forward")
ROUTERS = ("gate", "router")
ROUTED = ("switch_mlp", "experts")
SHARED = ("shared_expert", "shared_experts")


def _tap_class():
    import mlx.core as mx
    import mlx.nn as nn

    class Tap(nn.Module):
        """``inner`` called as it was, its output (or, ``before``, its first input) kept under ``key``."""

        def __init__(self, inner, key: str, got: dict, before: bool = False, top_k: int | None = None):
            super().__init__()
            self.inner = inner
            for name, value in (("_key", key), ("_got", got), ("_before", before), ("_top_k", top_k)):
                object.__setattr__(self, name, value)  # not parameters: kept out of the module's tree

        def __getattr__(self, name: str):  # what else the model asks of the part (a tied head: as_linear)
            try:
                return super().__getattr__(name)
            except AttributeError:
                inner = dict.get(self, "inner")
                if inner is None:
                    raise
                return getattr(inner, name)

        def __call__(self, *args, **kwargs):
            out = self.inner(*args, **kwargs)
            if self._top_k and isinstance(out, tuple):  # a router that gives its choice (DeepSeek's: ids, scores)
                ids = next(t for t in out if mx.issubdtype(t.dtype, mx.integer))
                self._keep("topk", np.sort(np.array(ids).reshape(-1, ids.shape[-1]), -1).astype(np.int64))
                return out  # its logits stay inside it: no such part
            t = args[0] if self._before else (out[0] if isinstance(out, tuple) else out)
            self._got.setdefault(self._key, []).append(np.array(t.astype(mx.float32)).reshape(-1, t.shape[-1]))
            if self._top_k:  # a router giving logits: the experts they choose
                probs = mx.softmax(t.astype(mx.float32), axis=-1)
                chosen = mx.argpartition(-probs, kth=self._top_k - 1, axis=-1)[..., : self._top_k]
                self._keep("topk", np.sort(np.array(chosen).reshape(-1, self._top_k), -1).astype(np.int64))
            return out

        def _keep(self, part: str, value: np.ndarray) -> None:
            self._got.setdefault(self._key[: -len("router")] + part, []).append(value)

    return Tap


def _first(module, names: tuple[str, ...]) -> str | None:
    import mlx.nn as nn

    return next((n for n in names if isinstance(module.get(n) if isinstance(module, dict) else None, nn.Module)), None)


def capture(path: Path, sequences: list[list[int]], dtype: str | None) -> dict[str, np.ndarray]:
    """The MLX model at ``path`` (``mlx_lm``'s ``load_model``) run on each of ``sequences`` with its parts tapped: key ->
    float32 (positions, features); ``L<i>.topk`` the sorted top-k expert ids its router's logits choose."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    Tap = _tap_class()
    base = model.model if isinstance(model.get("model"), dict) else model
    got: dict[str, list[np.ndarray]] = {}
    args = getattr(model, "args", None)
    top_k = getattr(args, "num_experts_per_tok", None)

    def tap(module, name: str | None, key: str, **kw) -> None:
        if name is not None:
            setattr(module, name, Tap(module[name], key, got, **kw))

    tap(base, "embed_tokens" if "embed_tokens" in base else None, "embed")
    for i, layer in enumerate(base.layers):
        p = f"L{i}."
        tap(layer, _first(layer, ATTN_NORMS), p + "attn_norm")
        tap(layer, _first(layer, ATTENTIONS), p + "attn")
        if (n := _first(layer, FFN_NORMS)) is not None:
            inner = layer[n]
            setattr(layer, n, Tap(Tap(inner, p + "ffn_norm", got), p + "after_attn", got, before=True))
        if (f := _first(layer, FFNS)) is not None:
            ffn = layer[f]
            if _first(ffn, ROUTED) is not None:
                tap(ffn, _first(ffn, ROUTERS), p + "router", top_k=top_k)
            tap(ffn, _first(ffn, SHARED), p + "shared")
            tap(layer, f, p + "ffn")
        layers = base.layers
        layers[i] = Tap(layer, p + "hidden", got)
    tap(base, "norm" if "norm" in base else None, "final_norm")
    for seq in sequences:
        out = model(mx.array([seq]))
        got.setdefault("logits", []).append(np.array(out.astype(mx.float32)).reshape(-1, out.shape[-1]))
    return {k: np.concatenate(v) for k, v in got.items()}
