"""What ``verify`` compares beyond the weights, asked of B's client (``Client``): the configs as the clients read
them, the side files, the texts through both tokenizers; and whole-model logits through both clients."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..checks.config import ConfigResult
from ..checks.side_files import SideFilesResult
from ..checks.tokens import TokenizationResult
from ..clients import Client
from ..tolerances import Tolerance, tolerance_for, widened
from .report import VerifyReport
from .options import Models, VerifyOptions

EXACT = Tolerance(0.0, 0.0, 0.0, "exact: bit-identical weights under the same client")  # atol 0: every logit equal
PROBE_MAX = 512  # longest token batch run to reach a config's window (tiny models only)
PROBE_BYTES = 1 << 30


def model_checks(client: Client, ca, cb, extract: str | None, allow_config: Sequence[str],
                 side_files: bool) -> tuple[ConfigResult, SideFilesResult, TokenizationResult | None]:
    """The configs as their clients read them, and the side files (what is not weights), as B's ``client``
    compares them; where B's client tokenizes with data of its own (``Client.tokenizes``: llama.cpp from a
    GGUF's vocabulary), texts through both tokenizers (else None). ``extract``: why there is no model to
    compare (an FFN-only extract output)."""
    config = ConfigResult(skipped=extract) if extract else client.compare_config(ca, cb, allow_config)
    skip = "--no-side-files" if not side_files else extract
    side = SideFilesResult(skipped=skip) if skip else client.compare_side_files(ca, cb)
    tokens = None
    if client.tokenizes:
        tokens = TokenizationResult(skipped=skip) if skip else client.compare_tokenization(ca, cb)
    return config, side, tokens


def bit_identical(report: VerifyReport) -> bool:
    """Every FFN and every other tensor of B is bit-identical to A's (and the configs agree): then the same
    client computes the same logits, exactly."""
    o = report.outside
    return (bool(report.results) and all(r.exact == "identical" for r in report.results) and o is not None
            and not o.skipped and o.passed and o.within == 0)


def probe_length(config: dict, nbytes: int) -> int | None:
    """Tokens per sequence for --logits: past the sliding window or the original context of a scaled rope
    (where the config's settings act) when the model is small enough; None: the default batch."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    reach = [v for v in (config.get("sliding_window"), config.get("attention_chunk_size"),
                         rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None)
             if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if not reach or nbytes > PROBE_BYTES:
        return None
    length = min(reach) + 16
    return length if length <= PROBE_MAX else None


WIDER = ("float64", "float32", "float16", "bfloat16")  # the float dtypes, widest first


def compute_dtype(report: VerifyReport) -> str | None:
    """The dtype both sides' logits are computed in where their weights' differ: the wider (A's bfloat16 weights
    widen to float32 exactly, so both run B's arithmetic and what differs is B's conversion); None: as stored."""
    dtypes = {report.a.get("dtype"), report.b.get("dtype")}
    if len(dtypes) != 2 or not dtypes <= set(WIDER):
        return None
    if dtypes == {"float16", "bfloat16"}:  # neither holds the other's values: both in float32
        return "float32"
    return min(dtypes, key=WIDER.index)


def run_logits(report: VerifyReport, models: Models, function: str | None, o: VerifyOptions) -> None:
    """Whole-model logits of A and B through their ``clients``, into ``report.logits``: exactly equal where one
    client runs bit-identical weights, else within the FFNs' loosest row widened for whole models (no finer
    than a client's own precision: ``logits.client_floor``), both computed in the wider of their dtypes
    (``compute_dtype``). A client that cannot run its model here leaves the report incomplete, saying why."""
    from ..errors import FFNToolsError
    from .logits import client_floor, compare_logits

    (a, b), (ca, cb), clients, atol, rtol, seed = models.paths, models.ckpts, models.clients, o.atol, o.rtol, o.seed
    same = clients[0].name == clients[1].name and bit_identical(report)
    row, why = client_floor(report.tolerance or tolerance_for([], None, atol=atol, rtol=rtol), clients, function)
    if why and not same:
        report.notes.append(why)
    dtype = None if same else compute_dtype(report)
    if dtype is not None:
        report.notes.append(f"logits: both sides computed in {dtype}, the wider of their weights' dtypes (the other's "
                            "widen exactly), so they compare B's conversion, not two dtypes' arithmetic")
    vocab = [(c.config or {}).get("vocab_size") for c in (ca, cb)]
    probe = probe_length(ca.config or {}, ca.total_bytes)
    tol = EXACT if same else widened(row)
    try:
        report.logits = compare_logits(a, b, clients, tol, seed, vocab, probe, dtype)
    except FFNToolsError as e:
        wider = next((w for c in clients if (w := c.runs_instead(str(e))) and w != dtype), None)
        if wider is None:
            report.incomplete.append(str(e))
            report.logits_skipped = "a client could not run its model here (see above)"
            return
        report.notes.append(f"logits: both sides computed in {wider}, which their weights widen to exactly: "
                            f"{' '.join(str(e).split())[:160]}")
        report.logits = compare_logits(a, b, clients, tol, seed, vocab, probe, wider)
    _expert_map_mass(report)
    config = report.config
    causes = [*config.problems, *(b["line"] for b in config.bounded)] if config is not None else []
    if not report.logits["passed"] and causes:  # what differs is likely that (a bound: past it, logits differ)
        report.logits["problems"].append(f"likely cause, from the config check: {causes[0]}")


def _expert_map_mass(report: VerifyReport) -> None:
    """A pruned B's routing mass dropped (``expert_map.mass_note``), measured by A's masked logits run: shown
    under the expert-map check (its note, and ``expert_map`` in the JSON), as information: it fails nothing."""
    from .expert_map import mass_note

    lg = report.logits or {}
    masked = lg.get("masked")
    if masked is None:
        return
    tokens = math.prod(lg["shape"][:2])
    line = mass_note(masked, tokens, lg["client_a"].split(",")[0])
    report.expert_map = {"routing_mass_dropped": masked["routing_mass_dropped"], "tokens": tokens,
                         "informational": True,
                         "what": "per MoE layer, the share of A's router probability on the experts B dropped "
                                 "(softmax, or sigmoid scores normalized), mean and max over the tokens; not a "
                                 "pass/fail criterion"}
    at = next((i + 1 for i, n in enumerate(report.notes) if n.startswith("B records an expert mapping")),
              len(report.notes))
    report.notes.insert(at, line)
