"""An MLX model directory seen as a Hugging Face PyTorch checkpoint (the converter surface's ``open``).

Names are mlx-lm's with ``sanitize`` undone: ``switch_mlp`` stacks (E, out, in) become per-expert tensors,
and quantized modules (``X.weight`` packed uint32 + ``X.scales`` [+ ``X.biases``: affine]) become one
``X.weight`` dequantized with ``mx.dequantize``, in the dtype they were quantized in: affine scales are in
that dtype; mxfp4/nvfp4/mxfp8 scales are 8-bit floats, so those come back in the dtype of the model's
unquantized floating tensors (``float_dtype``: export and mlx_lm.convert cast everything to one dtype before
quantizing). Unquantized tensors, experts included, keep their byte offsets, so converting them back copies
bytes and is lossless. The config loses its ``quantization``
blocks and the keys the safetensors metadata says export added for mlx-lm (``config.ADDED_KEYS``: the
transformers v4 keys, ``tie_word_embeddings``; keys the source had are kept). ``quant_params`` gives each
tensor's per-module quantization, ``quantized_parts`` its stored parts (for verify's re-quantization
check). Nothing is read until a tensor is asked for.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ffn_tools.errors import CheckpointError
from ffn_tools.io.store import Checkpoint, Format, SafetensorsCheckpoint, TensorInfo, open_checkpoint, read_bytes

from .config import restore_source_config
from .quant import RawTensor, dequantize, to_mx

if TYPE_CHECKING:
    import mlx.core as mx

QUANT_KEYS = ("quantization", "quantization_config")
# what mx.dequantize reads (affine alone has biases) -> MLX's default (group size, bits)
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
MODES = tuple(MODE_DEFAULTS)
FLOATS = ("F32", "F16", "BF16")
# Stacked experts, (E, ...) on the first axis: ``{box}.switch_mlp.{proj}`` (and ``{box}.experts.{proj}``, where
# mlx_lm keeps the name) -> ``{box}.experts.{e}.{proj}``.
STACKED = re.compile(r"(?P<box>.+)\.(?:switch_mlp|experts)\.(?P<proj>[^.]+)\.(?P<part>weight|bias|scales|biases)")
# model_type -> the checkpoint's expert projection names where they are not mlx_lm's (names.PROJECTION_ALIASES
# the other way).
EXPERT_NAMES = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                "phimoe": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                "lfm2_moe": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                "nemotron_h": {"fc1": "up_proj", "fc2": "down_proj"}}


def _params(qcfg: dict, module: str) -> dict:
    """Quantization parameters of one module: its own entry in the block, else the block's defaults.

    An own entry is what mlx_lm.load passes to the module's ``to_quantized`` as it is, so what it leaves out
    is MLX's default, not the block's: affine (GPT-OSS's mxfp4 export keeps its routers 8-bit affine with
    ``{"group_size": 64, "bits": 8}``), and that mode's group size and bits.
    """
    own = qcfg.get(module)
    if isinstance(own, dict):
        mode = own.get("mode") or "affine"
        gs, bits = MODE_DEFAULTS.get(mode, (None, None))
        return {"group_size": own.get("group_size") or gs, "bits": own.get("bits") or bits, "mode": mode}
    return {"group_size": qcfg.get("group_size"), "bits": qcfg.get("bits"), "mode": qcfg.get("mode", "affine")}


def _float_dtype(raw: Checkpoint, packed: set[str]) -> str:
    """The commonest dtype of the floating tensors stored unquantized (not in ``packed``); BF16 (what
    ``mx.dequantize`` gives without scales to go by) when there are none."""
    counts: dict[str, int] = {}
    for name in raw:
        st = raw.info(name).st_dtype
        if name not in packed and st in FLOATS:
            counts[st] = counts.get(st, 0) + 1
    return max(sorted(counts), key=counts.__getitem__, default="BF16")


class MLXCheckpoint(Checkpoint):
    """A lazy, read-only view of an MLX model directory with Hugging Face names (see the module doc)."""

    format = Format.MLX
    resolves_quantization = True

    def __init__(self, path: Path):
        raw = open_checkpoint(path)
        if not isinstance(raw, SafetensorsCheckpoint):
            raise CheckpointError(f"{path}: MLX weights are safetensors files; found {raw.format} files")
        self.raw = raw
        if raw.config is None:
            raise CheckpointError(f"{raw.root}: no config.json; an MLX model needs the config.json mlx_lm wrote "
                                  "(model_type, quantization) beside its weights")
        config = dict(raw.config)
        qcfg = config.get("quantization")
        self._recipes: dict[str, tuple] = {}
        infos: dict[str, TensorInfo] = {}
        problems: list[str] = []
        quantized = sorted(n[: -len(".scales")] for n in raw if n.endswith(".scales"))
        if quantized and not isinstance(qcfg, dict):
            raise CheckpointError(
                f"{raw.root / 'config.json'}: {len(quantized)} modules are quantized ({quantized[0]}.scales, ...) "
                "but config.json has no 'quantization' block; add the one mlx_lm.convert wrote, e.g. "
                '"quantization": {"group_size": 64, "bits": 4}')
        for m in quantized:
            if f"{m}.weight" not in raw:
                problems.append(f"{m}.scales has no {m}.weight")
        self.float_dtype = _float_dtype(raw, {f"{m}.{p}" for m in quantized for p in ("weight", "scales", "biases")})
        rename = EXPERT_NAMES.get(config.get("model_type"), {})
        for name in raw:
            module, _, part = name.rpartition(".")
            if part in ("scales", "biases") and f"{module}.scales" in raw:
                continue
            q = _params(qcfg, module) if part == "weight" and f"{module}.scales" in raw else None
            if q is not None and not self._check(module, q, problems):
                continue
            m = STACKED.fullmatch(name)
            if m and len(raw.info(name).shape) != (2 if part == "bias" else 3):
                m = None  # a stack is (E, out, in) and its bias (E, out)
            experts = range(raw.info(name).shape[0]) if m else [None]
            for e in experts:
                hf = f"{m['box']}.experts.{e}.{rename.get(m['proj'], m['proj'])}.{part}" if m else name
                infos[hf] = self._plan(hf, module, name, e, q)
        if problems:
            raise CheckpointError(f"{raw.root}: cannot read this MLX model: " + "; ".join(sorted(problems)))
        for k in QUANT_KEYS:
            config.pop(k, None)
        config = restore_source_config(config, raw.metadata)  # without the keys export added for mlx-lm
        super().__init__(raw.path, raw.root, raw.files, infos, {"format": "pt"}, config)

    def _check(self, module: str, q: dict, problems: list[str]) -> bool:
        w, s = self.raw.info(f"{module}.weight"), self.raw.info(f"{module}.scales")
        gs, bits, mode = q["group_size"], q["bits"], q["mode"]
        if mode not in MODES:
            problems.append(f"{module}: quantization mode {mode!r} is not one MLX dequantizes ({', '.join(MODES)}); "
                            "fix the 'quantization' block, or dequantize with the tool that wrote it")
            return False
        biases = f"{module}.biases" in self.raw
        if biases != (mode == "affine") or (mode != "affine" and s.st_dtype != "U8"):
            problems.append(f"{module}: mode {mode} stores "
                            + ("scales and biases" if mode == "affine" else "8-bit scales (U8) and no biases")
                            + f", but found .scales {s.st_dtype}{' and .biases' if biases else ' without .biases'}; "
                            "fix the 'quantization' block's mode")
            return False
        if not isinstance(gs, int) or not isinstance(bits, int) or w.st_dtype != "U32" or \
                w.shape[-1] * 32 % bits or s.shape[-1] * gs != w.shape[-1] * 32 // bits:
            problems.append(f"{module}: config.json quantization (group_size {gs}, bits {bits}) does not fit "
                            f"{module}.weight {w.st_dtype}{list(w.shape)} and .scales {list(s.shape)}; "
                            "fix the 'quantization' block")
            return False
        return True

    def _plan(self, hf: str, module: str, name: str, expert: int | None, q: dict | None) -> TensorInfo:
        info = self.raw.info(name)
        if q is None:  # bytes as they are: the whole tensor, or one expert's slice of the stack
            if expert is None:
                return TensorInfo(hf, info.st_dtype, info.shape, info.file, info.start)
            per = info.nbytes // info.shape[0]
            return TensorInfo(hf, info.st_dtype, info.shape[1:], info.file, info.start + expert * per)
        s = self.raw.info(f"{module}.scales")
        dtype = s.st_dtype if q["mode"] == "affine" else self.float_dtype  # the dtype it was quantized in
        self._recipes[hf] = (module, expert, q, dtype)
        shape = info.shape[1:] if expert is not None else info.shape
        return TensorInfo(hf, dtype, (*shape[:-1], shape[-1] * 32 // q["bits"]), info.file, None)

    def _part(self, name: str, expert: int | None):
        info = self.raw.info(name)
        shape, start, n = info.shape, info.start, info.nbytes
        if expert is not None:
            n //= shape[0]
            shape, start = shape[1:], start + expert * n
        return to_mx(memoryview(read_bytes(info.file, start, n)), info.st_dtype, shape)

    def decoded(self) -> list[dict]:
        """The quantized modules, grouped by mode, bits and group size (``inspect``)."""
        groups: dict[tuple, int] = {}
        for q in (recipe[2] for recipe in self._recipes.values()):
            key = (q["mode"], q["bits"], q["group_size"])
            groups[key] = groups.get(key, 0) + 1
        return [{"dtype": f"MLX {mode} {bits}-bit" + (" (with .biases)" if mode == "affine" else ""), "scales": "scales",
                 "block": [1, group], "weights": n,
                 "how": "read dequantized; verify re-quantizes A with these parameters to compare the codes"}
                for (mode, bits, group), n in sorted(groups.items())]

    def quant_params(self, name: str) -> dict | None:
        """The quantization parameters (group_size, bits, mode) tensor ``name`` was stored with, as resolved
        per module from the config's block (a module's own entry, else the block's defaults); None when it is
        stored unquantized (no ``.scales``: say a module a mixed recipe left ``false``)."""
        recipe = self._recipes.get(name)
        return dict(recipe[2]) if recipe else None

    def quantized_parts(self, name: str) -> tuple[mx.array, mx.array, mx.array | None, dict] | None:
        """The stored parts of quantized tensor ``name`` (a Hugging Face name; one expert's slice of a
        stack): (packed uint32 weight, scales, biases or None outside affine, parameters). The parameters
        are ``quant_params``' plus ``dtype``, the safetensors dtype it was quantized in (see the module doc).
        None when ``name`` is stored unquantized."""
        recipe = self._recipes.get(name)
        if recipe is None:
            return None
        module, expert, q, dtype = recipe
        w, s = (self._part(f"{module}.{p}", expert) for p in ("weight", "scales"))
        b = self._part(f"{module}.biases", expert) if q["mode"] == "affine" else None
        return w, s, b, {**q, "dtype": dtype}

    def read_raw(self, name: str) -> RawTensor:
        """A tensor's bytes without torch: dequantized, or read from its place in the file."""
        info = self._infos[name]
        if name not in self._recipes:
            raw = RawTensor(info.st_dtype, info.shape)
            raw[:] = read_bytes(info.file, info.start, info.nbytes)
            return raw
        w, s, b, q = self.quantized_parts(name)
        return dequantize(w, s, b, q["group_size"], q["bits"], q["mode"], q["dtype"])

    def _read(self, info: TensorInfo):
        return self.read_raw(info.name).to_torch()

    def close(self) -> None:
        self.raw.close()
