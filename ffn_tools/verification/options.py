"""What ``verify A B`` was asked, as one value (``VerifyOptions``); both sides as whole models (``Models``).

Torch-free: the CLI reads its defaults from here (``DEFAULT_TOKENS``) without importing the checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..checks.agreement import DEFAULT_PROFILE, PROFILES
from ..checks.prompts import NEW_TOKENS
from ..errors import FFNToolsError

if TYPE_CHECKING:
    from ..clients import Client
    from ..layouts import GateUpLayout
    from ..registry import Scheme

DEFAULT_TOKENS = 32  # rows of the seeded random input per FFN


@dataclass(frozen=True)
class VerifyOptions:
    """Every option of ``verify`` (``engine.verify``), one frozen value.

    Attributes:
        backends: kernel backends for B's FFN (default: the reference and B's runtime's kernels that run natively
            here, ``Client.kernels``; ``["all"]``: every one available here).
        tokens: rows of the seeded random input per FFN.
        seed: seed of the inputs (and of the logits token batch).
        layers, experts: selections like ``0-3,7`` (None: all; ``experts`` keeps dense and shared FFNs).
        atol, rtol: override the tolerance table (see ``tolerances``).
        exact: True: demand bit-identical canonical tensors; False: skip; None: where both sides should
            be lossless copies (same dtype, neither quantized).
        logits: also compare whole-model logits through transformers / mlx_lm.
        scheme, layout: naming scheme and fused gate/up layout, for both checkpoints (detected / the
            scheme's by default).
        b_layout: B's fused gate/up layout, when it differs from A's: then ``layout`` applies to A only
            (None: B's is ``layout`` too).
        allow_unmatched: tensors that look like FFN projections but belong to no FFN found are a note,
            not a failure (they are never run as FFNs).
        ffn_only: compare the FFNs only; by default every tensor outside them is compared too
            (``outside``).
        load_check: check that B would load in its real client (``loadable``): every parameter provided,
            nothing left over, shapes equal.
        allow_config: config keys whose difference is accepted on purpose (``model_config``); every other
            difference in what the clients read fails.
        client: the runtime that judges B, one its format lists (None: its first; ``--client``,
            ``clients.runtime``).
        unbounded: fail a setting the clients run otherwise only past a sequence length (a sliding window one
            applies and the other not); by default it passes, the verdict saying up to which length.
        side_files: compare tokenizer, generation_config and the other side files (``side_files``).
        all_ffns_on_every_backend: run every FFN on every backend; by default every FFN runs on the float64
            reference and the other backends run the first FFN of each kind (shape, form, layout, dtype,
            quantization, biases): what proves the kernels, at a fraction of the time on a large model.
        generate: also run both models on prompts through their clients, token by token against a measured
            noise floor (``generate``); ``prompts``: a file of prompts (None: the built-in set), ``new_tokens``
            greedy tokens per prompt, ``profile`` how far above its floor a statistic may be
            (``checks.agreement.PROFILES``).
        ray, ledger: how it runs, not what it finds (the API sets them; see below).
    """

    backends: Sequence[str] | None = None
    tokens: int = DEFAULT_TOKENS
    seed: int = 0
    layers: str | None = None
    experts: str | None = None
    atol: float | None = None
    rtol: float | None = None
    exact: bool | None = None
    logits: bool = False
    scheme: "Scheme | None" = None
    layout: "GateUpLayout | None" = None
    b_layout: "GateUpLayout | None" = None
    allow_unmatched: bool = False
    ffn_only: bool = False
    load_check: bool = True
    allow_config: Sequence[str] = ()
    side_files: bool = True
    all_ffns_on_every_backend: bool = False
    generate: bool = False
    prompts: str | None = None
    new_tokens: int = NEW_TOKENS
    profile: str = DEFAULT_PROFILE
    unbounded: bool | None = False
    client: str | None = None
    # how it runs, not what it finds (the api sets them): --ray's connection (``cluster.Link``) or None, and the
    # steps' ledger (``ledger.StepLedger``: this verify's key, and whether --resume was asked) or None
    ray: Any = None
    ledger: tuple[str, bool] | None = None

    def refuse_bad(self) -> None:
        """Refuse values no check can run with, before any work.

        Raises:
            FFNToolsError: naming the option.
        """
        if self.tokens < 1:
            raise FFNToolsError(f"--tokens {self.tokens}: need at least 1 token")
        if self.profile not in PROFILES:
            raise FFNToolsError(f"--profile {self.profile!r}: use one of {', '.join(PROFILES)}")
        if self.new_tokens < 1:
            raise FFNToolsError(f"--new-tokens {self.new_tokens}: need at least 1 token")

    @property
    def whole_models(self) -> bool:
        """A check that runs both whole models through their clients is asked (--logits, --generate)."""
        return self.logits or self.generate


@dataclass(frozen=True)
class Models:
    """Both sides as whole models (``--logits``, ``--generate``): their paths, their checkpoints open, the clients
    that run them (A's, B's), and ``convert``: the format registry's conversion (``converters.convert``, which
    the API passes), that re-derives B's form from A for --generate's noise floor; None: no floor is measured."""

    paths: tuple[Any, Any]
    ckpts: tuple[Any, Any]
    clients: "tuple[Client, Client]"
    convert: Callable[..., Any] | None = None
