"""A batch of one layer's routed experts, checked with batched tensor ops instead of one round trip each.

A 128-expert layer checked one FFN at a time costs ~20 small tensor ops per expert (each a thread-pool round
trip) for weights of a few hundred kB. Here the experts of a batch are stacked (E, I, H) per role (sliced out
of a stacked tensor, checked against ``canonical_weights``; expert by expert for other forms) and checked at once:

    bit-exact   one equality of A's and B's stack per role (where both should be lossless copies)
    finite      one min/max per role
    reference   where B is not A's bit for bit (a cast, --no-exact): A's and B's FFNs in float64 as batched
                GEMMs (``torch.bmm``), experts in blocks of ``BATCH_REF_BYTES`` of float64 weights
    metrics     of every expert's output at once, as ``functional.compare`` computes them for one

Bit-identical, finite experts get the reference row ``functional.not_computed()``, as one FFN does in
``PairChecker.check``. A batch holds experts no kernel backend runs (the first FFN of each kind runs alone,
on every backend). ``batch_key`` says which pairs qualify: routed experts, A and B of one shape and dtype
each, neither quantized, no biases. Whatever fails or differs in a batch is checked again one FFN at a time
(``PairChecker.check``), so its report is the per-FFN one, word for word: the first differing element, the
defect named, non-finite weights named.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from ..ffn import FFN, FFNRef, canonical_weights
from ..io.dtypes import itemsize, short_name
from ..layouts import split
from ..tolerances import Tolerance
from ..checks.diagnose import bits
from .functional import PREACT_RMS, REF_BLOCK_BYTES, SCALE_ROWS, all_finite, held_by_all, not_computed
from .pairs import KERNEL_LAYOUTS, PairChecker
from .report import BackendResult, FFNResult

BATCH_BYTES = 128 << 20  # A's and B's stored weights of one batch
BATCH_REF_BYTES = 8 << 20  # float64 weights per batched GEMM (cache-sized: the conversion and the GEMM then read them once)
WEIGHTS = ("gate", "up", "down")

Item = tuple[FFNRef, FFN, FFN]


def batch_key(checker: PairChecker, x: FFN, y: FFN, quantized: bool) -> tuple | None:
    """What experts must share to be checked in one batch (layer, shapes, forms, dtypes); None: this pair is
    checked on its own."""
    if x.ref.kind != "expert" or quantized or x.has_bias or y.has_bias:
        return None
    if (x.d_model, x.d_ffn) != (y.d_model, y.d_ffn) or 3 * 8 * x.d_model * x.d_ffn > 4 * REF_BLOCK_BYTES:
        return None  # an expert whose float64 weights are that large runs alone, in row blocks
    dtypes = tuple(c.info(f.names[r]).st_dtype for c, f in ((checker.ca, x), (checker.cb, y)) for r in f.names)
    return (x.ref.layer, x.d_model, x.d_ffn, x.form_name, y.form_name, x.layout, y.layout, dtypes)


def pair_bytes(checker: PairChecker, x: FFN, y: FFN) -> int:
    """A's and B's stored bytes of one expert's weights."""
    return 3 * x.d_model * x.d_ffn * sum(itemsize(c.info(f.names["down"]).st_dtype)
                                         for c, f in ((checker.ca, x), (checker.cb, y)))


def stacked_weights(read: Mapping, ffns: Sequence[FFN]) -> dict[str, torch.Tensor]:
    """The canonical gate, up (E, I, H) and down (E, H, I) of ``ffns``, as ``canonical_weights`` gives each
    expert's, stacked on a new first dim, bit for bit: sliced out of a stacked tensor at once where the first
    and last expert's slices are what ``canonical_weights`` gives them (the same slicing serves every expert
    between), else expert by expert (any form: flattened, turned per role)."""
    fast = _sliced(read, ffns)
    ends = [canonical_weights(read, ffns[k]) for k in (0, len(ffns) - 1)]
    if fast is not None and all(fast[r][k].shape == one[r].shape and torch.equal(bits(fast[r][k]), bits(one[r]))
                                for k, one in zip((0, -1), ends) for r in WEIGHTS):
        return fast
    each = [canonical_weights(read, f) for f in ffns]
    return {r: stack([w[r] for w in each]) for r in WEIGHTS}


def stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``, bit for bit, copied by numpy in this thread. torch's stack copies each input
    with its intra-op thread pool: with more runnable processes than cores, every one of those copies waits
    for its pool's other threads to be scheduled (measured on 2 busy cores: 127 experts' 256 kB gate_proj,
    2.0 s; one thread, or numpy, 0.1 s)."""
    import numpy as np

    out = np.stack([bits(t).numpy() for t in tensors])  # integer views: every dtype, bf16 and fp8 included
    return torch.from_numpy(out).view(tensors[0].dtype)


def _sliced(read: Mapping, ffns: Sequence[FFN]) -> dict[str, torch.Tensor] | None:
    """``stacked_weights`` by slicing: experts of one stacked tensor (E, ...) per role, or per-expert tensors
    stacked; fused gate_up split with the layout, an (in, out) form turned. None where the form has more
    (flattened, turned per role)."""
    def get(role: str) -> torch.Tensor:
        names = [f.names[role] for f in ffns]
        index = [f.index for f in ffns]
        stacked = [i for i in index if i is not None]
        if len(set(names)) == 1 and len(stacked) == len(index):  # experts of one stacked tensor (E, ...)
            t = read[names[0]]
            if stacked == list(range(stacked[0], stacked[0] + len(stacked))):
                return t[stacked[0]:stacked[0] + len(stacked)]
            return t[torch.tensor(stacked)]
        return stack([read[n] if i is None else read[n][i] for n, i in zip(names, index)])

    f0 = ffns[0]
    if any(f.form is not f0.form or f.layout != f0.layout for f in ffns):
        return None
    out = {"down": get("down")}
    if "gate_up" in f0.names:
        out["gate"], out["up"] = split(get("gate_up"), f0.layout, name=f0.names["gate_up"])
    else:
        out["gate"], out["up"] = get("gate"), get("up")
    if f0.form.transposed:  # stored (in, out) per expert: back to (out, in)
        for r in WEIGHTS:
            out[r] = out[r].transpose(-2, -1)
    return out


def check_batch(checker: PairChecker, items: Sequence[Item], tol: Tolerance, backends: dict) -> list[FFNResult]:
    """Every check of a batch of experts (``batch_key`` equal) on ``backends``: the reference, or none (a
    --backend list without it: then only the bit-exact check runs)."""
    refs, xs, ys = zip(*items)
    wa, wb = stacked_weights(checker.read_a, xs), stacked_weights(checker.read_b, ys)
    x0, y0 = xs[0], ys[0]
    da, db = (short_name(c.info(f.names["down"]).st_dtype) for c, f in ((checker.ca, x0), (checker.cb, y0)))
    results = [FFNResult(r, (x0.d_model, x0.d_ffn), (y0.d_model, y0.d_ffn), da, db, tolerance=tol) for r in refs]
    lay = y0.layout
    if y0.form.fused and lay.axis == "rows" and lay.arrangement not in KERNEL_LAYOUTS:
        for res in results:  # as PairChecker.check says it of each
            res.notes.append(f"B's fused layout {lay.describe()} ran through ffn() on split weights")
    act_a, act_b = checker.fa.activation.kernel, checker.fb.activation.kernel
    mixed = [r for r in WEIGHTS if wa[r].dtype != wb[r].dtype]
    identical = False
    if checker.exact is not False and not mixed:
        if not all(torch.equal(bits(wa[r]), bits(wb[r])) for r in WEIGHTS):
            return _one_by_one(checker, items, tol, backends)  # name the first differing element of each
        identical = True
        for res in results:
            res.exact = "identical"
    elif checker.exact is not False:  # what PairChecker._exact says of a dtype change
        why = f"dtypes differ ({mixed[0]}: A {short_name(wa[mixed[0]].dtype)}, B {short_name(wb[mixed[0]].dtype)})"
        for res in results:
            res.exact = "impossible" if checker.exact else "skipped"
            if checker.exact:
                res.problems.append(f"--exact: cannot be bit-identical: {why}")
    if not backends:
        return results
    if identical and act_a == act_b:
        if not all_finite(wa.values()):
            return _one_by_one(checker, items, tol, backends)  # the reference runs and names them
        for res in results:
            res.backends = [not_computed()]
        return results
    t0 = time.perf_counter()
    x = batch_inputs(checker.tokens, x0.d_model, checker.seed, wa["gate"], [t.dtype for t in (*wa.values(), *wb.values())])
    ra = reference_batch(x, wa, act_a)
    rb = reference_batch(x, wb, act_b)
    backend = compare_batch("ffn (float64)", rb, ra, tol, (time.perf_counter() - t0) / len(items))
    if not all(b.passed for b in backend) or any(res.problems for res in results):
        return _one_by_one(checker, items, tol, backends)
    for res, b in zip(results, backend):
        res.backends = [b]
    return results


def _one_by_one(checker: PairChecker, items: Sequence[Item], tol: Tolerance, backends: dict) -> list[FFNResult]:
    return [checker.check(r, x, y, tol, False, backends, compute_identical=False) for r, x, y in items]


def batch_inputs(tokens: int, d_model: int, seed: int, gate: torch.Tensor, dtypes) -> torch.Tensor:
    """(E, tokens, d_model) float32 inputs: expert e's are ``functional.make_inputs`` with its own
    ``input_scale`` (the same seed per d_model, scaled to give its gate pre-activations RMS ``PREACT_RMS``),
    computed for all experts at once."""
    step = max(1, gate.shape[1] // SCALE_ROWS)
    norms = torch.linalg.vector_norm(gate[:, ::step].float(), dim=2)  # (E, rows)
    med = norms.median(dim=1).values.tolist() if norms.shape[1] else [0.0] * gate.shape[0]
    scales = torch.tensor([PREACT_RMS / m if math.isfinite(m) and m > 0 else 1.0 for m in med], dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + d_model)
    return held_by_all(torch.randn(tokens, d_model, generator=gen) * scales[:, None, None], dtypes)


def _act(x: torch.Tensor, function: str, alpha: float) -> torch.Tensor:
    """``kernels.reference``'s activations, on float64 (which its public functions do not take)."""
    if function == "silu":
        return F.silu(x * alpha) / alpha
    if function == "gelu":
        return F.gelu(x)
    if function == "relu2":
        return F.relu(x).square()
    if function == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"no batched float64 activation {function!r}")


def reference_batch(x: torch.Tensor, w: dict[str, torch.Tensor], glu) -> torch.Tensor:
    """Every expert's FFN in float64, as ``kernels.reference.ffn`` computes one: (E, T, H) outputs of inputs
    ``x`` (E, T, H) and weights ``w`` (gate, up (E, I, H), down (E, H, I))."""
    e_all, inter, hidden = w["gate"].shape
    block = max(1, BATCH_REF_BYTES // (8 * 3 * inter * hidden))
    outs = []
    for s in range(0, e_all, block):
        e = slice(s, min(s + block, e_all))
        x64 = x[e].double()
        g = torch.bmm(x64, w["gate"][e].double().transpose(1, 2))  # (e, T, I)
        u = torch.bmm(x64, w["up"][e].double().transpose(1, 2))
        if glu.limit is not None:
            g, u = g.clamp(max=glu.limit), u.clamp(-glu.limit, glu.limit)
        if glu.up_offset:
            u = u + glu.up_offset
        h = _act(g, glu.function, glu.alpha) * u
        outs.append(torch.bmm(h, w["down"][e].double().transpose(1, 2)))  # (e, T, H)
    return torch.cat(outs)


def compare_batch(path: str, out: torch.Tensor, ref: torch.Tensor, tol: Tolerance,
                  seconds: float = 0.0) -> list[BackendResult]:
    """``functional.compare`` of each expert's output ``out[e]`` against ``ref[e]`` (both (E, ...)), at once."""
    o, r = out.reshape(out.shape[0], -1).double(), ref.reshape(ref.shape[0], -1).double()
    finite = torch.isfinite(o)
    nonfinite = (~finite).sum(dim=1).tolist()
    diff = (o - r).abs()
    rms = r.square().mean(dim=1).sqrt()
    bound = (tol.atol * rms[:, None] + tol.rtol * r.abs()).clamp_min(torch.finfo(torch.float64).tiny)
    ratio = (diff / bound).amax(dim=1).tolist()
    max_abs = diff.amax(dim=1).tolist()
    peak = r.abs().amax(dim=1).tolist()
    dot, on, rn = (o * r).sum(dim=1).tolist(), o.norm(dim=1).tolist(), r.norm(dim=1).tolist()
    results = []
    for k in range(o.shape[0]):
        rel = max_abs[k] / peak[k] if peak[k] > 0 else (0.0 if max_abs[k] == 0 else math.inf)
        cos = dot[k] / (on[k] * rn[k]) if on[k] > 0 and rn[k] > 0 else (1.0 if on[k] == rn[k] == 0 else 0.0)
        rat = ratio[k]
        if nonfinite[k]:
            rat, cos = math.nan, math.nan
        passed = nonfinite[k] == 0 and rat <= 1.0 and cos >= tol.min_cosine
        results.append(BackendResult("reference", path, max_abs[k], rel, cos, rat, int(nonfinite[k]), passed, seconds))
    return results
