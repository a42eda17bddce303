"""``verify A B --locate``: where two models part. Both run on the same token sequences with hooks in their clients
(``Client.activations``), and every part of every layer is compared with A's: the embedding rows, the attention's
input norm and output, the hidden state after attention, the FFN's input norm, inside the FFN block the router's
logits and top-k choice, the shared expert's output, the routed experts' combined output and the block's output
(the dense FFN or the MoE block), the hidden state after the FFN, then the final norm and the logits.

Each part is held against its own floor: the same figure between A and A', the change that is not a defect (B's
form re-derived from A, as ``--generate``'s floor: ``floor.floor_side``). The first part, in the order the model
computes them, whose figure leaves its floor is where B parts from A: every part after it inherits the difference.
The figure is the relative error ``||x_B - x_A|| / ||x_A||`` over every position (the top-k choice: the share of
positions choosing another set of experts); a part leaves its floor above ``FACTOR`` x the floor's figure plus
``SLACK`` (``CHOICE_SLACK`` of the positions for the choice).

Where B's client exposes no activations (llama.cpp), B is converted to A's format by ffn-tools and run in A's
client, and the report says so (the floor likewise).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..clients import Client, NotApplicable
from ..errors import FFNToolsError
from ..progress import say
from .floor import floor_side
from .locate_report import LocateResult, Row
from .logits import client_for, could_not_run, token_batch
from .options import Models

PARTS = ("attn_norm", "attn", "after_attn", "ffn_norm", "router", "topk", "shared", "routed", "ffn", "hidden")
FACTOR = 2.0  # a part's figure may be this many times its floor's
SLACK = 1e-6  # plus this much relative error (float32 summation order)
CHOICE_SLACK = 0.02  # plus this share of positions choosing other experts
LENGTH = 32  # tokens per sequence of the seeded batch


def ordered(keys) -> list[str]:
    """The parts' keys in the order the model computes them (``embed``, ``L<i>.<part>``, ``final_norm``,
    ``logits``)."""
    def rank(k: str) -> tuple:
        if k == "embed":
            return (0, 0, 0)
        if k.startswith("L") and "." in k:
            layer, part = k[1:].split(".", 1)
            return (1, int(layer), PARTS.index(part) if part in PARTS else len(PARTS))
        return (2, 0 if k == "final_norm" else 1, 0)
    return sorted(keys, key=rank)


def figure(a: np.ndarray, b: np.ndarray) -> dict:
    """One part of B (or A') against A's: {rel, max_rel, cosine} (floats), or {choice} for a top-k choice."""
    if a.dtype.kind in "iu":
        return {"choice": float((a != b).any(-1).mean())}
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    norm, diff = float(np.linalg.norm(a64)), float(np.linalg.norm(b64 - a64))
    rms = norm / np.sqrt(max(a64.size, 1))
    nb = float(np.linalg.norm(b64))
    cos = float((a64 * b64).sum() / (norm * nb)) if norm and nb else float(norm == nb)
    return {"rel": diff / norm if norm else diff, "max_rel": float(np.abs(b64 - a64).max() / rms) if rms else 0.0,
            "cosine": cos}


def _limit(row: Row, floor: dict) -> float:
    stat = row.statistic
    return FACTOR * floor[stat] + (CHOICE_SLACK if stat == "choice" else SLACK)


def rows(acts_a: dict, acts_b: dict, acts_f: dict | None, acts_n: dict | None = None,
         on_anchor: bool = True) -> list[Row]:
    """Every part of A, B's figure, the floor's and the anchor's (None: not measured), judged: against the
    anchor's where there is one (independent of ffn-tools' converter) and ``on_anchor``, else against the floor."""
    out = []
    for key in ordered(acts_a):
        layer, part = (int(key[1:].split(".")[0]), key.split(".", 1)[1]) if key.startswith("L") else (None, key)
        row = Row(key, layer, part)
        a, b = acts_a[key], acts_b.get(key)
        if b is None:
            row.note = "B's client gives no such part"
        elif b.shape != a.shape:
            row.note, row.left = f"shape {list(b.shape)} in B, {list(a.shape)} in A", True
        else:
            row.b = figure(a, b)
        f = acts_f.get(key) if acts_f is not None else None
        if f is not None and f.shape == a.shape:
            row.floor = figure(a, f)
        n = acts_n.get(key) if acts_n is not None else None
        if n is not None and n.shape == a.shape:
            row.anchor = figure(a, n)
        held = row.anchor if acts_n is not None and on_anchor else row.floor
        if row.b is not None and held is not None:
            row.allowed = _limit(row, held)
            row.left = row.b[row.statistic] > row.allowed
        if row.floor is not None and row.anchor is not None:  # ffn-tools' floor against the anchor's
            row.floor_leaves_anchor = row.floor[row.statistic] > _limit(row, row.anchor)
        out.append(row)
    return out


def _activations(models: Models, client: Client, path: Path, side: str, sequences: list[list[int]],
                 dtype: str | None, tmp: Path, notes: list[str]) -> tuple[dict, str]:
    """``client.activations`` and the name of the client that ran them: where ``client`` exposes none, ``path``
    converted to A's format and run in A's client (said in ``notes``)."""
    try:
        return client.activations(path, sequences, dtype), client.name
    except NotApplicable:
        a_client, a_format = models.clients[0], models.ckpts[0].format
        if models.convert is None or a_format is None or client is a_client:
            raise
        out = tmp / f"as-a-{len(list(tmp.iterdir()))}"
        try:
            models.convert(str(path), a_format.name, out)
        except FFNToolsError as e:
            raise FFNToolsError(f"--locate: {client.name} exposes no activations and {side} could not be converted "
                                f"to A's format ({a_format.name}) to run in {a_client.name}: {e}") from None
        notes.append(f"{client.name} exposes no activations: the weights of {side} were converted to A's format "
                     f"({a_format.name}) by ffn-tools and run in {a_client.name}")
        acts, _ = _activations(models, a_client, out, side, sequences, dtype, tmp, notes)
        return acts, f"{a_client.name} (as {a_format.name}: {client.name} exposes no activations)"
    except FFNToolsError:
        raise
    except Exception as e:  # the client's own errors: it cannot run the model here
        line, first = could_not_run("--locate", client, side, path, e)
        wider = client.runs_instead(line) if dtype is None else None  # MLX's CPU: MoE layers in float32 only
        if wider is None:
            raise FFNToolsError(line + client.hint(first)) from None
    notes.append(f"{client.name} ran {side} in {wider}: it cannot here in the weights' dtype ({first})")
    return _activations(models, client, path, side, sequences, wider, tmp, notes)


def run_locate(models: Models, sequences: list[list[int]], floor: tuple[Path, Client, str | None, str] | str,
               tmp: Path, anchor: tuple[Path, str] | None = None) -> LocateResult:
    """A, B and the floor A' (``floor.floor_side``'s answer: (path, client, dtype, words), or why there is none)
    run on ``sequences``, their parts compared (see the module docstring). ``tmp``: where B or A' converted to A's
    format is written, where its client exposes no activations. ``anchor``: B's form re-derived by another tool
    (``Client.anchor``: its path and words), run by B's client: the floor B is then held against."""
    (a, b), clients = models.paths, models.clients
    res = LocateResult(sequences=len(sequences), positions=sum(len(s) for s in sequences))
    acts_a, ran_a = _activations(models, clients[0], Path(a), "A", sequences, None, tmp, res.notes)
    acts_b, ran_b = _activations(models, clients[1], Path(b), "B", sequences, None, tmp, res.notes)
    res.clients = (ran_a, ran_b)
    acts_f = None
    if isinstance(floor, str):
        res.not_judged = floor
    else:
        path, client, dtype, res.floor = floor
        acts_f, ran_f = _activations(models, client, path, "A'", sequences, dtype, tmp, res.notes)
        if ran_f != client.name:
            res.floor += f"; its activations by {ran_f}"
    acts_n = None
    if anchor is not None:
        res.anchor = f"A converted to B's form by {anchor[1]}, run by {clients[1].name}"
        acts_n, _ = _activations(models, clients[1], anchor[0], "the anchor", sequences, None, tmp, res.notes)
    made_by_anchor = acts_n is not None and acts_f is not None and _same(acts_b, acts_n) and not _same(acts_b, acts_f)
    if made_by_anchor:  # B is the anchor's output: the anchor is no floor independent of B, ffn-tools' is
        res.notes.append("B computes bit for bit as the anchor's output, not as ffn-tools' floor: B came from that "
                         "tool, so B is held against ffn-tools' floor")
        res.anchor_is_b = True
    res.rows = rows(acts_a, acts_b, acts_f, acts_n, on_anchor=not made_by_anchor)
    return res


def _same(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def after_generate(models: Models, sequences: list[list[int]], floor: tuple[Path, Client, str | None, str],
                   tmp: Path) -> list[str]:
    """Where B parts from A, for a failed ``--generate``: its sequences run again with hooks, against its floor;
    the verdict and the per-layer table as lines (or why it could not run). A side whose client exposes no
    activations is not converted to A's format here (seconds to minutes a side): ``verify --locate`` does that."""
    try:
        return run_locate(replace(models, convert=None), sequences, floor, tmp).lines()
    except FFNToolsError as e:
        return [f"--locate could not run: {e}" + ("; verify A B --locate runs it in A's client"
                                                   if isinstance(e, NotApplicable) else "")]


def locate(a, b, *, opener: Callable, converter: Callable | None, client: str | None = None, seed: int = 0,
           length: int = LENGTH, allow_config: Sequence[str] = ()) -> LocateResult:
    """``verify A B --locate``: both sides opened (``opener``: the format registry's ``open_sides``), run on the
    seeded token batch (``logits.token_batch``, ``length`` tokens a sequence) by their clients (B's: runtime
    ``client``), against the floor ``converter`` re-derives (the registry's ``convert``; None: none measured).

    Raises:
        FFNToolsError: a side cannot be read, or run as a whole model here.
    """
    from .. import quant
    from .sides import describe_side, find

    with ExitStack() as stack:
        opened: list = []
        for path, side in ((a, "A"), (b, "B")):
            c, problem = opener(path, side, False, like=opened[0] if opened else None)
            if problem:
                raise FFNToolsError(f"--locate: {problem}")
            opened.append(stack.enter_context(quant.decoded(c, every=True)))
        ca, cb = opened
        (fa, _), (fb, _) = find(ca, "A", None, None), find(cb, "B", None, None)
        da, db = describe_side(ca, fa), describe_side(cb, fb)
        try:
            clients = (client_for(ca, "A"), client_for(cb, "B", client))
        except FFNToolsError as e:
            raise FFNToolsError(str(e).replace("--logits:", "--locate:", 1)) from None
        recipe = cb.format.recipe(cb, db.get("dtype"), bool(db.get("quantization")))
        config = ca.config or {}
        vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        if not isinstance(vocab, int):
            raise FFNToolsError("--locate: A's config.json names no vocab_size: the token batch needs one")
    sequences = token_batch(vocab, seed, length).tolist()
    models = Models((a, b), (ca, cb), clients, converter)
    say(f"--locate: A, B and the floor run on {len(sequences)} x {length} tokens, every part of every layer kept")
    with tempfile.TemporaryDirectory(prefix="ffn-tools-locate-") as d:
        floor = floor_side(models, recipe, da.get("dtype"), Path(d), allow_config)
        made, why = None, None
        if not isinstance(floor, str) and recipe is not None and floor[0] != Path(a):  # B's form is another
            where = Path(d) / ("anchor" + (Path(b).suffix if Path(b).is_file() else ""))  # B's shape: a .gguf file
            made, why = _anchor(clients[1], Path(a), recipe, where, floor[0])
        res = run_locate(models, sequences, floor, Path(d), made)
        res.notes += [why] if why else []
        return res


def _anchor(client: Client, a: Path, recipe: dict, out: Path, like: Path) -> tuple[tuple[Path, str] | None,
                                                                                  str | None]:
    """The independent floor's model (``Client.anchor``) or None where B's client has no tool here; and, where the
    tool failed (no floor then: ffn-tools' floor is the measure), why."""
    try:
        words = client.anchor(a, recipe, out, like)
    except Exception as e:  # the tool's own errors
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        return None, (f"no independent floor: {client.name}'s converter could not convert A ({first}); B is held "
                      "against ffn-tools' floor")
    return (None if words is None else (out, words)), None
