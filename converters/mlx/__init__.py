"""MLX format: the model directories mlx-lm reads and writes (``mlx_lm.load`` / ``mlx_lm.convert``).

    models    mlx_lm's own model class for a config, built lazily: the spec an export must meet
    names     mlx_lm's sanitize on stand-ins: which input becomes which parameter
    recipe    what ``mlx_lm.convert -q`` quantizes, by mlx_lm's rules
    tensors   one plan entry per parameter: byte copies, streamed casts and quantization
    quant     MLX's quantize/cast in row chunks; dequantize
    quantize  one weight quantized once for its parts
    workers   the quantizing worker processes, started early
    scheme    MLX's quantization modes as registered schemes (``ffn_tools.quant``)
    config    config.json as mlx_lm writes it; the keys export added
    card      the model card README.md
    exporter  ``export``: the whole directory
    view      ``open``: an MLX directory read back with Hugging Face names
    client    mlx_lm as verify's client: load check, config as ModelArgs, logits, A as mlx_lm loads it
"""

from __future__ import annotations

from pathlib import Path

from ffn_tools.errors import FFNToolsError
from ffn_tools.formats import Format, Option
from ffn_tools.mtp_option import OPTION as MTP
from ffn_tools.io.store import Checkpoint, read_config
from ffn_tools.io.readers import open_checkpoint

__all__ = ["FORMAT"]


def _older_bits(value: str) -> int:
    """-q/--quantize is mlx_lm's flag, given bare; the older ``--quantize 4`` still gives bits."""
    if value not in ("2", "3", "4", "5", "6", "8"):
        raise ValueError(f"{value!r}: -q/--quantize takes no value (bits are --q-bits); put PATH before the options, "
                         "or give it with --hf-path")
    return int(value)


class Mlx(Format):
    name, extra = "mlx", "mlx-cpu"
    options = (
        Option("quantize", "MLX only: quantize with mx.quantize, exactly the modules mlx_lm.convert -q would (default 4 "
               "bits, group size 64, affine). In this command -q is quantize, as in mlx_lm; quiet is `ffn-tools -q "
               "convert ...`.", flags=("-q", "--quantize"), optional_value=True, parse=_older_bits, metavar=""),
        Option("q_bits", "MLX: bits per weight (default: 4; mxfp8 8).", type=int, choices=(2, 3, 4, 5, 6, 8)),
        Option("q_group_size", "MLX: quantization group size (default 64 affine, 32 mxfp4/mxfp8, 16 nvfp4).",
               flags=("--q-group-size", "--group-size"), type=int, choices=(16, 32, 64, 128)),
        Option("q_mode", "MLX: quantization mode (default affine; mxfp4, nvfp4, mxfp8 are MLX's microscaling float "
               "formats).", choices=("affine", "mxfp4", "nvfp4", "mxfp8")),
        Option("quant_predicate", "MLX: one of mlx_lm's mixed-bit recipes (mixed_2_6, mixed_3_4, mixed_3_6, "
               "mixed_4_6): more bits for v_proj/down_proj of some layers and lm_head, as mlx_lm.convert."),
        Option("dequantize", "MLX: write a quantized MLX input dequantized. Without -d or -q it stays quantized, "
               "copied as it is, as mlx_lm.convert keeps it; refused with -q, as in mlx_lm.", flags=("-d", "--dequantize"),
               type=bool, excludes=("quantize",)),
        MTP)  # --mtp: the MTP heads, written beside the model (ffn_tools.mtp.HEAD_FILE) or dropped
    takes = frozenset({"dry_run", "group_size"})  # group_size: the library's older name of q_group_size
    partial_shards = True
    detect_order = 30

    def can_read(self, path: Path) -> bool:
        """A safetensors checkpoint whose metadata says "mlx", whose config has a ``quantization`` block, or
        whose names contain ``switch_mlp``. Plain Hugging Face checkpoints have none of these."""
        path = Path(path)
        try:
            if path.is_dir():
                if not any(path.glob("*.safetensors")):
                    return False
            elif not path.name.endswith((".safetensors", ".safetensors.index.json")):
                return False
            with open_checkpoint(path, absent_shards=True) as raw:  # what it is, from the shards that are here
                if raw.metadata.get("format") == "mlx" or isinstance((raw.config or {}).get("quantization"), dict):
                    return True
                return any(".switch_mlp." in n for n in raw)
        except (FFNToolsError, OSError, ValueError):
            return False

    def read(self, path: Path, absent_shards: bool = False, like: Checkpoint | None = None) -> Checkpoint:
        """An MLX model directory as a lazy Hugging Face-named view (``view``); ``absent_shards``: its index may
        name shards not on disk (``Checkpoint.absent``).

        Raises:
            CheckpointError: no config.json, quantized weights without a ``quantization`` block, or tensors
                that do not fit it.
        """
        from .view import MLXCheckpoint

        return MLXCheckpoint(Path(path), absent_shards, like=like)

    def preparing(self, ckpt: Checkpoint, **options):
        """With ``-q``, the quantizing workers started now (``workers.started_early``): a worker's start overlaps
        the conversion's checks and planning instead of following them; the export of ``ckpt`` takes them."""
        from .workers import started_early

        return started_early(ckpt, options.get("quantize") not in (None, False) and not options.get("dry_run"))

    def export(self, ckpt: Checkpoint, out: Path, **options) -> dict:
        """Write ``ckpt`` as an MLX model directory (see ``exporter.export``; mlx is imported only now, so an MLX
        directory is still recognized, and named with its extra, where mlx is not installed)."""
        from .exporter import export as run

        return run(ckpt, out, **options)

    def recipe(self, ckpt: Checkpoint, dtype: str | None, quantized: bool) -> dict | None:
        """Its dtype, or its ``quantization`` block as -q's options (the float dtype then as mlx_lm.convert
        chooses it); None for a per-layer recipe (a block with entries of its own)."""
        q = (read_config(Path(ckpt.root)) or {}).get("quantization")  # the file's: the view reads it dequantized
        if not isinstance(q, dict):
            return None if dtype is None else {"dtype": dtype}
        if any(isinstance(v, dict) for v in q.values()) or not {"bits", "group_size"} <= set(q):
            return None
        return {"quantize": True, "q_bits": q["bits"], "q_group_size": q["group_size"], "q_mode": q.get("mode")}

    runtimes = ("mlx_lm",)

    def load_runtime(self, name: str):
        from .client import MlxLm

        return MlxLm()


FORMAT = Mlx()
