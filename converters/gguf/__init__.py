"""GGUF, llama.cpp's format: read (``reader``) with Hugging Face names, and written as llama.cpp's own
converter writes it (``writer``); llama.cpp itself is its client (``client``).

Reading needs ``gguf`` (llama.cpp's gguf-py); writing also needs llama.cpp's ``convert_hf_to_gguf.py`` with
its ``conversion/`` package and vendored ``gguf-py`` (``writer.LLAMA_CPP``).
"""

from __future__ import annotations

from pathlib import Path

from ffn_tools.formats import Format, Option
from ffn_tools.io.store import Checkpoint
from ffn_tools.mtp_option import OPTION as MTP
from .kquant import FTYPES

# the package imports none of its writer or reader: the tensor writer's and quantizer's child processes
# (``native``, ``kquant``) import it first, as Python imports a module's package
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0", "auto")  # convert_hf_to_gguf.py's --outtype
OUTTYPES = (*CONVERTER_TYPES, *FTYPES)  # and llama-quantize's types, through its library

__all__ = ["FORMAT"]


class Gguf(Format):
    name, extra = "gguf", "gguf"
    options = (
        Option("outtype", "GGUF only. f32, f16, bf16, q8_0, auto: convert_hf_to_gguf.py's flag, the type of the "
               "weights (norms and other 1-D tensors stay f32); auto, the default, is bf16 for a bf16 model, else f16, "
               "and a quantized model's weights from their codes (--requantize). llama-quantize's types (q4_k_m, "
               "q5_k_m, q6_k, q3_k_m, q2_k, q4_0, iq4_xs, ...): llama.cpp's own quantizer run on the auto file, in one "
               "command.", choices=OUTTYPES, case_sensitive=False, metavar="TYPE"),
        Option("requantize", "GGUF, a quantized input: write the weights no GGUF type holds exactly as Q8_0 of their "
               "dequantized values (said per tensor). Without it a quantized input (--outtype auto) is written from "
               "its codes, each weight in the type that holds it bit for bit (int8 -> Q8_0, int4 -> Q4_0 / Q4_1), and "
               "a weight none holds is refused, named with the numbers.", type=bool),
        Option("output_tensor_type", "GGUF, with a llama-quantize --outtype: the type of output.weight, as "
               "llama-quantize's flag (q8_0, q6_k, f16, ...).", metavar="TYPE"),
        Option("token_embedding_type", "GGUF, with a llama-quantize --outtype: the type of token_embd.weight, as "
               "llama-quantize's flag.", metavar="TYPE"),
        Option("imatrix", "GGUF, with a llama-quantize --outtype: llama-imatrix's importance matrix (GGUF), as "
               "llama-quantize's flag; i-quants below 3 bits need one.", existing_file=True),
        MTP)  # --mtp: llama.cpp's --mtp / --no-mtp where the family's converter class has them, else recorded
    takes = frozenset({"dry_run"})
    detect_order = 10

    def can_read(self, path: Path) -> bool:
        """A file whose name ends in .gguf: GGUF's reader opens it, or says why it is not a GGUF it reads (a file so
        named that another format's reader took would be refused as "not a checkpoint" with no reason)."""
        path = Path(path)
        return path.suffix == ".gguf" and path.is_file()

    def read(self, path: Path, absent_shards: bool = False, like: Checkpoint | None = None) -> Checkpoint:
        """A GGUF (any part of a split one) as a lazy Hugging Face-named view.

        Raises:
            CheckpointError: not a GGUF, an architecture or tensor ffn-tools has no Hugging Face name for.
        """
        from .reader import GGUFCheckpoint  # gguf and numpy: imported only when a GGUF is read

        return GGUFCheckpoint(Path(path))

    def preparing(self, ckpt: Checkpoint, **options):
        """llama.cpp's converter process started now, importing torch and transformers while the caller checks
        the conversion; ``export`` hands it its request (``writer.warm``)."""
        from .writer import warm

        return warm((ckpt.config or {}).get("model_type"))

    def export(self, ckpt: Checkpoint, out: Path, **options) -> dict:
        """Write ``ckpt`` as a GGUF, as llama.cpp's convert_hf_to_gguf.py does (see ``writer.export``)."""
        from .writer import export as write

        return write(ckpt, out, **options)

    def recipe(self, ckpt: Checkpoint, dtype: str | None, quantized: bool) -> dict | None:
        """Its ``general.file_type`` as --outtype (None where that is not one ffn-tools writes); the default
        (codes kept) where it holds a quantized source's codes."""
        from gguf import LlamaFileType

        from ffn_tools.quant.base import KEPT_KEY

        fields = getattr(ckpt, "fields", None) or {}
        if fields.get(KEPT_KEY):
            return {}
        try:
            name = LlamaFileType(int(fields.get("general.file_type", -1))).name
        except ValueError:
            return None
        outtype = name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
        return {"outtype": outtype} if outtype in OUTTYPES else None

    runtimes = ("llama.cpp",)

    def load_runtime(self, name: str):
        from .client import LlamaCpp

        return LlamaCpp()


FORMAT = Gguf()
