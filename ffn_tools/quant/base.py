"""The one interface every quantization scheme implements, and the record of one stored quantized weight.

A scheme (FP8 blocks, MXFP4, NVFP4, compressed-tensors int, GPTQ, AWQ, and the formats' own: MLX's modes,
GGUF's types) owns everything about its stored parts: finding them in a checkpoint, decoding them to the
weight they stand for, the parameters that choose verify's tolerance row, re-deriving its codes from the
other side's weight (verify's bit-level check), moving its parts through split and fuse, and saying what it
is in ``inspect``. Core code and ``verify`` talk to this interface only; ``ffn_tools.quant`` holds the
registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import LayoutError

if TYPE_CHECKING:
    import torch

    from ..layouts import GateUpLayout
    from ..plan import Entry

# What ``QuantScheme.requantized`` found: the quantized side's codes are the other side's weight quantized with
# the stored parameters ("identical"), not reproducible bit for bit but within what the scheme allows ("within":
# the tolerance row decides, with a note), or not that weight ("differs", with the sentence that says so).
IDENTICAL, WITHIN, DIFFERS = "identical", "within", "differs"
# the metadata key under which a writer records the tensors that hold a quantized source's codes (a GGUF's, an MLX
# output's safetensors metadata): its reader declares them (``Checkpoint.kept_codes``), verify proves them exactly
KEPT_KEY = "ffn_tools.codes.kept"


@dataclass(frozen=True)
class Module:
    """One weight stored quantized: the name it reads as, its scheme, its stored parts by role.

    Attributes:
        weight: the tensor's name as a decoding view presents it (``X.weight``; GPT-OSS's ``..._proj``).
        scheme: the registered scheme that stores it.
        parts: role (the stored tensor's suffix: ``weight_packed``, ``weight_scale``, ...) -> stored name.
        shape: the decoded weight's shape.
        dtype: the decoded weight's safetensors dtype.
        args: the scheme's own settings for this weight (compressed-tensors' group arguments, ...), or None.
    """

    weight: str
    scheme: "QuantScheme"
    parts: dict[str, str]
    shape: tuple[int, ...]
    dtype: str = "BF16"
    args: Any = field(default=None, compare=False)

    @property
    def base(self) -> str:
        """The module's name: ``X`` of ``X.weight``."""
        return self.weight.removesuffix(".weight")

    @property
    def params(self) -> dict:
        """``bits``, ``group_size``, ``mode``: what verify's tolerance row is chosen by."""
        return self.scheme.params(self)

    @property
    def packed(self) -> str:
        """The stored part holding the codes."""
        return self.scheme.packed_part(self)


@dataclass(frozen=True)
class IntCodes:
    """A weight stored as integer codes in groups of consecutive columns: ``w = scale * (codes - zero)`` per group
    (or, with ``bias`` in place of ``zero``, MLX's ``scale * codes + bias``), exactly, before the scheme's own
    rounding to its dtype. What a target with integer blocks (GGUF's Q4_0, Q4_1, Q8_0) keeps as they are
    (``QuantScheme.int_codes``).

    Attributes:
        codes: (rows, cols) unsigned codes, int16, in [0, 2^bits).
        zero: (rows, groups) int16 zero points on the codes' scale (2^(bits-1) for a symmetric scheme), or None.
        scale: (rows, groups) scales as stored (their dtype: bfloat16, float16 or float32).
        group_size: columns per group.
        bits: bits per code.
        bias: (rows, groups) biases as stored, where ``zero`` is None.
    """

    codes: "torch.Tensor"
    zero: "torch.Tensor | None"
    scale: "torch.Tensor"
    group_size: int
    bits: int
    bias: "torch.Tensor | None" = None

    def values(self) -> "torch.Tensor":
        """The weight in float32, computed as a GGUF block computes it: ``scale * (codes - zero)`` (exact: a scale
        of at most 16 significant bits times a code of at most 9), or ``scale * codes + bias``."""
        import torch

        g = self.group_size
        s = self.scale.to(torch.float32).repeat_interleave(g, 1)
        if self.zero is None:
            assert self.bias is not None
            return s * self.codes.to(torch.float32) + self.bias.to(torch.float32).repeat_interleave(g, 1)
        return (self.codes.to(torch.int32) - self.zero.to(torch.int32).repeat_interleave(g, 1)).to(torch.float32) * s


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4's magnitudes, codes 0..7 (8..15: the same, negative)


@dataclass(frozen=True)
class Fp4Codes:
    """A weight stored as E2M1 codes with one F8_E4M3 scale per ``group`` values and one float32 multiplier per
    tensor: ``w = e2m1 * scale * multiplier`` (NVFP4; ``QuantScheme.fp4_codes``), what GGUF's NVFP4 blocks and a
    per-tensor ``.scale`` keep as they are.

    Attributes:
        nibbles: (rows, cols) uint8 E2M1 codes 0..15 (bit 3 the sign), in column order.
        scale_bits: (rows, cols / group) uint8 F8_E4M3 bits.
        multiplier: the per-tensor float32 number ``w`` is multiplied by, or None where the scheme's per-tensor
            number is not one (compressed-tensors divides by its global scale: a multiplier only where the
            reciprocal is exact).
        group: values per scale (16).
        why: where ``multiplier`` is None, why.
        input_scale: W4A4's per-tensor float32 activation scale, as ModelOpt stores it (``input_scale``;
            compressed-tensors' ``input_global_scale`` is its reciprocal), or None where the weight has none (W4A16).
    """

    nibbles: "torch.Tensor"
    scale_bits: "torch.Tensor"
    multiplier: float | None
    group: int = 16
    why: str | None = None
    input_scale: float | None = None

    def values(self) -> "torch.Tensor":
        """``e2m1 * scale`` (exact in float32), times the multiplier, rounded once to float32: a GGUF NVFP4 block's
        value times its tensor's ``.scale``, as the GGUF reader computes it."""
        import torch

        lut = torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float32)
        scale = self.scale_bits.view(torch.float8_e4m3fn).to(torch.float32).repeat_interleave(self.group, 1)
        x = lut[self.nibbles.long()] * scale
        return x * torch.tensor(self.multiplier, dtype=torch.float32) if self.multiplier is not None else x


@dataclass(frozen=True)
class Blocks:
    """A weight stored as a format's own blocks, which no other scheme reads as codes (GGUF's K-quants, i-quants):
    what a target of the same scheme and type copies byte for byte (``QuantScheme.blocks``).

    Attributes:
        scheme: the name of the scheme whose blocks they are (``QuantScheme.name``).
        type: the block type's name in that scheme.
        rows: (rows, row bytes) uint8, each row's blocks as stored, the rows in the order the weight reads.
        block: values per block.
        multiplier: a per-tensor float32 number the blocks' values are multiplied by, or None.
        input_scale: a per-tensor activation scale stored beside them (W4A4's), or None.
    """

    scheme: str
    type: str
    rows: "torch.Tensor"
    block: int
    multiplier: float | None = None
    input_scale: float | None = None


class QuantScheme(ABC):
    """A quantization scheme: one registered object per scheme (see the module docstring).

    Attributes:
        name: its registry name ("gptq", "mlx-affine").
        label: what reports call it ("GPTQ", "compressed-tensors").
        decoded_on_read: every command reads it decoded (True); False: it is kept as stored, and only verify
            compares it decoded (FP8 blocks: convert and split move the FP8 bytes and their scales).
        moves_parts: split and fuse move its stored parts through ``split_entries``/``fuse_entries`` (False: its
            weight keeps its name and a scale beside it moves with it, as FP8 scales do: ``fp8``).
    """

    name: str = ""
    label: str = ""
    decoded_on_read: bool = True
    moves_parts: bool = True

    def find(self, ckpt) -> dict[str, Module]:
        """This scheme's modules among ``ckpt``'s stored tensors: decoded name -> Module ({} when none).

        Raises:
            CheckpointError: its tensors are there but do not fit its definition (all problems at once).
        """
        return {}

    @abstractmethod
    def decode(self, m: Module, parts: dict[str, "torch.Tensor"]) -> "torch.Tensor":
        """The weight ``m`` stands for, from its stored ``parts`` (role -> tensor), by the scheme's own definition."""

    @abstractmethod
    def params(self, m: Module) -> dict:
        """``{"bits", "group_size", "mode"}`` of ``m``."""

    def label_of(self, m: Module) -> str:
        """What reports call the scheme of ``m`` (one scheme may read two conventions: ModelOpt's NVFP4)."""
        return self.label

    def what(self, m: Module) -> str:
        """``m``'s storage in words (``int4 group 32 asymmetric (pack-quantized)``): the scheme and its settings."""
        return self.label

    def row_bits(self, params: dict) -> int:
        """The bits whose tolerance row a weight of these ``params`` gets (``tolerances.tolerance_for``)."""
        return params["bits"]

    def packed_part(self, m: Module) -> str:
        """The stored part holding ``m``'s codes."""
        return next(iter(m.parts.values()))

    def requantized(self, label: str, a: "torch.Tensor", m: Module, parts, src: str = "A",
                    q: str = "B") -> tuple[str, str | None]:
        """Is side ``q``'s stored ``parts`` of ``m`` side ``src``'s weight ``a`` quantized with ``q``'s parameters?
        ``label`` names the tensor in a sentence (``gate (X.weight)`` in an FFN, ``X.weight`` outside).

        Returns:
            (IDENTICAL, None), (WITHIN, note or None: the tolerance row decides), or (DIFFERS, sentence). The
            default, for schemes whose codes cannot be re-derived: WITHIN, with a note saying so (without one,
            verify's FFN pairs took the silence for every code re-derived and said "re-quantized").
        """
        return WITHIN, (f"{label}: {q}'s {self.label} codes are not re-derived from {src}'s values; compared within "
                        "the tolerance row")

    def int_codes(self, m: Module, parts) -> IntCodes | None:
        """``m``'s stored codes, zero points and scales as ``IntCodes`` from its stored ``parts``; None where this
        scheme's weights are not integer codes in groups of consecutive columns (floats, act-order groups)."""
        return None

    def fp4_codes(self, m: Module, parts) -> Fp4Codes | None:
        """``m``'s E2M1 codes, F8_E4M3 scales and per-tensor multiplier (NVFP4) from its stored ``parts``; None where
        this scheme's weights are not that."""
        return None

    def blocks(self, m: Module, parts) -> Blocks | None:
        """``m``'s stored blocks as ``Blocks`` from its stored ``parts``; None where this scheme has no blocks of its
        own (its codes are ``int_codes`` or ``fp4_codes``, or it stores none)."""
        return None

    def exact_values(self, m: Module, parts) -> "torch.Tensor | None":
        """The values a target that keeps ``m``'s codes holds (float32, computed as its blocks compute them:
        ``IntCodes.values``, ``Fp4Codes.values``); None where no such target keeps them exactly."""
        if (c := self.int_codes(m, parts)) is not None:
            return c.values()
        if (f := self.fp4_codes(m, parts)) is not None and f.multiplier is not None:
            return f.values()
        return None

    def requantized_note(self, m: Module, roles: list[str], src: str, q: str) -> str:
        """verify's note where every stored part of an FFN's ``roles`` is ``src``'s weight re-quantized (``m``: one
        of them)."""
        return (f"re-quantized: {src}'s {', '.join(roles)} quantized with {q}'s stored scales and zero points give "
                f"{q}'s codes, every one")

    def slice_parts(self, parts, index: int):
        """The stored ``parts`` of one expert (``index``) of a stack of them; None where this scheme's parts do
        not stack (its modules are single weights)."""
        return None

    def recast_difference(self, role: str, a: "torch.Tensor", b: "torch.Tensor") -> str | None:
        """None where ``b``, a tensor the quantized side left unquantized in a different dtype, is ``a`` cast as
        this scheme's writer casts; else the first difference (default: ``a`` cast by torch)."""
        from ..checks.diagnose import first_difference

        return first_difference(role, a.to(b.dtype), b)

    def describe(self, modules: list[Module]) -> list[dict]:
        """``inspect``'s lines for ``modules`` (all this scheme's): {dtype, scales, block, weights, ...} each."""
        return []

    def check_rewritable(self, modules: list[Module], path, command: str) -> None:
        """Refuse ``split-gateup``/``fuse-gateup`` (``command``) of a checkpoint at ``path`` holding ``modules``
        of this scheme before any work, where no command could move them as stored.

        Raises:
            FFNToolsError: naming the scheme and the conversion to run first.
        """

    def check_target(self, ckpt, base: str, m: Module) -> None:
        """The output module ``base`` of a split or fuse must be one ``ckpt``'s carried config stores as ``m`` is
        (default: any name is).

        Raises:
            LayoutError: it would not be.
        """

    def split_entries(self, m: Module, layout: "GateUpLayout", new: dict[str, str],
                      ckpt) -> dict[str, list["Entry"]]:
        """Input part name -> the entries writing gate's and up's parts when ``split-gateup`` cuts ``m``.

        Raises:
            LayoutError: no exact split of the stored parts exists.
        """
        raise LayoutError(f"{m.weight}: {self.label} weights are not split as stored; `ffn-tools convert PATH --to "
                          "torch -o DIR` dequantizes them, then split that")

    def fuse_entries(self, g: Module, u: Module, layout: "GateUpLayout", name: str, ckpt) -> list["Entry"]:
        """The entries writing the fused module ``name`` from gate's and up's stored parts.

        Raises:
            LayoutError: no exact fuse of the stored parts exists.
        """
        raise LayoutError(f"{g.weight}: {self.label} weights are not fused as stored; `ffn-tools convert PATH --to "
                          "torch -o DIR` dequantizes them, then fuse that")

    def __repr__(self) -> str:
        return f"<quantization scheme {self.name}>"


def check_pair(g: Module, u: Module) -> None:
    """Gate's and up's modules must be stored alike to be fused as stored.

    Raises:
        LayoutError: another scheme, parameters, shape or set of parts.
    """
    wg, wu = g.scheme.what(g), u.scheme.what(u)
    if g.scheme is not u.scheme or wg != wu or g.shape != u.shape or set(g.parts) != set(u.parts):
        raise LayoutError(f"cannot fuse {g.weight} ({wg}, {list(g.shape)}) with {u.weight} ({wu}, {list(u.shape)}): "
                          "gate and up need one scheme and shape")
