"""An MLX model directory seen as a Hugging Face PyTorch checkpoint (the converter surface's ``open``).

Names and tensors are the source's, as transformers saves and loads them: the export's own function (mlx_lm's
model class and ``sanitize``, run on the tensors transformers' model for the source's config has) is traced back
(``inverse``). Renamed tensors (a ``language_model.`` prefix, LFM2's ``w1``) and expert stacks (``switch_mlp``,
(E, out, in)) are read back byte for byte; tensors sanitize computed by moving data (DeepSeek-V3's ``embed_q``/
``unembed_out`` from ``kv_b_proj``, conv weights turned, DBRX's flat experts, GPT-OSS's interleaved
``gate_up_proj``) are gathered back from them, exactly; constants it added (Qwen3-Next's norms ``+ 1.0``) are
taken off in the stored dtype, exact where the add was, else named in ``rounded`` (the value the MLX model
computes with; the source's low bits are gone). What sanitize dropped (a tied head, a router bias) is not there;
what cannot be traced keeps its MLX name (``inverse.refused``; every name where transformers cannot build the
model: ``inverse.skipped``), stacks unstacked per expert. ``made_from`` names the MLX tensors a tensor is read
from and ``read_stored`` reads them as mlx_lm loads them (what verify compares against A through sanitize).

Quantized modules (``X.weight`` packed uint32 + ``X.scales`` [+ ``X.biases``: affine]) are read dequantized
with ``mx.dequantize``, in the dtype they were quantized in: affine scales are in that dtype; mxfp4/nvfp4/mxfp8
scales are 8-bit floats, so those come back in the dtype of the model's unquantized floating tensors
(``float_dtype``: export and mlx_lm.convert cast everything to one dtype before quantizing). Unquantized renamed
and stacked tensors keep their byte offsets, so converting them back copies bytes. The config loses its
``quantization`` blocks and the keys the safetensors metadata says export added for mlx-lm
(``config.ADDED_KEYS``: the transformers v4 keys, ``tie_word_embeddings``; keys the source had are kept).
``quantized`` gives each tensor's per-module quantization (a gathered tensor: its MLX tensors'), under MLX's
schemes (``scheme``), ``quantized_parts`` its stored parts (for verify's re-quantization check). Nothing is read until a tensor is
asked for, but for opening: mlx_lm's and transformers' models are built lazily (meta device) and computed
tensors traced on float64 probes (``probe``).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ffn_tools import mtp
from ffn_tools.checks.rounded import PLUS_ONE
from ffn_tools.errors import CheckpointError
from ffn_tools.io.store import Checkpoint, TensorInfo, read_bytes
from ffn_tools.io.readers import SafetensorsCheckpoint, open_checkpoint
from ffn_tools.quant import Module

from .config import restore_source_config
from .inverse import Inverse, Source
from .quant import RawTensor, dequantize, to_mx
from .scheme import MODE_DEFAULTS, SCHEMES

if TYPE_CHECKING:
    import mlx.core as mx

log = logging.getLogger(__name__)
QUANT_KEYS = ("quantization", "quantization_config")
MODES = tuple(MODE_DEFAULTS)  # what mx.dequantize reads (affine alone has biases)
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
    """A lazy, read-only view of an MLX model directory with Hugging Face names (see the module doc).

    Attributes:
        inverse: how the MLX tensors trace back to the source's (``inverse.Inverse``: sources, refused, dropped).
        rounded: Hugging Face tensors read back inexactly, and why (an offset sanitize added rounded); filled as
            they are read.
    """

    kind, described = "mlx", "an MLX"
    resolves_quantization = True

    def __init__(self, path: Path, absent_shards: bool = False, like: Checkpoint | None = None):
        raw = open_checkpoint(path, absent_shards)
        if not isinstance(raw, SafetensorsCheckpoint):
            raise CheckpointError(f"{path}: MLX weights are safetensors files; found {raw.kind} files")
        self.raw = raw
        if raw.config is None:
            raise CheckpointError(f"{raw.root}: no config.json; an MLX model needs the config.json mlx_lm wrote "
                                  "(model_type, quantization) beside its weights")
        config = dict(raw.config)
        qcfg = config.get("quantization")
        self._recipes: dict[str, tuple[str, int | None, dict, str]] = {}  # name -> (module, expert, params, dtype)
        self._derived: dict[str, dict] = {}  # gathered tensor -> the quantization of MLX tensors it is read from
        self.rounded: dict[str, str] = {}
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
        self._stored: dict[str, dict | None] = {}  # MLX tensor (a quantized one by its .weight) -> its quantization
        for name in raw:
            module, _, part = name.rpartition(".")
            if part in ("scales", "biases") and f"{module}.scales" in raw:
                continue
            q = _params(qcfg, module) if isinstance(qcfg, dict) and part == "weight" and f"{module}.scales" in raw \
                else None
            if q is None or self._check(module, q, problems):
                self._stored[name] = q
        if problems:
            raise CheckpointError(f"{raw.root}: cannot read this MLX model: " + "; ".join(sorted(problems)))
        for k in QUANT_KEYS:
            config.pop(k, None)
        config = restore_source_config(config, raw.metadata)  # without the keys export added for mlx-lm
        from .inverse import SAVED_AS, plan

        self.inverse = plan({n: self._read_as(n) for n in self._stored}, config, raw.root, like,
                            raw.metadata.get(SAVED_AS))  # the experts named as the source named them
        try:
            infos = self._infos_from(config)
        except CheckpointError as e:  # a name traced back collides with one kept: read it all by MLX names
            log.info("%s: MLX names kept (%s)", raw.root, e)
            self.inverse, self._recipes, self._derived = Inverse(skipped=str(e)), {}, {}
            infos = self._infos_from(config)
        kept = {k: v for k, v in raw.metadata.items() if k in (PLUS_ONE, mtp.RECORD)}  # a GGUF's norms read back
        # (gguf.record), MTP heads dropped (--mtp drop); heads written beside the model, read under their own names
        head_file, heads = mtp.beside(raw.root)
        if collide := sorted(set(heads) & set(infos)):
            raise CheckpointError(f"{head_file}: its tensors {', '.join(collide[:3])} are the model's names too")
        super().__init__(raw.path, raw.root, [*raw.files, *([head_file] if head_file else [])], {**infos, **heads},
                         {"format": "pt", **kept}, config)
        self.absent = raw.absent

    def _infos_from(self, config: dict) -> dict[str, TensorInfo]:
        """Every tensor of the view: the source's tensors ``inverse`` traced, then the MLX tensors left, by their
        MLX names (experts unstacked).

        Raises:
            CheckpointError: an MLX tensor left would be read under a name a traced tensor has.
        """
        infos = {hf: self._source(src) for hf, src in self.inverse.sources.items()}
        self._made_from = {hf: src.outputs for hf, src in self.inverse.sources.items()}
        for name in self._stored:
            if name not in self.inverse.covered:
                for hf, expert in self._fallback(name, config):
                    if hf in infos:
                        raise CheckpointError(f"{name} would be read as {hf}, which "
                                              f"{', '.join(self._made_from[hf])} give already")
                    infos[hf], self._made_from[hf] = self._plan(hf, name, expert), (name,)
        return infos

    def _fallback(self, name: str, config: dict) -> list[tuple[str, int | None]]:
        """The names an MLX tensor no source tensor was traced to is read under: its own, or per expert
        (``STACKED``, ``EXPERT_NAMES``)."""
        m = STACKED.fullmatch(name)
        shape = self.raw.info(name).shape
        if not m or len(shape) != (2 if m["part"] == "bias" else 3):  # a stack is (E, out, in), its bias (E, out)
            return [(name, None)]
        proj = EXPERT_NAMES.get(config.get("model_type", ""), {}).get(m["proj"], m["proj"])
        return [(f"{m['box']}.experts.{e}.{proj}.{m['part']}", e) for e in range(shape[0])]

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

    def _read_as(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) of MLX tensor ``name`` as read: dequantized in the dtype it was quantized in."""
        info, q = self.raw.info(name), self._stored[name]
        if q is None:
            return tuple(info.shape), info.st_dtype
        module = name.rpartition(".")[0]
        dtype = self.raw.info(f"{module}.scales").st_dtype if q["mode"] == "affine" else self.float_dtype
        return (*info.shape[:-1], info.shape[-1] * 32 // q["bits"]), dtype

    def _plan(self, hf: str, name: str, expert: int | None) -> TensorInfo:
        """Hugging Face tensor ``hf`` as MLX tensor ``name`` (or its slice ``expert`` on the first axis)."""
        info, q = self.raw.info(name), self._stored[name]
        shape, dtype = self._read_as(name)
        shape = shape[1:] if expert is not None else shape
        if q is None:  # bytes as they are: the whole tensor, or one expert's slice of the stack
            skip = 0 if expert is None else expert * (info.nbytes // info.shape[0])
            return TensorInfo(hf, dtype, shape, info.file, _start(info) + skip)
        self._recipes[hf] = (name.rpartition(".")[0], expert, q, dtype)
        return TensorInfo(hf, dtype, shape, info.file, None)

    def _source(self, src: Source) -> TensorInfo:
        """Where Hugging Face tensor ``src.name`` is read from (``inverse.Source``)."""
        first = src.outputs[0]
        if src.kind != "gathered":
            return self._plan(src.name, first, src.expert)
        q = next((q for o in src.outputs if (q := self._stored[o]) is not None), None)
        if q is not None:
            self._derived[src.name] = q
        return TensorInfo(src.name, self._read_as(first)[1], self.inverse.shapes[src.name], self.raw.info(first).file)

    def made_from(self, name: str) -> tuple[str, ...]:
        """The MLX tensors (mlx_lm's names, a quantized one by its ``.weight``) tensor ``name`` is read from: the
        one it is renamed from or an expert of, those sanitize computed from it (``inverse``), or itself where it
        keeps its MLX name."""
        return self._made_from[name]

    def read_stored(self, name: str) -> RawTensor:
        """MLX tensor ``name`` (one of ``made_from``'s) as mlx_lm loads it, dequantized where it is quantized."""
        parts = self.stored_parts(name)
        if parts is None:
            info = self.raw.info(name)
            return RawTensor(info.st_dtype, info.shape, read_bytes(info.file, _start(info), info.nbytes))
        w, s, b, q = parts
        return dequantize(w, s, b, q["group_size"], q["bits"], q["mode"], q["dtype"])

    def stored_parts(self, name: str) -> tuple[mx.array, mx.array, mx.array | None, dict] | None:
        """``quantized_parts`` of MLX tensor ``name`` (one of ``made_from``'s); None where it is unquantized."""
        q = self._stored[name]
        return None if q is None else self._parts(name.rpartition(".")[0], None, q, self._read_as(name)[1])

    def _gather(self, name: str) -> RawTensor:
        from .probe import gather

        info, inv = self._infos[name], self.inverse
        if inv.probe is None:
            raise CheckpointError(f"{name}: not traced")  # a gathered source always is
        outputs = inv.sources[name].outputs
        raw, exact = gather(name, info.shape, info.st_dtype, inv.probe, [inv.trace(o) for o in outputs],
                            self.read_stored)
        if not exact and name not in self.rounded:
            self.rounded[name] = (f"mlx_lm's sanitize added a constant to it in {info.st_dtype}, which rounded: read "
                                  f"back from {', '.join(outputs)} it is what the MLX model computes with, and may "
                                  "differ from the source's in the low bits")
            (log.warning if len(self.rounded) == 1 else log.info)("%s: %s", name, self.rounded[name])
        return raw

    def _part(self, name: str, expert: int | None) -> mx.array:
        info = self.raw.info(name)
        shape, start, n = info.shape, _start(info), info.nbytes
        if expert is not None:
            n //= shape[0]
            shape, start = shape[1:], start + expert * n
        return to_mx(memoryview(read_bytes(info.file, start, n)), info.st_dtype, shape)

    def decoded(self) -> list[dict]:
        """The quantized modules, grouped by mode, bits and group size (``inspect``)."""
        groups: dict[tuple, int] = {}
        for q in [*(recipe[2] for recipe in self._recipes.values()), *self._derived.values()]:
            key = (q["mode"], q["bits"], q["group_size"])
            groups[key] = groups.get(key, 0) + 1
        return [{"dtype": f"MLX {mode} {bits}-bit" + (" (with .biases)" if mode == "affine" else ""), "scales": "scales",
                 "block": [1, group], "weights": n,
                 "how": "read dequantized; verify re-quantizes A with these parameters to compare the codes"}
                for (mode, bits, group), n in sorted(groups.items())]

    def quantized(self, name: str) -> Module | None:
        """How tensor ``name`` is stored: its MLX scheme and parameters (group_size, bits, mode) as resolved per
        module from the config's block (a module's own entry, else the block's defaults); None when it is stored
        unquantized (no ``.scales``: say a module a mixed recipe left ``false``). A tensor gathered from quantized
        MLX tensors has theirs (it carries their error; its parts are theirs, so ``quantized_parts`` has none)."""
        recipe = self._recipes.get(name)
        q = recipe[2] if recipe is not None else self._derived.get(name)
        if q is None:
            return None
        info = self._infos[name]
        return Module(name, SCHEMES[q["mode"]], {}, tuple(info.shape), info.st_dtype, dict(q))

    def quantized_parts(self, name: str) -> tuple[mx.array, mx.array, mx.array | None, dict] | None:
        """The stored parts of quantized tensor ``name`` (a Hugging Face name; one expert's slice of a
        stack): (packed uint32 weight, scales, biases or None outside affine, parameters). The parameters
        are ``quantized``'s plus ``dtype``, the safetensors dtype it was quantized in (see the module doc).
        None when ``name`` is stored unquantized, or gathered (its elements are in other tensors' groups)."""
        recipe = self._recipes.get(name)
        if recipe is None:
            return None
        return self._parts(*recipe)

    def _parts(self, module: str, expert: int | None, q: dict, dtype: str) -> tuple[mx.array, mx.array,
                                                                                      mx.array | None, dict]:
        w, s = (self._part(f"{module}.{p}", expert) for p in ("weight", "scales"))
        b = self._part(f"{module}.biases", expert) if q["mode"] == "affine" else None
        return w, s, b, {**q, "dtype": dtype}

    def read_raw(self, name: str) -> RawTensor:
        """A tensor's bytes without torch: dequantized, gathered, or read from its place in the file."""
        info = self._infos[name]
        if name in self.inverse.sources and self.inverse.sources[name].kind == "gathered":
            return self._gather(name)
        parts = self.quantized_parts(name)
        if parts is None:
            return RawTensor(info.st_dtype, info.shape, read_bytes(info.file, _start(info), info.nbytes))
        w, s, b, q = parts
        return dequantize(w, s, b, q["group_size"], q["bits"], q["mode"], q["dtype"])

    def _read(self, info: TensorInfo):
        return self.read_raw(info.name).to_torch()

    @property
    def stored(self) -> Checkpoint:
        """The MLX files as stored, packed weights and scales included: what mlx_lm loads."""
        return self.raw

    def carried_metadata(self) -> tuple[dict[str, str], list[str]]:
        """Nothing to carry; the line saying how the experts are named where the model has a stack of them
        (``inverse.saved_as_line``)."""
        from .inverse import SAVED_AS, saved_as_line

        inv = self.inverse
        stacks = SAVED_AS in self.raw.metadata or any(s.kind == "stack" for s in inv.sources.values())
        return {}, [saved_as_line(self.raw.metadata)] if stacks and not inv.skipped else []  # skipped: MLX names

    def rebuilt_files(self) -> tuple[dict[str, str | bytes], list[str]]:
        """The model card with transformers' labels for mlx_lm's (``card.transformers_card``), where it has them."""
        from .card import transformers_card

        card = transformers_card(self)
        if card is None:
            return {}, []
        return {"README.md": card}, ["README.md: the model card names transformers, not mlx, as its library"]

    def close(self) -> None:
        self.raw.close()


def _start(info: TensorInfo) -> int:
    """Where a stored tensor's bytes begin (safetensors always says)."""
    if info.start is None:
        raise CheckpointError(f"{info.file}: {info.name} has no byte offset")
    return info.start
