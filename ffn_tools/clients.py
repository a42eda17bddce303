"""The one interface every runtime client implements: what a runtime (transformers, mlx_lm, llama.cpp) does with
a checkpoint, as ``verify`` asks it.

``verify`` compares A and B as their clients will run them and asks B's client, never which format B is: would B
load (``load_check``), what B's client computes from B's config against what A's side computes from A's
(``compare_config``, ``differences``), B's side files and tokenizer as B's client reads them
(``compare_side_files``, ``compare_tokenization``), A seen through the transforms B's client applies when it loads a
model (``pairing``: mlx_lm's sanitize), the tensors B stores in another form (``stored_otherwise``: llama.cpp's
norms plus one), whole-model logits (``logits``) and prompts run as the client runs them: its tokenizer and chat
template, its greedy decoding, where it stops (``generate``).

A format names the runtimes that load it (``Format.runtimes``, the default first) and ``runtime(fmt, name)``
gives one's client (``verify --client NAME``). No hook defaults to another runtime's answer: a question a runtime
does not answer is "not applicable for <runtime>" (``NotApplicable``), never a pass (see ``Client``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from .checks import Check
from .checks.config import ConfigResult, compare_configs, note_unused, transformers_view
from .checks.load import LoadCheck
from .checks.semantics import Runs, differences, transformers_model_runs, transformers_runs
from .checks.side_files import SideFilesResult, compare_side_files
from .errors import FFNToolsError
from .generation import Generation
from .pairing import Pairing

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .checks.outside import Derived, OutsideResult
    from .checks.tokens import TokenizationResult

C = TypeVar("C", bound=Check)


class NotApplicable(FFNToolsError):
    """A question a runtime has no answer to (its client does not implement that hook): the caller reports
    "not applicable for <runtime>", never a pass and never another runtime's answer. Raised by ``Client``'s
    hooks that a runtime may leave unanswered; an FFNToolsError, so a caller that does not expect it stops
    with this message rather than passing.

    Attributes:
        runtime: the client's name.
        what: the question, as reports name it ("the settings it runs", "side files").
    """

    def __init__(self, runtime: str, what: str):
        self.runtime, self.what = runtime, what
        super().__init__(f"{what}: not applicable for {runtime}")


class Client(ABC):
    """A runtime that loads checkpoints (see the module docstring).

    Every hook is one of three kinds, so that no runtime answers with another's semantics by default:

    - abstract, answered by every runtime: ``load_check``;
    - answered where the runtime can, else "not applicable for <runtime>" (the default): ``compare_config``,
      ``compare_side_files``, ``compare_tokenization`` (a check result ``skipped`` so, which the report names as
      not compared), ``runs`` and ``load_warning`` (``NotApplicable``, which their callers report as such),
      ``ready_for_logits``, ``logits``, ``masked_logits``, ``expert_saliency`` and ``generate``
      (``NotApplicable``: an FFNToolsError verify reports as not run);
    - declared neutral, where the default is no transform of the runtime's own, so that a runtime that does not
      say otherwise can only make verify stricter, never pass what it would fail: ``pairing`` (A as stored),
      ``stored_otherwise`` and ``compare_stored_otherwise`` (every tensor as read), ``config_of`` (the view's config),
      ``runs_of`` (``runs`` of that), ``hint`` (no advice), ``runs_instead`` (no other dtype), and the attributes.

    Attributes:
        name: as reports name it ("transformers", "mlx_lm", "llama.cpp").
        precision: the FFN activation (as the kernels name it) -> the dtype this client computes it in, where
            coarser than float32 (llama.cpp's GELU through a float16 table): the logits' tolerance floor.
        tokenizes: it tokenizes with code and data of its own, not the tokenizer files compared as side files
            (llama.cpp from a GGUF's vocabulary): ``compare_tokenization`` runs texts through both.
        kernels: the kernel backends (``ffn_tools.kernels``) of this runtime: what verify runs B's FFNs on by
            default beside the float64 reference (transformers on CUDA: Triton; mlx_lm: MLX, Metal).
    """

    name: ClassVar[str]
    precision: ClassVar[dict[str, str]] = {}
    tokenizes: ClassVar[bool] = False
    kernels: tuple[str, ...] = ()

    @property
    def runtime(self) -> str:
        """The code that computes the model (``runs``): a client running another format's weights in transformers'
        classes (Flax, DCP, Orbax) runs as transformers does, so no setting differs between them."""
        return self.name

    def not_applicable(self, what: str) -> NotApplicable:
        """The error this runtime's unanswered hook ``what`` raises."""
        return NotApplicable(self.name, what)

    def unanswered(self, result: type[C], what: str) -> C:
        """A ``result`` check of question ``what`` this runtime has no answer to: skipped, saying so
        (``NotApplicable``'s words), and flagged ``not_applicable`` (verify's verdict is then incomplete)."""
        return result(skipped=str(self.not_applicable(what)), not_applicable=True)

    @abstractmethod
    def load_check(self, ckpt) -> LoadCheck:
        """Whether the client would load ``ckpt`` (as stored): every parameter provided, nothing left over.

        Raises:
            MissingClient: the client is not installed here.
        """

    def load_warning(self, ckpt, plan, out: str | None = None) -> str | None:
        """One line when the output of ``plan`` (split or fuse of ``ckpt``) would not load in this client under the
        config.json it carries; None when it loads or nothing tells (no config to build the model from).

        Raises:
            MissingClient: this client is not installed here.
            NotApplicable: this runtime has no load check of a planned output (the default).
        """
        raise self.not_applicable("the load check of a planned output")

    def compare_config(self, ca, cb, allow=()) -> ConfigResult:
        """A's config as A's side computes it against B's as this client (B's) computes it, key by key; and where
        A's client is another, the settings the two clients run otherwise from the same keys (``runs``). A client
        that reads config.json answers with ``compare_config_json``; the default: not compared, not applicable."""
        return self.unanswered(ConfigResult, "the config as this runtime reads it")

    def config_of(self, ckpt) -> dict:
        """The config this client reads for ``ckpt`` (its config.json, as the view presents it)."""
        return ckpt.config or {}

    def runs_of(self, ckpt) -> dict[str, Runs]:
        """How this client runs the checkpoint ``ckpt`` as stored: its config read as the client's own code reads
        it, nothing filled in (the default: ``runs`` of ``config_of``)."""
        return self.runs(self.config_of(ckpt))

    def runs(self, config: dict) -> dict[str, Runs]:
        """How this client runs the settings clients read differently (``checks.semantics``), from ``config``.

        Raises:
            NotApplicable: this runtime does not say (the default); its callers say the settings were not compared.
        """
        raise self.not_applicable("the settings this runtime runs from a config")

    def compare_side_files(self, ca, cb) -> SideFilesResult:
        """A's side files (tokenizer, generation config, ...) against B's, as this client reads B's; the default:
        not compared, not applicable."""
        return self.unanswered(SideFilesResult, "the side files as this runtime reads them")

    def compare_tokenization(self, ca, cb) -> "TokenizationResult":
        """Texts through A's tokenizer and through B's as this client tokenizes (asked only where ``tokenizes``);
        the default: not compared, not applicable."""
        from .checks.tokens import TokenizationResult

        return self.unanswered(TokenizationResult, "tokenization by this runtime's own tokenizer")

    def pairing(self, ca, cb) -> Pairing | None:
        """A as this client loads it (None, the default: as stored)."""
        return None

    def stored_otherwise(self, cb) -> frozenset[str]:
        """B's tensors this client stores in another form than read (compared by ``compare_stored_otherwise``); the
        default: none."""
        return frozenset()

    def compare_stored_otherwise(self, outside: "OutsideResult", ca, cb, atol, rtol) -> list[str]:
        """Compare ``stored_otherwise``'s tensors with A's, into ``outside``; returns notes."""
        return []

    def ready_for_logits(self, ckpt, side: str) -> None:
        """Refuse ``--logits`` where this client cannot run ``ckpt`` as a whole model here.

        Raises:
            FFNToolsError: naming why (no client, a single file, the client not installed).
            NotApplicable: this runtime runs no whole model here (the default).
        """
        raise self.not_applicable(f"--logits of {side} ({ckpt.path}) as a whole model")

    def hint(self, error: str) -> str:
        """What to add to this client's own ``error`` running logits here (how to make it run), or ""."""
        return ""

    def runs_instead(self, error: str) -> str | None:
        """The float dtype this client can compute in where it could not in the weights' own (its ``error``
        running logits says so), or None."""
        return None

    def logits(self, path: Path, tokens: "torch.Tensor", dtype: str | None = None) -> tuple["torch.Tensor", list[str]]:
        """The client's logits of ``tokens`` (float64), computed in float dtype ``dtype`` where the client can
        (None: its weights'), and what went wrong loading the model (a list of lines: weights missing or left
        over); the client's own errors raise.

        Raises:
            NotApplicable: this runtime runs no logits here (the default).
        """
        raise self.not_applicable("whole-model logits")

    def masked_logits(self, path: Path, tokens: "torch.Tensor", dtype: str | None, dropped: dict[int, tuple[int, ...]],
                      ungrouped: bool = False) -> tuple["torch.Tensor", list[str], dict[int, float], dict[int, dict]]:
        """``logits`` with each MoE layer's experts ``dropped`` (layer -> expert indices) masked out of the routing
        (router logits -inf; a sigmoid router's selection score), in one expert group where ``ungrouped``; and
        each masked layer's routing mass lost: the share of the top-k routing weight its router, unmasked, gives
        the dropped experts, mean over the tokens (``verify --logits`` of a pruned B: ``expert_map.masking``);
        and each masked layer's share of A's own (unmasked) router probability on the dropped
        experts, ``{"mean", "max"}`` over the tokens (``verify``'s routing mass B dropped, information only).

        Raises:
            NotApplicable: this runtime masks no experts here (the default).
        """
        raise self.not_applicable("whole-model logits with experts masked")

    def expert_saliency(self, path: Path, texts: list[str], max_tokens: int
                        ) -> tuple[int, dict[int, tuple[list[float], list[int]]]]:
        """``ffn-tools saliency`` (``surgery.saliency``): the model run on ``texts`` (each cut to ``max_tokens``
        tokens), and the tokens run and each MoE layer's per-expert sums (router weight x the norm of the expert's
        own output, over the tokens routed to it; the count of those tokens).

        Raises:
            NotApplicable: this runtime scores no experts here (the default).
        """
        raise self.not_applicable("expert saliency")

    def generate(self, path: Path, prompts: list[str], new_tokens: int, score: list[list[int]] | None = None,
                 dtype: str | None = None) -> Generation:
        """The model at ``path`` run on ``prompts`` as this client runs them: tokenized by its tokenizer (in its
        chat template where it has one), continued greedily by up to ``new_tokens`` tokens until it generates a
        token it stops at, and every position's logits of the result in one pass; or, with ``score``, those
        sequences' logits instead of its own continuations (the prompts are still tokenized: what it would run).
        ``dtype``: the float dtype to compute in where the client can (None: its weights').

        Raises:
            FFNToolsError: this client runs no model here.
            NotApplicable: this runtime runs no prompts here (the default).
        """
        raise self.not_applicable("prompts run (--generate)")

    def activations(self, path: Path, sequences: list[list[int]], dtype: str | None = None) -> dict[str, "np.ndarray"]:
        """The model at ``path`` run on ``sequences`` (token ids), each part's activations kept (``verify --locate``:
        ``verification.locate`` names the keys), computed in float dtype ``dtype`` where the client can.

        Raises:
            NotApplicable: this runtime exposes no activations (the default).
        """
        raise self.not_applicable("activations (--locate)")

    def anchor(self, a: Path, recipe: dict, out: Path, like: Path | None = None) -> str | None:
        """B's form (``recipe``: ``Format.recipe``'s convert options) re-derived from the Hugging Face model ``a`` by
        another tool than ffn-tools where this runtime's is installed (``verify --locate``'s independent floor),
        written to ``out``: how, in words; None where there is none here (the default). ``like``: ffn-tools' own
        derivation, whose configuration stands in for settings the tool drops (said in the words)."""
        return None

    def __repr__(self) -> str:
        return f"<client {self.name}>"


def compare_config_json(client: Client, ca, cb, allow=(), further: Callable[[ConfigResult], None] | None = None
                        ) -> ConfigResult:
    """``compare_config`` of a client that reads config.json: A's against B's key by key, normalized as
    transformers' config classes normalize them (``checks.config.compare_configs``); ``further(res)``: what
    ``client`` reads beyond them (transformers: the dtype against the stored weights; mlx_lm: its ModelArgs),
    added to the result; and where A's client is another runtime, each setting the two run otherwise
    (``compare_runs``)."""
    res, readings = compare_configs(ca, cb, allow)
    if readings is not None:
        if further is not None:
            further(res)
        compare_runs(client, res, ca, cb, set(allow))
    note_unused(res, allow)
    return res


def compare_runs(client: Client, res: ConfigResult, ca, cb, allow: set) -> None:
    """Into ``res``: each setting A's client (its format's default runtime) runs otherwise than ``client`` runs
    B's (``semantics``); one that shows only past a sequence length into ``res.bounded``. A runtime that does not
    say how it runs them (``NotApplicable``) is said in a note, and nothing is compared."""
    theirs = runtime(ca.format) if ca.format is not None else None
    if theirs is None or theirs.runtime == client.runtime:
        return
    try:
        found = differences(theirs.runs_of(ca), client.runs_of(cb), f"A's client ({theirs.name})",
                            f"B's client ({client.name})", config=ca.config or {}, ckpt=ca)
    except NotApplicable as e:
        res.notes.append(f"the settings A's client ({theirs.name}) and B's ({client.name}) run otherwise were not "
                         f"compared: {e}")
        return
    for d in found:
        if d.key not in allow and d.tokens is not None:  # the same function up to a sequence length
            res.bounded.append({"key": d.key, "tokens": d.tokens, "line": d.line})
        else:
            (res.allowed if d.key in allow else res.problems).append(d.line)


def transformers_reads(config: dict) -> dict[str, Runs]:
    """How transformers' config classes and modeling code run ``config``'s settings (``checks.semantics``): the
    ``runs`` of clients whose model runs in transformers."""
    normalized, _ = transformers_view(config)
    return {**transformers_runs(normalized if normalized is not None else config), **transformers_model_runs(config)}


class NoClient(Client):
    """A format no runtime here loads (Flax after transformers 5, Meta's and Mistral's own code): the load check
    and logits say they did not run; configs and side files are compared as written, the config as transformers
    reads it (the view's config is Hugging Face's: what ``convert --to torch`` hands transformers)."""

    name = "none"

    def __init__(self, label: str, why: str, kernels: tuple[str, ...] = ()):
        self.label, self.why, self.kernels = label, why, kernels

    def load_check(self, ckpt) -> LoadCheck:
        return LoadCheck(self.label, skipped=self.why)

    def compare_config(self, ca, cb, allow=()) -> ConfigResult:
        return compare_config_json(self, ca, cb, allow)

    def runs(self, config: dict) -> dict[str, Runs]:
        return transformers_reads(config)

    def compare_side_files(self, ca, cb) -> SideFilesResult:
        return compare_side_files(Path(ca.root), Path(cb.root), cb.config)

    def ready_for_logits(self, ckpt, side: str) -> None:
        raise FFNToolsError(f"--logits: {side} ({ckpt.path}) is {ckpt.described} checkpoint; no client here runs "
                            "it as a whole model")


class Loaded(Protocol):
    """What ``runtime`` asks of a format (``formats.Format`` answers it; this module sits below the formats)."""

    @property
    def name(self) -> str: ...

    @property
    def runtimes(self) -> tuple[str, ...]: ...

    @property
    def unloaded(self) -> str: ...

    def load_runtime(self, name: str) -> Client: ...


def runtime(fmt: Loaded, name: str | None = None) -> Client:
    """The client of the runtime ``name`` among those that load ``fmt`` (``Format.runtimes``; None: the first,
    the default); a ``NoClient`` saying why where no runtime here loads the format.

    Raises:
        FFNToolsError: ``name`` is not one of the format's runtimes (naming them), or the format builds another
            runtime's client for it.
    """
    if name is None and not fmt.runtimes:
        return NoClient(fmt.name, fmt.unloaded or f"no runtime here loads {fmt.name} checkpoints")
    if name is not None and name not in fmt.runtimes:
        others = "".join(f", {r}" for r in fmt.runtimes[1:])
        have = (f"the runtimes that load them: {fmt.runtimes[0]} (the default){others}" if fmt.runtimes else
                f"no runtime here loads them{f' ({fmt.unloaded})' if fmt.unloaded else ''}")
        raise FFNToolsError(f"runtime {name!r} (--client) does not load {fmt.name} checkpoints here; {have}")
    picked = name or fmt.runtimes[0]
    client = fmt.load_runtime(picked)
    if client.runtime != picked:  # a declaration that builds another runtime than it names: never judged by it
        raise FFNToolsError(f"the {fmt.name} format's load_runtime({picked!r}) built {client!r}, whose runtime is "
                            f"{client.runtime}: its runtimes and load_runtime disagree")
    return client
