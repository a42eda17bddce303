"""A GGUF file (or a split GGUF, ``-00001-of-0000N.gguf``) seen with Hugging Face names (the converter
surface's ``open``).

Each file opens with gguf's memory-mapped ``GGUFReader`` (``header.Reader``: its header parsed up to 17 times
faster, to the same fields); nothing is read until a tensor is asked for. A
tensor is made then: its bytes are copied out of the mapping (so reading a whole model keeps one tensor
resident), F32/F16/BF16 kept as they are (bit-exact), every other type dequantized to float32 by
``gguf.quants`` (``quantized`` says which type it was stored as: ``GGUF_TYPES``, a registered scheme). q and k rows llama.cpp's converter
permuted are put back in transformers' rotary order; the stacked experts ``ffn_{gate,up,down}_exps`` read as
one tensor per expert (the names ``save_pretrained`` writes, which the converter stacked). Weights the
converter stored plus one (Gemma's norms, ``Family.plus_one``) read with the one taken off in float32:
``fl(fl(w + 1) - 1)``, which is ``w`` up to the rounding of ``w + 1`` (at most half a float32 ulp of ``w + 1``,
2**-24 for ``|w + 1| < 1``), not bit for bit; ``read_stored`` gives the stored bits, which verify compares with
``checks.rounded.plus`` of A's weight, bit for bit. The config is derived from the metadata (``config``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ffn_tools.errors import CheckpointError, listing
from ffn_tools import quant
from ffn_tools.checks.rounded import record
from ffn_tools.io.store import Checkpoint, TensorInfo
from ffn_tools.quant.base import KEPT_KEY
from ffn_tools.surgery.mapping import METADATA_KEY as EXPERT_MAP
from ffn_tools.mtp_option import RECORD

from .codes import GGUF_TYPES, TYPE_BITS
from .config import hf_config
from .names import DROPPED, FAMILIES, expert_names, family_for, hf_names, plus_one

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
LOSSLESS = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64"}


def split_files(path: Path) -> list[Path]:
    """All the files of a split GGUF, in order, given any of them; ``[path]`` for a single file.

    Raises:
        CheckpointError: a part is missing.
    """
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: a split GGUF of {n} files, but {', '.join(missing)} missing")
    return files


def field_values(reader) -> dict:
    """The metadata of a ``GGUFReader``: key -> value (arrays of strings and numbers as lists)."""
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = f.contents()
        except (ValueError, IndexError):  # a value type gguf-py cannot decode: not one the config needs
            continue
    return out


@dataclass(frozen=True)
class _Source:
    tensor: Any  # gguf's ReaderTensor
    expert: int | None  # slice of a stacked expert tensor
    heads: int | None  # rotary rows to put back in transformers' order, over this many heads
    shift: float = 0.0  # the converter stored the weight plus this
    parts: tuple = ()  # (rule, ReaderTensors): pieces ``JOINS[rule]`` puts back into one tensor (``names.Split``)


class GGUFCheckpoint(Checkpoint):
    """A lazy, read-only Hugging Face-named view of a GGUF (see the module doc)."""

    kind, described = "gguf", "a GGUF"
    resolves_quantization = True

    def __init__(self, path: Path):
        from .header import Reader

        files = split_files(path)
        for f in files:
            with open(f, "rb") as fh:
                if (magic := fh.read(4)) != b"GGUF":  # gguf-py's own error for a short file is numpy's
                    raise CheckpointError(f"{f}: not a GGUF file (it starts {magic!r}, not GGUF's magic b'GGUF')")
        try:
            self.readers = [Reader(f, "r") for f in files]
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{path}: not a GGUF file gguf can read ({e})") from None
        self.fields = field_values(self.readers[0])
        arch = self.fields.get("general.architecture")
        tensors = {t.name: t for r in self.readers for t in r.tensors}
        self._files = {t.name: f for f, r in zip(files, self.readers) for t in r.tensors}
        try:
            self.family = family_for(str(arch), tensors)
        except KeyError:
            archs = ", ".join(dict.fromkeys(f.arch for f in FAMILIES))
            raise CheckpointError(f"{path}: general.architecture {arch!r} is not one ffn-tools reads (it reads "
                                  f"{archs}; llama also for Mistral and Mixtral)") from None
        layers = int(self.fields.get(f"{self.family.arch}.block_count", 0))
        names = hf_names(self.family, layers)
        self._sources: dict[str, _Source] = {}
        self.types: dict[str, str] = {}  # HF name -> the GGUF type it is stored as
        self.shifts: dict[str, float] = {}  # HF name -> what the converter added to it (Gemma's norms: 1.0)
        infos: dict[str, TensorInfo] = {}
        unknown: list[str] = []
        heads = {"q": self.fields.get(f"{self.family.arch}.attention.head_count"),
                 "k": self.fields.get(f"{self.family.arch}.attention.head_count_kv")}
        heads["k"] = heads["k"] or heads["q"]
        joined = self._joined(path, tensors, layers, infos)
        # NVFP4's per-tensor multiplier beside its weight (X.scale: one float32, or one per expert of a stack), which
        # llama.cpp multiplies the weight's product by: read as part of the weight
        self._scales = {n.removesuffix(".scale") + ".weight": t for n, t in tensors.items()
                        if n.endswith(".scale") and n.removesuffix(".scale") + ".weight" in tensors}
        joined |= {n.removesuffix(".weight") + ".scale" for n in self._scales}
        # W4A4's activation scale beside an NVFP4 weight (X.input_scale): llama.cpp's, for its activations; no weight's
        self._input_scales = {n.removesuffix(".input_scale") + ".weight": t for n, t in tensors.items()
                              if n.endswith(".input_scale") and n.removesuffix(".input_scale") + ".weight" in tensors}
        joined |= {n.removesuffix(".weight") + ".input_scale" for n in self._input_scales}
        for gname, t in tensors.items():
            if gname in joined:
                continue
            if gname in DROPPED:
                continue
            m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", gname)
            if m and self.family.experts:
                n_exp = int(t.shape[-1])  # gguf shapes are ggml's (innermost first): experts last
                for expert, name in enumerate(expert_names(self.family, int(m[1]), m[2], n_exp)):
                    infos[name] = self._info(name, t, expert, None)
                continue
            mapped = names.get(gname)
            if mapped is None:
                unknown.append(gname)
                continue
            hf = mapped
            if hf in infos:
                unknown.append(f"{gname} (a second {hf})")
                continue
            rot = None
            if self.family.rotary and re.search(r"self_attn\.[qk]_proj\.", hf):
                rot = heads[hf.split("self_attn.")[1][0]]
            infos[hf] = self._info(hf, t, None, rot)
        if unknown:
            self.close()
            raise CheckpointError(f"{path}: {len(unknown)} tensor(s) of no Hugging Face name known for "
                                  f"{self.family.model_type}: {listing(sorted(unknown))}")
        vocab = len(self.fields.get("tokenizer.ggml.tokens") or []) or int(infos["model.embed_tokens.weight"].shape[0])
        stored = [self.types[n] for n in infos if self.types[n] in LOSSLESS]
        dtype = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(max(set(stored), key=stored.count)
                                                                             if stored else "F32", "float32")
        config = hf_config(self.fields, self.family, vocab, "lm_head.weight" not in infos, dtype)
        # an expert surgery's mapping (``surgery.mapping``: a GGUF's string key) and what --mtp did to the heads
        # (``mtp.RECORD``), read as a safetensors' metadata
        recorded = {k: v for k, v in self.fields.items() if k in (EXPERT_MAP, RECORD) and isinstance(v, str)}
        super().__init__(path, path.parent, files, infos, {"format": "gguf", **recorded}, config)
        # the tensors written from a quantized source's codes (converters/gguf/kept.py): verify demands their values
        kept = set(self.fields.get(KEPT_KEY) or ())
        self.kept_codes = frozenset(hf for hf, src in self._sources.items() if src.tensor.name in kept)

    def _joined(self, path: Path, tensors: dict, layers: int, infos: dict) -> set[str]:
        """Infos for the family's ``splits`` found whole in the GGUF (``names.Split``); the GGUF names they use."""
        used: set[str] = set()
        for split in self.family.splits:
            for layer in range(layers):
                pieces = [tensors[p] for p in (q.format(L=layer) for q in split.parts) if p in tensors]
                if len(pieces) < len(split.parts):
                    continue  # none (a layer without it) or some: those are reported as unknown
                hf = split.hf.format(L=layer)
                shapes = [tuple(int(d) for d in reversed(p.shape.tolist())) for p in pieces]
                shape = JOINS[split.rule][0](*shapes)
                if shape is None:
                    raise CheckpointError(f"{path}: {', '.join(p.name for p in pieces)} of shapes {shapes} "
                                          f"do not join into {hf} ({split.rule})")
                qtypes = [p.tensor_type.name for p in pieces]
                lossy = [q for q in qtypes if q not in LOSSLESS]
                qtype = min(lossy, key=lambda q: TYPE_BITS.get(q, 2)) if lossy else (
                    qtypes[0] if len(set(qtypes)) == 1 else "F32")  # mixed F16/BF16/F32: read as float32
                self._sources[hf] = _Source(pieces[0], None, None, parts=(split.rule, tuple(pieces)))
                self.types[hf] = qtype
                infos[hf] = TensorInfo(hf, LOSSLESS.get(qtype, "F32"), shape, self._files[pieces[0].name], None)
                used.update(p.name for p in pieces)
        return used

    def _info(self, hf: str, t, expert: int | None, heads: int | None) -> TensorInfo:
        qtype = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy order (outermost first)
        if expert is not None:
            shape = shape[1:]
        shift = 1.0 if plus_one(self.family, hf) else 0.0
        self._sources[hf] = _Source(t, expert, heads, shift)
        self.types[hf] = qtype
        if shift:
            self.shifts[hf] = shift
        st = "F32" if shift else LOSSLESS.get(qtype, "F32")  # a shifted weight reads as float32 (``_read``)
        start = None
        if qtype in LOSSLESS and heads is None and not shift:  # the bytes lie in the file as safetensors' would
            size = int(t.n_bytes) // (int(t.shape[-1]) if expert is not None else 1)
            start = int(t.data_offset) + (expert or 0) * size
        return TensorInfo(hf, st, shape, self._files[t.name], start)

    def _read(self, info: TensorInfo):
        src = self._sources[info.name]
        out = self._stored(info, src)
        if src.shift:  # float32 (the converter stores such weights F32): fl(stored - shift), see the module doc
            out = out.float() - src.shift
        return out

    def read_stored(self, name: str):
        """Tensor ``name`` as the GGUF stores it (dequantized where quantized): for a weight the converter
        stored plus one (``shifts``), with the one; else what ``self[name]`` reads."""
        info = self.info(name)
        return self._stored(info, self._sources[name])

    def _stored(self, info: TensorInfo, src: _Source):
        if src.parts:
            rule, pieces = src.parts
            out = JOINS[rule][1](*(self._tensor(p, None) for p in pieces))
            if tuple(out.shape) != tuple(info.shape):
                raise CheckpointError(f"{info.name}: joined as {list(out.shape)}, expected {list(info.shape)}")
            return out
        out = self._tensor(src.tensor, src.expert)
        if src.heads:
            out = rotary_to_hf(out, src.heads)
        return out

    def _tensor(self, t, expert: int | None):
        """A GGUF tensor (one expert of a stacked one) in numpy order: F32/F16/BF16 as stored, else dequantized."""
        import torch
        from gguf import GGMLQuantizationType, quants

        shape = tuple(int(d) for d in reversed(t.shape.tolist()))[1 if expert is not None else 0:]
        data = t.data if expert is None else t.data[expert]
        qtype = t.tensor_type
        if qtype == GGMLQuantizationType.BF16:
            arr = np.array(data).view(np.uint16).reshape(shape)
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        if qtype.name in LOSSLESS:
            return torch.from_numpy(np.array(data).reshape(shape))
        out = np.ascontiguousarray(quants.dequantize(np.asarray(data), qtype), dtype=np.float32).reshape(shape)
        if (scale := self._scales.get(t.name)) is not None:  # float32, as llama.cpp multiplies (one rounding)
            out = out * np.asarray(scale.data, np.float32).reshape(-1)[expert or 0]
        return torch.from_numpy(out)

    def read_raw(self, name: str):
        from ffn_tools.io.raw import RawTensor

        info = self.info(name)
        if info.start is None:
            return RawTensor.of(self[name])
        src = self._sources[name]
        data = src.tensor.data if src.expert is None else src.tensor.data[src.expert]
        return RawTensor(info.st_dtype, info.shape, np.ascontiguousarray(data).tobytes())

    def quantized(self, name: str):
        """How tensor ``name`` is stored when not as it reads: its GGUF type (``GGUF_TYPES``)."""
        qtype = self.types[name]
        if qtype in LOSSLESS:
            return None
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]
        info = self.info(name)
        return quant.Module(name, GGUF_TYPES, {}, tuple(info.shape), info.st_dtype,
                            {"bits": TYPE_BITS.get(qtype, 2), "group_size": block, "mode": qtype})

    def quantized_parts(self, name: str):
        """Quantized tensor ``name``'s stored parts (``codes``): ``blocks``, its rows of blocks as stored, in the
        order the weight reads (q/k rows put back in transformers' order; one expert of a stack), and ``scale``,
        an NVFP4 weight's per-tensor multiplier where it has one, and ``input_scale``, W4A4's activation scale;
        None where it is stored as it reads, or joined from pieces (no one stored tensor holds it). ``blocks`` is
        a read-only view of the mapped file (nothing is read until used: a GGUF's types are chosen from shapes),
        a copy only where q/k rows are put back in order."""
        import warnings

        import torch

        src = self._sources.get(name)
        if src is None or self.types[name] in LOSSLESS or src.parts or src.shift:
            return None
        data = src.tensor.data if src.expert is None else src.tensor.data[src.expert]
        shape = self.info(name).shape
        with warnings.catch_warnings():  # the mapping is read-only, and nothing writes into these rows
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.from_numpy(np.asarray(data).reshape(math.prod(shape[:-1]), -1))
        if src.heads:
            rows = rotary_to_hf(rows, src.heads)
        parts = {"blocks": rows}
        for role, of in (("scale", self._scales), ("input_scale", self._input_scales)):
            if (t := of.get(src.tensor.name)) is not None:
                parts[role] = torch.tensor(float(np.asarray(t.data, np.float32).reshape(-1)[src.expert or 0]))
        return parts

    def carried_metadata(self) -> tuple[dict[str, str], list[str]]:
        """The weights this GGUF stores plus one (``shifts``), recorded for verify against the source of an export
        (``checks.rounded``)."""
        return record(self.shifts)

    def rebuilt_files(self) -> tuple[dict[str, str | bytes], list[str]]:
        """The tokenizer files and generation_config.json rebuilt from the metadata (``sidefiles``)."""
        from .sidefiles import side_files  # transformers: imported only when a GGUF is converted

        return side_files(self)

    @property
    def label(self) -> str:
        kinds = sorted({q for q in self.types.values() if q not in LOSSLESS})
        return "gguf" + (f", {'/'.join(kinds)} read dequantized" if kinds else "")

    def decoded(self) -> list[dict]:
        counts: dict[str, int] = {}
        for q in self.types.values():
            if q not in LOSSLESS:
                counts[q] = counts.get(q, 0) + 1
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        return [{"dtype": q, "scales": "scale", "block": [1, GGML_QUANT_SIZES[GGMLQuantizationType[q]][0]], "weights": n,
                 "how": "read dequantized by gguf.quants; split, fuse and extract write it dequantized"}
                for q, n in counts.items()]

    def close(self) -> None:
        self.readers = []


def rotary_to_hf(w, heads: int):
    """q/k rows from llama.cpp's rotary order back to transformers' (the inverse of the converter's
    ``LlamaModel.permute``): a pure reordering of rows; 1-D biases likewise."""
    rows = w.shape[0]
    rest = tuple(w.shape[1:])
    return w.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def mla_kv_b_shape(k_b: tuple, v_b: tuple) -> tuple | None:
    """kv_b_proj's shape (H*(nope+v), kv_lora) from k_b's (H, kv_lora, nope) and v_b's (H, v, kv_lora), or None
    when they are not two halves of one kv_b_proj."""
    if len(k_b) != 3 or len(v_b) != 3 or k_b[0] != v_b[0] or k_b[1] != v_b[2]:
        return None
    return (k_b[0] * (k_b[2] + v_b[1]), k_b[1])


def mla_kv_b(k_b, v_b):
    """kv_b_proj from llama.cpp's k_b and v_b: the converter viewed kv_b_proj as (H, nope+v, kv_lora), split
    each head's rows into k (nope) and v, and transposed k (MLA absorption); undone here, a pure reordering
    (bit-exact)."""
    import torch

    heads, rank, nope = k_b.shape  # (H, kv_lora, nope)
    if k_b.dtype != v_b.dtype:  # one piece quantized (read as float32), the other not: both float32
        k_b, v_b = k_b.float(), v_b.float()
    kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # (H, nope+v, kv_lora)
    return kv.reshape(heads * kv.shape[1], rank).contiguous()


# names.Split.rule -> (the joined shape from the pieces' shapes, the join of the pieces' tensors)
JOINS = {"mla_kv_b": (mla_kv_b_shape, mla_kv_b)}
