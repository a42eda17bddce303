"""``verify --generate``: both models run on prompts by their own clients, compared token by token, and held
against a measured noise floor (``checks.agreement``).

A's client tokenizes each prompt (its chat template where it has one) and continues it greedily; both clients then
give every position's logits of A's sequence (B's client on the same ids: what is compared is the model, while
B's own tokenization of the prompts is compared as ids), one forward pass each. Per prompt and overall: KL(A||B)
and KL(B||A) mean / p99 / max over positions, top-1 and top-5 agreement, the first token of A's continuation
B's greedy choice differs from (with the text around it), whether B's stop ids stop A's sequence where A's do
(A's stop token among them, none of the tokens A goes on after: the ids, apart from what B predicts there, which
the statistics judge).

The floor is the same statistics between A and A', the change that is not a defect (``floor_side``): B's form
re-derived from A by ``convert`` (B's format, dtype and quantization: ``Format.recipe``) run by B's client; A in
B's dtype by A's client where B is A's format unquantized; A's client on A again where nothing differs (its
run-to-run noise, zero for a deterministic client). Where B's form cannot be re-derived (a quantization ffn-tools
does not write) the statistics are reported and the verdict says it was not judged: never a pass.

Where B's client runs A' too, B is also compared with A' directly (``direct``): one form in one client computes
alike to the client's run-to-run noise, which is far below the floor between two clients.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np

from ..checks.agreement import DIRECT, PROFILES, AgreementResult
from ..clients import Client
from ..generation import Generation
from ..errors import FFNToolsError
from ..progress import say
from .floor import floor_side
from .logits import could_not_run
from .options import Models, VerifyOptions

log = logging.getLogger(__name__)

CONTEXT = 4  # tokens of A's continuation shown before a divergence
PROMPT_GUESS = 48  # tokens a chat-templated built-in prompt takes, for the cost said before it starts
SHOWN = 40  # characters of a prompt shown


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _top5(lp: np.ndarray) -> np.ndarray:
    k = min(5, lp.shape[-1])
    return np.argpartition(-lp, k - 1, axis=-1)[:, :k]


def statistics(prompts: list[str], a: Generation, b: Generation) -> tuple[dict, list[dict], int]:
    """B's logits of A's sequences against A's: (overall statistics, per prompt, positions).

    Raises:
        FFNToolsError: the two clients' logits are not of one vocabulary (their widths differ).
    """
    beos, aeos = set(b.eos), set(a.eos)
    kl_ab, kl_ba, top1, top5 = [], [], [], []
    rows = []
    for i, seq in enumerate(a.sequences):
        la, lb = _log_softmax(a.logits[i]), _log_softmax(b.logits[i])
        if la.shape != lb.shape:
            raise FFNToolsError(f"--generate: A's client gives logits of shape {list(la.shape)} and B's "
                                f"{list(lb.shape)} for prompt {i + 1}: not one vocabulary")
        ab = (np.exp(la) * (la - lb)).sum(-1).clip(min=0)
        ba = (np.exp(lb) * (lb - la)).sum(-1).clip(min=0)
        ta, tb = la.argmax(-1), lb.argmax(-1)
        t5a, t5b = _top5(la), _top5(lb)
        overlap = np.array([len(set(x) & set(y)) / t5a.shape[1] for x, y in zip(t5a.tolist(), t5b.tolist())])
        kl_ab.append(ab)
        kl_ba.append(ba)
        top1.append(ta == tb)
        top5.append(overlap)
        start = a.starts[i]
        cont = seq[start:]
        div = next((k for k in range(len(cont)) if int(tb[start - 1 + k]) != cont[k]), None)
        row = {"index": i, "text_shown": repr(prompts[i][:SHOWN]) + ("..." if len(prompts[i]) > SHOWN else ""),
               "positions": int(ab.size), "kl_ab_mean": float(ab.mean()), "kl_ab_max": float(ab.max()),
               "kl_ba_mean": float(ba.mean()), "kl_ba_max": float(ba.max()), "top1": float((ta == tb).mean()),
               "top5": float(overlap.mean()), "continuation": cont, "divergence": div}
        if div is None:
            row["divergence_words"] = f"B's greedy choice follows all {len(cont)} tokens of A's"
        else:
            before = "".join(a.piece(t) for t in seq[max(start, start + div - CONTEXT):start + div])
            mine, theirs = cont[div], int(tb[start - 1 + div])
            row["divergence_words"] = (f"greedy diverges at new token {div + 1}: after {before!r}, A {a.piece(mine)!r} "
                                       f"({mine}), B {b.piece(theirs)!r} ({theirs})")
            row["divergence_tokens"] = {"a": mine, "b": theirs}
        # stops: B's stop ids on A's own tokens (what B's predictions do there is the statistics' part)
        a_stop = len(cont) - 1 if cont and cont[-1] in aeos else None
        end = len(cont) if a_stop is None else a_stop
        early = next((k for k in range(end) if cont[k] in beos), None)
        row["stops_same"] = early is None and (a_stop is None or cont[a_stop] in beos)
        row["stop_a"], row["stop_b_early"] = a_stop, early
        stop_ids = f"B's stop ids: {', '.join(map(str, sorted(beos))) or 'none'}"
        if early is not None:
            t = cont[early]
            row["why_stops"] = (f"prompt {i + 1}: A generates {a.piece(t)!r} (id {t}) at new token {early + 1} and "
                                f"goes on; it is a stop id of B's, so B would stop there ({stop_ids})")
        elif a_stop is not None and not row["stops_same"]:
            t = cont[a_stop]
            row["why_stops"] = (f"prompt {i + 1}: A stops at new token {a_stop + 1} ({a.piece(t)!r}, id {t}); it is "
                                f"not a stop id of B's, so B does not stop at it ({stop_ids})")
        row["stops_words"] = ("stops: " + ("same" if row["stops_same"] else "DIFFER") + ", A "
                              + (f"stops at new token {a_stop + 1}" if a_stop is not None else "does not stop"))
        row["tokens_same"] = a.prompts[i] == b.prompts[i]
        if not row["tokens_same"]:
            row["why_tokens"] = _tokens_differ(i, prompts[i], a, b)
        rows.append(row)
    ab_all, ba_all = np.concatenate(kl_ab), np.concatenate(kl_ba)
    stats = {"kl_ab_mean": float(ab_all.mean()), "kl_ab_p99": float(np.quantile(ab_all, 0.99)),
             "kl_ab_max": float(ab_all.max()), "kl_ba_mean": float(ba_all.mean()),
             "kl_ba_p99": float(np.quantile(ba_all, 0.99)), "kl_ba_max": float(ba_all.max()),
             "top1_disagreement": float(1 - np.concatenate(top1).mean()),
             "top5_disagreement": float(1 - np.concatenate(top5).mean()),
             "prompts_tokenized_otherwise": sum(not r["tokens_same"] for r in rows),
             "prompts_stopping_otherwise": sum(not r["stops_same"] for r in rows)}
    return stats, rows, int(ab_all.size)


def _tokens_differ(i: int, text: str, a: Generation, b: Generation) -> str:
    """Where B's client's ids of prompt ``i`` first differ from A's, in words."""
    x, y = a.prompts[i], b.prompts[i]
    if a.templated != b.templated:
        has = "A applies a chat template, B has none" if a.templated else "B applies a chat template, A has none"
        return f"prompt {i + 1} {text[:SHOWN]!r}: {has} ({len(x)} vs {len(y)} tokens)"
    k = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), min(len(x), len(y)))
    sa = f"{a.piece(x[k])!r} ({x[k]})" if k < len(x) else "nothing"
    sb = f"{b.piece(y[k])!r} ({y[k]})" if k < len(y) else "nothing"
    return f"prompt {i + 1} {text[:SHOWN]!r}: token {k + 1} is {sa} in A, {sb} in B ({len(x)} vs {len(y)} tokens)"


def run_generation(models: Models, recipe: dict | None, a_dtype: str | None, prompts: list[str],
                   o: VerifyOptions) -> AgreementResult:
    """The check (see the module docstring). ``recipe``: B's form as ``convert`` options (``Format.recipe``);
    ``a_dtype``: A's weights' dtype; ``o``: verify's options (``new_tokens``, ``profile``, ``allow_config``).

    Raises:
        FFNToolsError: a client cannot run its model here; an unknown profile.
    """
    (a, b), (ca, cb), clients = models.paths, models.ckpts, models.clients
    new_tokens, profile, allow_config = o.new_tokens, o.profile, o.allow_config
    if profile not in PROFILES:
        raise FFNToolsError(f"--profile {profile!r}: use one of {', '.join(PROFILES)}")
    res = AgreementResult(clients=(clients[0].name, clients[1].name), profile=profile, new_tokens=new_tokens)
    res.cost = cost(ca, cb, prompts, new_tokens)
    say(f"--generate: {res.cost['words']}")
    ga = _run(clients[0], Path(a), "A", prompts, new_tokens, notes=res.notes)
    gb = _run(clients[1], Path(b), "B", prompts, new_tokens, ga.sequences, notes=res.notes)
    res.stats, res.prompts, res.positions = statistics(prompts, ga, gb)
    with tempfile.TemporaryDirectory(prefix="ffn-tools-floor-") as d:
        side = floor_side(models, recipe, a_dtype, Path(d), allow_config)
        if isinstance(side, str):
            res.not_judged = side
            res.floor_stats = {}
            return res
        path, client, dtype, res.floor = side
        res.floor_client = client.name
        gf = _run(client, path, "A'", prompts, new_tokens, ga.sequences, dtype, res.notes)
        res.floor_stats, _, _ = statistics(prompts, ga, gf)
        res.direct = direct(prompts, gf, gb, (client, clients[1]), path == Path(a) and dtype is None,
                            lambda: _run(clients[1], Path(b), "B", prompts, new_tokens, ga.sequences, notes=res.notes))
        res.judge()
        if res.problems:  # where they part: A's sequences run again with hooks (verify --locate)
            from .locate import after_generate

            res.notes += after_generate(models, ga.sequences, side, Path(d))
    return res


def direct(prompts: list[str], gf: Generation, gb: Generation, clients: tuple[Client, Client], again: bool,
           rerun) -> dict:
    """B against A' where one client runs both (``clients``: A''s and B's): the same form in the same client
    computes alike to the client's run-to-run noise, so the statistics between them are held against that noise,
    not against the floor between A's client and B's. The noise is measured (``rerun``: B scored again) only
    where B and A' differ at all: bit-identical logits are within any noise. ``again``: A' is A run again, whose
    statistics against B are the check itself. Returns {client, statistics, noise, noise_words} or {why_not}."""
    if again:
        return {"why_not": "A' is A run again: the statistics against the floor are B against it"}
    if clients[0].name != clients[1].name:
        return {"why_not": f"A' runs in {clients[0].name} and B in {clients[1].name}: the floor between them is "
                           "the measure"}
    stats = {k: v for k, v in statistics(prompts, gf, gb)[0].items() if k in DIRECT}
    if not any(stats.values()):
        noise, words = dict.fromkeys(DIRECT, 0.0), "not measured: B and A' give bit-identical logits"
    else:
        again_b = rerun()
        noise = {k: v for k, v in statistics(prompts, gb, again_b)[0].items() if k in DIRECT}
        words = (f"0: B run again by {clients[1].name} gives the same logits" if not any(noise.values()) else
                 f"B run again by {clients[1].name}: KL mean {noise['kl_ab_mean']:.3g}, top-1 disagreement "
                 f"{noise['top1_disagreement']:.1%}")
    return {"client": clients[1].name, "statistics": stats, "noise": noise, "noise_words": words}


def cost(ca, cb, prompts: list[str], new_tokens: int) -> dict:
    """What --generate will cost, said before it starts: three models loaded one after another (A, B, the floor
    A' in B's form: about B's size), one forward pass per token of A's continuations on A and a pass over each
    whole sequence on each side, and the logits kept (float32, per position and vocabulary entry)."""
    from ..sizes import human

    vocab = int((ca.config or {}).get("vocab_size") or 0)
    positions = len(prompts) * (PROMPT_GUESS + new_tokens)
    logits = 3 * positions * vocab * 4
    largest = max(ca.total_bytes, cb.total_bytes)
    return {"models_bytes": [ca.total_bytes, cb.total_bytes, cb.total_bytes], "logits_bytes": logits,
            "forward_passes": len(prompts) * (new_tokens + 3),
            "words": (f"{len(prompts)} prompts, up to {new_tokens} new tokens each: A ({human(ca.total_bytes)}), B "
                      f"({human(cb.total_bytes)}) and the floor (about B's size) loaded one at a time, "
                      f"{len(prompts)} x ({new_tokens} + 3) forward passes; peak memory about {human(largest)} plus "
                      f"{human(logits)} of logits (prompts of ~{PROMPT_GUESS} tokens); where B's form differs from "
                      "A's, the floor is written to a temporary directory first (about B's size); B is scored "
                      "once more only where it and the floor, run by one client, differ (that client's noise)")}


def _run(client: Client, path: Path, side: str, prompts, new_tokens, score=None, dtype=None,
         notes: list[str] | None = None) -> Generation:
    """``client.generate``; where the client cannot compute in the weights' dtype here but can in a wider one
    (``Client.runs_instead``: MLX's CPU backend runs MoE layers in float32 only), in that one, said in
    ``notes``."""
    try:
        return client.generate(path, prompts, new_tokens, score, dtype)
    except FFNToolsError:
        raise
    except Exception as e:  # the client's own errors: it cannot run the model here
        error, first = could_not_run("--generate", client, side, path, e)
        wider = client.runs_instead(error) if dtype is None else None
        if wider is None:
            raise FFNToolsError(error + client.hint(first)) from None
    if notes is not None:
        notes.append(f"{client.name} ran {side} in {wider}: it cannot here in the weights' dtype ({first})")
    return _run(client, path, side, prompts, new_tokens, score, wider)
