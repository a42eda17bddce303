"""Expert surgery of a GGUF file: each MoE layer's stacked experts and router rows sliced as stored bytes.

A GGUF holds a layer's routed experts stacked, the expert dimension outermost (``blk.N.ffn_{gate,up,down}_exps.*``,
ne ``[.., .., E]``), so each expert is one contiguous slab of ``n_bytes / E`` bytes whatever its quant type (Q8_0,
K-quants, i-quants, MXFP4, F16 ...): the kept experts' slabs are copied in their new order, never decoded. The
router's rows (``ffn_gate_inp.weight``/``.bias``, DeepSeek's ``exp_probs_b.bias``: ne ``[.., E]`` or ``[E]``) move
the same way, in step. ``{arch}.expert_count`` is set to the kept count (``{arch}.expert_used_count`` above it is
refused, as is grouped routing that the kept count does not divide), the mapping new -> source expert recorded as
the string ``mapping.METADATA_KEY`` (composed with one the input records), and every other key, tensor and byte
is copied as the input holds it: the header is rewritten from the input's own field and tensor-info bytes, the
tensors laid out in input order at the file's alignment, so keeping every expert in order writes the input back
byte for byte.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FFNToolsError
from . import mapping
from .selection import chosen

# a layer's tensors holding one slab per routed expert: the stacks, the router and its biases (not the shared
# expert's ``ffn_gate_inp_shexp``, nor ``_shexp`` stacks)
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.(ffn_[a-z_]+_exps|ffn_gate_inp|exp_probs_b)\.[a-z_]+$")
STACK = re.compile(r"^blk\.(\d+)\.ffn_[a-z_]+_exps\.")
HEADER = 24  # magic, version, tensor count, kv count


def _field_bytes(r, f) -> bytes:
    size = sum(p.nbytes for p in f.parts)
    return bytes(r.data[f.offset:f.offset + size])


def _string_field(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return (np.uint64(len(k)).tobytes() + k + np.uint32(8).tobytes()  # GGUFValueType.STRING
            + np.uint64(len(v)).tobytes() + v)


def _uint(f) -> int:
    return int(f.parts[f.data[0]][0])


def layers_of(r) -> tuple[dict[int, list], int]:
    """The MoE layers of the GGUF ``r`` (a ``header.Reader``): layer -> its expert tensors, and E.

    Raises:
        FFNToolsError: no ``_exps`` stack, no ``expert_count``, a tensor whose outermost dim is not E or whose
            bytes are not E slabs.
    """
    arch = str(r.fields["general.architecture"].contents())
    count = r.fields.get(f"{arch}.expert_count")
    by_layer: dict[int, list] = {}
    for t in r.tensors:
        if (m := EXPERT_TENSOR.match(t.name)) is not None:
            by_layer.setdefault(int(m.group(1)), []).append(t)
    by_layer = {k: v for k, v in by_layer.items() if any(STACK.match(t.name) for t in v)}
    if not by_layer:
        raise FFNToolsError("no routed experts (no blk.N.ffn_*_exps tensors): nothing to prune")
    if count is None:
        raise FFNToolsError(f"the GGUF has expert stacks but no {arch}.expert_count")
    experts = _uint(count)
    for ts in by_layer.values():
        for t in ts:
            if int(t.shape[-1]) != experts or t.n_bytes % experts:
                raise FFNToolsError(f"{t.name}: shape {[int(d) for d in t.shape]} ({t.tensor_type.name}, "
                                    f"{t.n_bytes} bytes): not {experts} experts (outermost) of equal bytes")
    return by_layer, experts


def _checked_counts(r, arch: str, experts: int, kept: int) -> list[str]:
    """Refuse a kept count the runtime cannot route with; what the metadata's counts become."""
    used = r.fields.get(f"{arch}.expert_used_count")
    if used is not None and _uint(used) > kept:
        raise FFNToolsError(f"{arch}.expert_used_count is {_uint(used)}: every token runs {_uint(used)} experts, more "
                            f"than the {kept} kept; keep at least that many")
    groups = r.fields.get(f"{arch}.expert_group_count")
    if groups is not None and _uint(groups) > 1 and kept != experts:
        g = _uint(groups)
        if kept % g or kept // g < 2:
            raise FFNToolsError(f"{arch}.expert_group_count is {g} (grouped routing): {kept} experts kept do not "
                                f"divide into {g} groups of at least 2")
    return [f"{arch}.expert_count {experts} -> {kept}"] if kept != experts else []


def prune_gguf(r, path: Path, tmp: Path | None, spec: dict, command: str, prior: dict | None) -> dict:
    """Write the GGUF ``path`` (``r``: its ``header.Reader``) with each MoE layer's experts chosen by ``spec``
    (``selection.chosen``'s options, new order) to the file ``tmp`` (module doc; None: check and plan it, write
    nothing); ``prior``: the mapping the input records (``mapping.recorded``), composed with the new one.

    Returns:
        experts (E), kept, layers (the recorded mapping's), picked (layer -> the input's experts kept, in their
        new order), changes, tensors (written), sliced (how many were cut), identity (every expert kept in order:
        the input written back), moe_layers, moved (experts at another index).

    Raises:
        FFNToolsError: as ``layers_of`` and ``selection.chosen``; a kept count the metadata's routing cannot run
            (``expert_used_count`` above it, groups it does not divide).
    """
    if r.byte_order != "I":
        raise FFNToolsError(f"{path}: a GGUF in the other byte order: expert surgery reads little-endian files")
    arch = str(r.fields["general.architecture"].contents())
    try:
        layers, experts = layers_of(r)
    except FFNToolsError as e:
        raise FFNToolsError(f"{path}: {e}") from None
    picked = chosen({k: experts for k in layers}, **spec)
    kept = len(next(iter(picked.values())))
    identity = all(v == tuple(range(experts)) for v in picked.values())
    changes = _checked_counts(r, arch, experts, kept)
    full, source_experts = mapping.composed(prior, picked)
    kept_map = mapping.as_json(full, source_experts or experts, command)
    fields = [f for k, f in r.fields.items() if not k.startswith("GGUF.")]
    out_fields = []
    for f in fields:
        if f.name == f"{arch}.expert_count" and kept != experts:
            value = f.parts[f.data[0]]
            size = sum(p.nbytes for p in f.parts) - value.nbytes
            out_fields.append(_field_bytes(r, f)[:size] + np.array([kept], dtype=value.dtype).tobytes())
        elif f.name == mapping.METADATA_KEY and not identity:  # (prior: the same key, read by the checkpoint)
            out_fields.append(_string_field(f.name, json.dumps(kept_map)))
        else:
            out_fields.append(_field_bytes(r, f))
    if not identity and prior is None:
        out_fields.append(_string_field(mapping.METADATA_KEY, json.dumps(kept_map)))
        changes.append(f"metadata {mapping.METADATA_KEY}: each layer's experts, new index -> source index")
    align = r.alignment
    pieces: list[tuple[Any, list[tuple[int, int]]]] = []  # tensor, the runs of input bytes it is made of
    sliced = 0
    for t in r.tensors:
        m = EXPERT_TENSOR.match(t.name)
        keep = picked.get(int(m.group(1))) if m and int(m.group(1)) in layers else None
        if keep is None or keep == tuple(range(experts)):
            pieces.append((t, [(t.data_offset, t.n_bytes)]))
        else:
            slab = t.n_bytes // experts
            pieces.append((t, [(t.data_offset + e * slab, slab) for e in keep]))
            sliced += 1
    infos, at = [], 0
    for t, runs in pieces:
        f = t.field  # name length, name, n_dims, dims, type, offset
        dims = f.parts[3].copy()
        if sum(n for _, n in runs) != t.n_bytes:
            dims[-1] = kept
        infos.append(b"".join(bytes(p.tobytes()) for p in f.parts[:3]) + dims.tobytes() + f.parts[4].tobytes()
                     + np.array([at], dtype=f.parts[5].dtype).tobytes())
        at += -(-sum(n for _, n in runs) // align) * align
    if tmp is not None:
        _write(r, tmp, out_fields, infos, pieces)
    return {"experts": experts, "kept": kept, "layers": kept_map["layers"], "changes": changes,
            "tensors": len(pieces), "sliced": sliced, "identity": identity, "moe_layers": len(layers),
            "picked": picked, "moved": sum(1 for v in picked.values() for new, src in enumerate(v) if new != src)}


def _write(r, tmp: Path, out_fields: list[bytes], infos: list[bytes], pieces: list) -> None:
    align = r.alignment
    head = bytearray(r.data[:HEADER])
    head[16:24] = np.uint64(len(out_fields)).tobytes()
    with open(tmp, "wb") as out:
        out.write(head)
        for b in (*out_fields, *infos):
            out.write(b)
        out.write(b"\0" * (-out.tell() % align))
        for t, runs in pieces:
            n = 0
            for start, size in runs:
                out.write(r.data[start:start + size])
                n += size
            out.write(b"\0" * (-n % align))
