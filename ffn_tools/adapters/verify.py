"""``verify`` with adapters: ``verify BASE+ADAPTER MERGED`` and ``verify ADAPTER ADAPTER2``.

BASE+ADAPTER against MERGED proves a merge two ways:

* weights: every tensor the adapter targets must be the base's plus ``scale·B·A`` within the rounding its runtime's
  merge does: one rounding of the sum to its dtype (a unit in the last place), and where the runtime rounds the
  delta to the weight's dtype before adding it (``Lora.delta_rounded``: PEFT's ``target_parameters``) a unit in the
  last place of the delta besides; every other tensor must be bit-identical to the base's; a tensor on one side only
  fails;
* FFNs: every FFN is run on seeded random inputs twice, the base's weights with the adapter's low-rank path added
  as runtimes run an unmerged adapter (``x·Wᵀ + scale·(x·Aᵀ)·Bᵀ``, the float64 reference kernel ``ffn_lora``), and
  the merged weights alone (the float64 reference), compared within the tolerance row of the merged dtype.

ADAPTER against ADAPTER2 (a re-layout, a conversion) compares the delta each FFN projection receives, by layer,
expert and projection (gate, up, down: fused and stacked LoRAs are taken apart exactly first), so names and
layouts may differ; a projection with factors on one side only fails, naming it.

Swapped gate and up halves, a scale of alpha/√r for alpha/r, and an expert left out all fail, and so do PEFT's own
merges of a stacked-expert adapter with its delta scaled, its experts shifted by one, or lora_B's experts read in
lora_A's layout (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import counted
from ..io.dtypes import short_name
from .conform import conform
from .model import Adapter, AdapterError
from .places import places

if TYPE_CHECKING:
    import torch

MANTISSA = {"float32": 23, "float16": 10, "bfloat16": 7, "float64": 52}


@dataclass
class AdapterReport:
    """What ``verify`` of adapters found: one entry per check, each passed or not, with its lines."""

    a: str
    b: str
    mode: str  # "merge" | "adapters"
    checks: list[dict] = field(default_factory=list)

    def add(self, name: str, passed: bool, line: str, problems: list[str] | None = None, **facts) -> None:
        self.checks.append({"check": name, "passed": passed, "line": line, "problems": problems or [], **facts})

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c["passed"] for c in self.checks)

    @property
    def verdict(self) -> str:
        failed = [c["check"] for c in self.checks if not c["passed"]]
        what = "the merge of the adapter" if self.mode == "merge" else "the two adapters' deltas"
        return f"PASS: {what} verified ({', '.join(c['check'] for c in self.checks)})" if not failed else \
            f"FAIL: {', '.join(failed)}"

    def lines(self) -> list[str]:
        out = [f"A: {self.a}", f"B: {self.b}"]
        for c in self.checks:
            out.append(f"{'ok  ' if c['passed'] else 'FAIL'} {c['check']}: {c['line']}")
            out += [f"       not run: {n}" for n in c.get("not_run", [])]
            out += [f"       {p}" for p in c["problems"][:20]]
            if len(c["problems"]) > 20:
                out.append(f"       ... ({len(c['problems']) - 20} more)")
        return out + [self.verdict]

    def as_dict(self) -> dict:
        return {"passed": self.passed, "mode": self.mode, "checks": self.checks}


def _ulp(ref, dtype: str):
    """A unit in the last place of ``dtype`` at each value of the float64 tensor ``ref``."""
    import torch

    p = MANTISSA.get(dtype, 23)
    mag = ref.abs().clamp(min=2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(mag)) - p)


def _where(p, target: str) -> str:
    if p is None:
        return target
    at = f"layer {p.layer}" + (f" expert {p.expert}" if p.expert is not None else "")
    return f"{target} ({at} {p.role})"


def verify_merge(base: Path, adapter_path: Path, merged: Path, *, tokens: int = 32, seed: int = 0,
                 scheme=None, backends=None) -> AdapterReport:
    """BASE+ADAPTER against MERGED (see the module docstring)."""
    from .formats import load, open_checkpoint

    report = AdapterReport(f"{base}+{adapter_path}", str(merged), "merge")
    with open_checkpoint(base) as a, open_checkpoint(merged, like=a) as m:
        adapter = load(adapter_path, base)
        adapter.config = adapter.config or a.config
        try:
            adapter, changes = conform(adapter, {n: a.info(n).shape for n in a}, scheme)
        except AdapterError as e:
            report.add("targets", False, str(e))
            return report
        where = places(adapter.loras, adapter.config, scheme)
        report.add("targets", True, f"{counted(len(adapter.loras), 'target')} of the adapter are tensors of the base"
                   + (f" ({'; '.join(changes)})" if changes else ""))
        _weights(report, a, m, adapter, where)
        _ffns(report, a, m, adapter, tokens, seed, scheme, backends)
    return report


def _weights(report: AdapterReport, a, m, adapter: Adapter, where) -> None:
    import torch

    only_a = sorted(set(a) - set(m))
    only_m = sorted(set(m) - set(a))
    problems = [f"{n}: in the base, not in the merged checkpoint" for n in only_a]
    problems += [f"{n}: in the merged checkpoint, not in the base" for n in only_m]
    worst, twice = 0.0, 0
    base_places = None
    for n in a:
        if n not in m:
            continue
        wa, wm = a[n], m[n]
        lora = adapter.loras.get(n)
        if lora is None:
            if wa.dtype != wm.dtype or wa.shape != wm.shape or not torch.equal(wa, wm):
                base_places = base_places or places(list(a), adapter.config)
                problems.append(f"{_where(base_places.get(n), n)}: not targeted by the adapter, yet differs from the "
                                "base")
            continue
        if wm.shape != wa.shape:
            problems.append(f"{_where(where.get(n), n)}: shape {list(wm.shape)}, base {list(wa.shape)}")
            continue
        delta = lora.delta(torch.float64)
        ref = wa.double() + delta
        err = (wm.double() - ref).abs()
        # one rounding to the merged dtype, plus what computing scale·B·A in float32 may round (a bound of a
        # float32 dot product of length r: r·2^-24·Σ|B||A|)
        bound = (lora.b.double().abs() @ lora.a.double().abs()) * abs(lora.scale) * (lora.rank + 2) * 2.0 ** -24
        allowed = _ulp(ref, short_name(wm.dtype)) + bound
        if lora.delta_rounded:  # the adapter's runtime rounds the delta to the weight's dtype before adding it
            allowed = allowed + _ulp(delta, short_name(wm.dtype))
            twice += 1
        ratio = float((err / allowed).max())
        worst = max(worst, ratio)
        if ratio > 1:
            problems.append(f"{_where(where.get(n), n)}: off base + scale·B·A by up to {ratio:.3g} times the rounding "
                            f"allowed ({'of the delta, then of the sum' if lora.delta_rounded else 'of the sum'}; max "
                            f"|error| {float(err.max()):.3g})")
    rounding = "within one rounding of base + scale·B·A" if not twice else (
        "within the rounding of base + scale·B·A their runtime's merge does (one of the sum, and for "
        f"{twice} one of the delta first: PEFT casts a target_parameters delta to the weight's dtype)")
    report.add("weights", not problems, f"{len(adapter.loras)} merged tensors {rounding} (worst {worst:.2f} of the "
               f"rounding allowed), {len(set(a) & set(m)) - len(adapter.loras)} others bit-identical"
               if not problems else f"{counted(len(problems), 'tensor')} wrong", problems)


def factors_of(ffn, adapter: Adapter) -> dict:
    """projection -> (A, B, scale) of one FFN of the base, canonical (out, in): a fused LoRA's B split with the
    FFN's layout, a stacked one's expert taken."""
    from ..layouts import split

    out = {}
    for role, name in ffn.names.items():
        lora = adapter.loras.get(name)
        if lora is None or role.endswith("_bias"):
            continue
        if ffn.form.turns(role):
            raise AdapterError(f"{name}: LoRAs of weights stored (in, out) are not verified by ffn-tools yet")
        a, b = (lora.a[ffn.index], lora.b[ffn.index]) if ffn.index is not None and lora.a.ndim == 3 else (lora.a, lora.b)
        if role == "gate_up":
            bg, bu = split(b, ffn.layout, name=name)
            out["gate"], out["up"] = (a, bg, lora.scale), (a, bu, lora.scale)
        else:
            out[role] = (a, b, lora.scale)
    return out


def _live(x, w: dict, factors: dict, act, backend) -> "torch.Tensor":
    """The FFN as a runtime runs an unmerged adapter, in the weights' dtype: each projection ``x·Wᵀ`` plus
    ``scale·(x·Aᵀ)·Bᵀ`` (the factors in their own dtype, added back in the weights'), the gated unit on ``backend``'s
    kernel."""
    import torch.nn.functional as F

    def proj(role, inp):
        y = F.linear(inp, w[role], w.get(f"{role}_bias"))
        if role in factors:
            a, b, scale = factors[role]
            y = y + (F.linear(F.linear(inp.to(a.dtype), a), b) * scale).to(y.dtype)
        return y

    h = backend.silu_mul(proj("gate", x), proj("up", x), activation=act).to(x.dtype)
    return proj("down", h)


def _ffns(report: AdapterReport, a, m, adapter: Adapter, tokens: int, seed: int, scheme, backends=None) -> None:
    import torch

    from ..clients import runtime
    from ..detect import find_ffns
    from ..ffn import canonical_weights
    from ..kernels import reference
    from ..tolerances import tolerance_for
    from ..verification.backends import resolve_backends

    client = runtime(m.format)
    mods, skipped = resolve_backends(backends, client.kernels, f"the merged checkpoint's client ({client.name})")
    fa, fm = find_ffns(a, scheme), find_ffns(m)
    ours = {f.ref: f for f in fm.ffns}
    problems, live, worst = [], 0, 0.0
    act = fa.activation.kernel
    for f in fa.ffns:
        g = ours.get(f.ref)
        if g is None:
            problems.append(f"{f.ref}: not in the merged checkpoint")
            continue
        wa, wm = canonical_weights(a, f), canonical_weights(m, g)
        factors = factors_of(f, adapter)
        live += bool(factors)
        gen = torch.Generator().manual_seed(seed + 7919 * f.ref.layer + max(f.ref.expert, 0))
        x = torch.randn(tokens, f.d_model, generator=gen, dtype=torch.float32).to(wm["gate"].dtype)
        bias = lambda w: {k.removesuffix("_bias"): v for k, v in w.items() if k.endswith("_bias")} or None  # noqa: E731
        ref = reference.ffn_lora(x.to(wa["gate"].dtype), wa["gate"], wa["up"], wa["down"], factors, bias(wa),
                                 activation=act)
        runs = {"merged weights": reference.ffn(x, wm["gate"], wm["up"], wm["down"], bias(wm), activation=act)}
        for name, mod in mods.items():  # the adapter live on B's runtime's kernels, in the weights' dtype
            if name != "reference":
                runs[f"live on {name}"] = _live(x.to(wa["gate"].dtype), wa, factors, act, mod).double()
        tol = tolerance_for([wm["gate"].dtype])
        rms = float(ref.pow(2).mean().sqrt()) or 1.0
        for what, got in runs.items():
            excess = float(((got - ref).abs() - tol.rtol * ref.abs()).max()) / (tol.atol * rms)
            cos = float(torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0))
            worst = max(worst, excess)
            if excess > 1 or cos < tol.min_cosine:
                problems.append(f"{f.ref}: {what} differ from base + adapter live ({excess:.3g}x the {tol.row} "
                                f"tolerance, cosine {cos:.6f})")
    for ref_ in sorted(set(ours) - {f.ref for f in fa.ffns}):
        problems.append(f"{ref_}: in the merged checkpoint only")
    ran = [n for n in mods if n != "reference"]
    line = (f"{len(fa.ffns)} FFNs run with the adapter live ({live} with factors; the low-rank path added on the "
            f"float64 reference{', and in the weights dtype on ' + ', '.join(ran) if ran else ''}) match the merged "
            f"weights (worst {worst:.2g} of the tolerance)")
    not_run = [f"{n}: {why}" for n, why in skipped.items()]
    report.add("ffns", not problems, line if not problems else f"{counted(len(problems), 'FFN')} wrong", problems,
               backends=list(mods), not_run=not_run)


def _canonical(adapter: Adapter, scheme) -> dict:
    """(kind, layer, expert, projection) -> (Lora target, delta float64) for FFN projections, target -> ... for
    others: fused and stacked LoRAs taken apart first (exactly)."""
    import torch

    from .relayout import split

    try:
        adapter, _ = split(adapter, scheme)
    except AdapterError:
        pass
    where = places(adapter.loras, adapter.config, scheme)
    out = {}
    for target, lora in adapter.loras.items():
        p = where.get(target)
        key = target if p is None else (p.group.kind, p.layer, p.expert, p.role)
        out[key] = (target, lora.delta(torch.float64), short_name(lora.a.dtype))
    return out


def _key_text(key) -> str:
    if isinstance(key, str):
        return key
    kind, layer, expert, role = key
    return f"layer {layer}" + (f" expert {expert}" if expert is not None else "") + \
        (" shared expert" if kind == "shared" else "") + f" {role}"


def verify_adapters(a_path: Path, b_path: Path, *, base=None, scheme=None) -> AdapterReport:
    """ADAPTER against ADAPTER2 (see the module docstring)."""
    import torch

    from .formats import load

    report = AdapterReport(str(a_path), str(b_path), "adapters")
    try:  # a side that names no base (a GGUF LoRA) reads with the other side's
        first = load(a_path, base)
        second = load(b_path, base, first.config)
    except AdapterError:
        second = load(b_path, base)
        first = load(a_path, base, second.config)
    ca, cb = _canonical(first, scheme), _canonical(second, scheme)
    problems = [f"{_key_text(k)}: has factors in A only ({ca[k][0]})" for k in ca if k not in cb]
    problems += [f"{_key_text(k)}: has factors in B only ({cb[k][0]})" for k in cb if k not in ca]
    identical, worst = 0, 0.0
    for k in ca:
        if k not in cb:
            continue
        (_, da, ta), (_, db, tb) = ca[k], cb[k]
        if da.shape != db.shape:
            problems.append(f"{_key_text(k)}: delta {list(da.shape)} in A, {list(db.shape)} in B")
            continue
        if torch.equal(da, db):
            identical += 1
            continue
        coarse = max((ta, tb), key=lambda t: -MANTISSA.get(t, 23))
        rel = float((da - db).abs().max() / da.abs().max().clamp(min=1e-300))
        allowed = 1e-12 if ta == tb else 4 * 2.0 ** -MANTISSA.get(coarse, 23) * math.sqrt(da.shape[-1])
        worst = max(worst, rel)
        if rel > allowed:
            problems.append(f"{_key_text(k)}: deltas differ by {rel:.3g} of their largest entry")
    line = (f"{counted(len(ca), 'projection')} receive the same delta ({identical} bit-identical, worst relative "
            f"difference {worst:.2g})")
    report.add("deltas", not problems, line if not problems else f"{counted(len(problems), 'difference')}", problems)
    return report


def looks_like(path: str) -> bool:
    """Whether a verify argument is BASE+ADAPTER (both parts exist, the whole does not)."""
    if "+" not in path or Path(path).exists():
        return False
    b, _, ad = path.rpartition("+")
    return Path(b).exists() and Path(ad).exists()


def involves_adapters(a: str, b: str) -> bool:
    """Whether ``verify A B`` is about adapters: A is BASE+ADAPTER, or either side is an adapter."""
    from .formats import is_adapter

    return looks_like(a) or is_adapter(a) or is_adapter(b)
