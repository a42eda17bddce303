"""What ``verify A B`` was asked, as one value (``VerifyOptions``); both sides as whole models (``Models``).

Torch-free: the CLI reads its defaults from here (``DEFAULT_TOKENS``) without importing the checks.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """Every option of ``verify`` (``engine.verify`` documents each). ``client``: the runtime that judges B (None:
    its format's first, ``Format.client``)."""

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
    """Both sides as whole models (``--logits``, ``--generate``): their paths, their checkpoints open, and the
    clients that run them (A's, B's)."""

    paths: tuple[Any, Any]
    ckpts: tuple[Any, Any]
    clients: "tuple[Client, Client]"
