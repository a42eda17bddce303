"""``merge``: a base checkpoint with an adapter folded in, W' = W + scale·B·A, streamed as every command is.

Each targeted tensor is read, the delta added in float32 and the sum rounded once to the tensor's dtype (as PEFT's
``merge_and_unload`` adds a ``target_modules`` delta; a ``target_parameters`` one it rounds to the tensor's dtype
first, then adds: the two differ by up to a rounding of the delta, which verify allows there); every other tensor is copied byte for byte by ``plan.execute`` (``copy_file_range``), the config.json,
tokenizer and side files carried. Memory: one tensor and its delta at a time, besides the adapter's factors.

Refused: a base whose targets are quantized (FP8, compressed-tensors, GPTQ/AWQ, MLX affine codes): adding a delta
to codes means dequantizing and quantizing again, which changes every weight of the tensor; ffn-tools does not do
that silently. A base that is not a PyTorch checkpoint is refused too (convert it first, or merge, then convert).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import listing
from ..io.dtypes import short_name
from ..ops import AddLowRank
from ..plan import Entry, Plan, copy_entry
from ..executor import execute
from ..io.run import NO_RUN, Run
from .conform import conform
from .model import AdapterError, Lora


BLOCK = 1 << 21  # float32 elements of the running sum at a time (8 MiB)


def _merged(ckpt, name: str, lora: Lora) -> Entry:
    info = ckpt.info(name)
    return Entry(name, info.st_dtype, info.shape, (name,), (AddLowRank(lora.a, lora.b, lora.scale, BLOCK),),
                 text=f"+ {lora.scale:g}·B·A (rank {lora.rank}), float32, rounded once")


def merge(base: Path, adapter_path: Path, out: Path, *, force: bool = False, max_shard_size: int | None = None,
          scheme=None, run: Run = NO_RUN) -> dict:
    """Write ``base`` + the adapter at ``adapter_path`` to ``out`` (see the module docstring).

    Raises:
        AdapterError / FFNToolsError: the adapter does not fit the base, a target is quantized, the base is not
            a PyTorch checkpoint, ``out`` exists without ``force``.
    """
    from .formats import load, open_checkpoint

    with open_checkpoint(base) as ckpt:
        if not ckpt.rewritable:  # Hugging Face PyTorch weights as stored, what the executor writes
            raise AdapterError(f"{base}: merge writes a PyTorch checkpoint from a PyTorch base; this is "
                               f"{ckpt.described} checkpoint: convert it to torch first (ffn-tools convert "
                               f"{base} --to torch -o BASE-torch)")
        adapter = load(adapter_path, base)
        adapter.config = adapter.config or ckpt.config
        adapter, changes = conform(adapter, {n: ckpt.info(n).shape for n in ckpt}, scheme)
        quantized = [n for n in ckpt if ckpt.quantized(n) is not None or ckpt.info(n).dtype.itemsize == 1
                     and ckpt.info(n).dtype.is_floating_point]
        if quantized or (ckpt.config or {}).get("quantization_config") or (ckpt.config or {}).get("quantization"):
            raise AdapterError(f"{base}: a quantized base ({listing(quantized, 3) or 'its config says so'}): adding "
                               "scale·B·A to quantized weights means dequantizing and quantizing them again, which "
                               "changes every weight of each; merge into the unquantized base instead")
        entries = [_merged(ckpt, n, adapter.loras[n]) if n in adapter.loras else copy_entry(ckpt, n) for n in ckpt]
        plan = Plan(ckpt, entries, ckpt.config, changes=changes, also_read=[Path(adapter_path)])
        execute(plan, run.but(out=out, force=force, max_shard_size=max_shard_size, desc="merging"))
        dtypes = sorted({short_name(ckpt.info(n).dtype) for n in adapter.loras})
    return {"merged": len(adapter.loras), "copied": len(entries) - len(adapter.loras), "dtype": "/".join(dtypes),
            "changes": changes, "adapter": str(adapter_path)}
