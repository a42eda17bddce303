"""What each side of ``verify`` holds: its FFNs under its naming scheme, its description in the report, and the
selection compared (``--layers``/``--experts``, or what an FFN-only extract's manifest records)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..detect import FFNSet, choose_scheme, find_ffns
from ..errors import FFNToolsError, SchemeError
from ..ffn import FFN, FFNRef
from ..io.dtypes import short_name
from ..layouts import GateUpLayout
from ..registry import Scheme, compile_template
from ..specs import spans
from . import partial
from .quant import describe_quantization, quantization

if TYPE_CHECKING:
    from .report import VerifyReport

log = logging.getLogger(__name__)


def find(ckpt, side: str, scheme: Scheme | None, layout: GateUpLayout | None,
          selection: tuple[set | None, set | None] = (None, None)) -> tuple[FFNSet | None, str | None]:
    """A's (or B's) FFNs, or (None, problem) when its FFN tensors exist but are inconsistent.

    A given ``scheme`` applies where it matches: a checkpoint none of whose tensor names fit it (say an
    extract output compared with a custom-named original) is detected as usual. On a checkpoint with shards
    absent only the ``selection``'s (layers, experts) FFN tensors are searched (``partial.search_names``).

    Raises:
        SchemeError: no FFN tensors at all (nothing to verify: a usage problem, not a difference).
    """
    names = list(ckpt)
    if scheme is not None and not any(compile_template(t).fullmatch(n) for g in scheme.groups
                                      for f in g.forms.values() for t in f.templates().values() for n in names):
        log.info("%s: no tensor matches scheme %r; detecting its scheme", side, scheme.name)
        scheme = None
    try:
        scheme = scheme or choose_scheme(names, ckpt.config)
    except SchemeError as e:
        raise SchemeError(f"{side}: {e}") from None
    search = partial.search_names(ckpt, scheme, *selection) if ckpt.stored.absent else None
    try:
        return find_ffns(ckpt, scheme, layout, search), None
    except SchemeError as e:
        return None, f"{side}'s FFN tensors are inconsistent: {e}"


def describe_side(ckpt, ffns: FFNSet | None) -> dict:
    q = quantization(ckpt)
    dtype = short_name(ckpt.info(ffns.ffns[0].names["down"]).dtype) if ffns and ffns.ffns else None
    return {"path": str(ckpt.path), "format": ckpt.label, "scheme": ffns.scheme.name if ffns else None,
            "dtype": dtype, "activation": ffns.activation.describe() if ffns else None,
            "quantization": describe_quantization(q) if q else None,
            "ffns": len(ffns.ffns) if ffns else 0, "absent_shards": list(ckpt.stored.absent)}


def select(ffns: FFNSet, layers: set[int] | None, experts: set[int] | None) -> dict[FFNRef, FFN]:
    return {r: f for r, f in ffns.by_ref().items() if (layers is None or r.layer in layers)
            and (experts is None or r.kind != "expert" or r.expert in experts)}


def extract_selection(report: VerifyReport, ca, cb, fa: FFNSet, fb: FFNSet) -> tuple[set | None, set | None]:
    """The selection an extract output's manifest records (``extract --layers 1``), applied to the other side:
    what was not extracted is not missing. None, None where neither side is a partial extract."""
    for side, ckpt, found, other in (("A", ca, fa, fb), ("B", cb, fb, fa)):
        manifest = read_manifest(ckpt) if found.scheme.name == "ffn-tools" else None
        if not isinstance(manifest, dict):
            continue
        layers, experts = set(manifest.get("layers") or ()), set(manifest.get("experts") or ())
        refs = [f.ref for f in other.ffns]
        sel_layers = layers if {r.layer for r in refs} - layers else None
        sel_experts = experts if {r.expert for r in refs if r.kind == "expert"} - experts else None
        if sel_layers is None and sel_experts is None:
            return None, None
        what = "; ".join(f"{k} {spans(v)}" for k, v in (("layers", sel_layers), ("experts", sel_experts)) if v)
        report.notes.append(f"{side} is an extract of {what} (its manifest): only those FFNs are compared")
        return sel_layers, sel_experts
    return None, None


def read_manifest(ckpt) -> dict | None:
    """An extract's manifest: in its config.json (a directory), or OUT.json beside a single file."""
    if "ffn_tools_manifest" in (ckpt.config or {}):
        return ckpt.config["ffn_tools_manifest"]
    beside = Path(ckpt.path).with_suffix(".json")
    try:
        return json.loads(beside.read_text()) if Path(ckpt.path).suffix == ".safetensors" else None
    except (OSError, ValueError):
        return None


def extracts(fa: FFNSet | None, fb: FFNSet | None) -> str | None:
    """Which side is an FFN-only extract output, said as a reason; None when neither is."""
    extracts = [s for s, f in (("A", fa), ("B", fb)) if f and f.scheme.name == "ffn-tools"]
    if not extracts:
        return None
    return f"{' and '.join(extracts)} {'is an' if len(extracts) == 1 else 'are'} FFN-only extract output"


def check_selection(fa: FFNSet, fb: FFNSet, sel_layers: set[int] | None, sel_experts: set[int] | None) -> None:
    """Refuse layers or experts asked for that neither checkpoint has (a typo would otherwise pass quietly,
    checking less than was asked).

    Raises:
        FFNToolsError: naming the missing ones and what A and B do have.
    """
    refs = [f.ref for f in (*fa.ffns, *fb.ffns)]
    problems = []
    for option, sel, have, what in (
            ("--layers", sel_layers, {r.layer for r in refs}, "layer"),
            ("--experts", sel_experts, {r.expert for r in refs if r.kind == "expert"}, "expert")):
        missing = sel - have if sel is not None else set()
        if missing:
            held = (f"they have {what}s {spans(have)}" if have else f"they have no routed {what}s")
            problems.append(f"{option} {spans(sel)}: {what}{'s' * (len(missing) > 1)} {spans(missing)} "
                            f"in neither A nor B ({held})")
    if problems:
        raise FFNToolsError("; ".join(problems))
