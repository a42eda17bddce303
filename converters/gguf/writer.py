"""``convert SRC --to gguf -o OUT.gguf --outtype f32|f16|bf16|q8_0``: a GGUF exactly as llama.cpp's
convert_hf_to_gguf.py writes it, from any checkpoint ffn-tools reads.

llama.cpp's converter decides everything about a GGUF (tensor names, q/k permutation, expert stacking, which
tensors stay F32, Q8_0 blocks, metadata keys, the tokenizer and its pre-tokenizer); a second implementation of
those rules would drift from it with every release. So the writer runs the converter's own model class
(``worker``) with its tensors read from ffn-tools' view of the input: the output is bit-identical to the
converter's for a Hugging Face input, and an MLX, Meta/Mistral native or Flax input converts the same way
(quantized MLX weights are read dequantized, and the summary says so). The converter writes the header and
what no recipe makes; ``native`` writes the rest in chunks on every core, from a second process that imports
neither torch nor transformers (recipes proven against the converter's bytes first, in ``worker``). The file is written to a temporary
path beside OUT and moved into place only when complete. K-quants (Q4_K_M, ...) are llama.cpp's
``llama-quantize``'s job, run on the f16/bf16 output.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/`` from llama.cpp's source tree) is
found at ``$FFN_TOOLS_LLAMA_CPP``, else ``sys.prefix/llama.cpp`` (where the dev install puts it), else in this
user's cache, where it is fetched once from the installed llama-cpp-python's source distribution (``source``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ffn_tools import progress
from ffn_tools.errors import FFNToolsError
from ffn_tools.io.output import atomic_output
from ffn_tools.io.store import Checkpoint
from ffn_tools.sizes import human

from .source import llama_cpp_dir

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "auto")


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, outtype: str | None = None, dry_run: bool = False,
           native: bool = True) -> dict:
    """Write ``ckpt`` as the GGUF file ``out``.

    Args:
        outtype: f32, f16, bf16, q8_0 (convert_hf_to_gguf.py's), or auto (its default, and ours when None:
            the converter's own choice, bf16 for a bf16 model, f16 for an f16 or f32 one).
        dry_run: run the converter's plan (every tensor's name, type and shape) and write nothing.
        native: write the tensors a proven recipe makes in chunks (``native``), the converter the rest; False:
            the converter writes every tensor (its memory: a tensor whole, in torch and numpy).

    Returns:
        Summary: output, outtype (auto resolved), tensors, bytes, per-type counts, changes; ``plan`` with ``dry_run``.

    Raises:
        FFNToolsError: an option GGUF does not take, an architecture the converter does not know, an existing
            output (without force), llama.cpp's converter not installed.
    """
    out = Path(out)
    if dtype is not None:
        raise FFNToolsError("--dtype does not apply to --to gguf; the GGUF's type is --outtype (f32, f16, bf16, q8_0)")
    if max_shard_size is not None:
        raise FFNToolsError("--max-shard-size does not apply to --to gguf: a GGUF is one file (llama.cpp's "
                            "gguf-split splits one)")
    outtype = outtype or "auto"
    if outtype not in OUTTYPES:
        raise FFNToolsError(f"--outtype {outtype!r}: use one of {', '.join(OUTTYPES)}; K-quants (Q4_K_M, Q5_K_M, "
                            "...) are made from an f16/bf16 GGUF by llama.cpp's llama-quantize")
    if out.suffix != ".gguf":
        raise FFNToolsError(f"{out}: a GGUF output is one file named *.gguf")
    llama_cpp_dir()  # found, or fetched once, before anything is written
    dequantized = sum(1 for n in ckpt if ckpt.quantized(n))
    said = {"dequantized": dequantized, "format": ckpt.kind, "asked": outtype}
    request = {"source": str(ckpt.path), "dir_model": str(ckpt.root), "outtype": outtype, "dry_run": dry_run,
               "progress": progress.visible(), "native": native}
    if dry_run:
        result = _run({**request, "out": str(out)})  # the converter's writer in its dry-run mode writes nothing
        return _summary(out, result, said, plan=True)
    with atomic_output(out, inputs=[Path(ckpt.path)], force=force) as tmp:
        result = _run({**request, "out": str(tmp)})
        if result.get("native"):
            _run({"out": str(tmp), "tensors": result["native"], "progress": request["progress"]}, "native")
    return _summary(out, result, said, plan=False)


# module -> (what it is, in an error; the key its result always has)
MODULES = {"worker": ("llama.cpp's converter", "tensors"), "native": ("the GGUF tensor writer", "written")}


def _run(request: dict, module: str = "worker") -> dict:
    """The result of ``module`` (``worker``: the converter; ``native``: the chunked tensor writer) run on
    ``request`` in a process with llama.cpp's gguf-py; its failure as an FFNToolsError."""
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "gguf-py"), *sys.path])}
    env.pop("NO_LOCAL_GGUF", None)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(request, f)
        f.flush()
        proc = subprocess.run([sys.executable, "-m", f"ffn_tools.converters.gguf.{module}", f.name], env=env,
                              stdout=subprocess.PIPE, stderr=None if request["progress"] else subprocess.PIPE,
                              text=True)
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except ValueError:
        result = {}
    who, key = MODULES[module]
    if proc.returncode != 0 or "error" in result or key not in result:
        why = result.get("error") or (proc.stderr or "").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        if proc.returncode < 0 or proc.returncode in (130, 143):
            raise KeyboardInterrupt
        raise FFNToolsError(f"{who} could not convert this checkpoint: {why if isinstance(why, str) else why[0]}")
    return result


def _summary(out: Path, result: dict, said: dict, plan: bool) -> dict:
    """The summary of the worker's ``result``; ``said``: what the summary reports beside it (weights read
    dequantized, the --outtype asked for: auto is resolved by the converter, as its own --outtype auto)."""
    outtype, changes = result["outtype"], []
    if said["dequantized"]:
        changes.append(f"read {said['dequantized']} {said['format']}-quantized weights dequantized: the GGUF holds "
                       f"them as {outtype}, with the quantization's error")
    if said["asked"] == "auto":
        changes.append(f"--outtype auto: {outtype}, as convert_hf_to_gguf.py's auto picks it (the dtype of the "
                       "model's first bf16 or f16 weight of 2 or more dimensions; f16 when none)")
    types: dict[str, int] = {}
    for t in result["tensors"]:
        types[t["type"]] = types.get(t["type"], 0) + 1
    nbytes = sum(t["bytes"] for t in result["tensors"])
    r = {"output": str(out), "format": "gguf", "outtype": outtype, "converter": result["class"],
         "architecture": result["architecture"], "tensors": len(result["tensors"]), "bytes": nbytes,
         "types": types, "changes": changes,
         "summary": f"{'would write' if plan else 'wrote'} {out}: {len(result['tensors'])} tensors "
                    f"({', '.join(f'{k} x{v}' for k, v in sorted(types.items()))}), {human(nbytes)}, as llama.cpp's "
                    f"{result['class']} writes {result['architecture']}"}
    if plan:
        r["plan"] = [f"{t['name']:<32} {t['type']:<6} {t['shape']}" for t in result["tensors"]]
    if "native" in result:  # who wrote which tensor, and how each recipe was proven
        r["written"] = {"in_chunks": len(result["native"]), "by_converter": result["by_converter"],
                        "recipes_proven": result["proven"], "recipes_not_proven": result["unproven"],
                        "recipes_disproven": result["disproven"]}
        r["summary"] += (f"; {len(result['native'])} tensors written in chunks by ffn-tools' recipes, "
                         f"{len(result['by_converter'])} by the converter")
        if result["unproven"]:
            r["summary"] += (f" (recipes not checked against the converter's bytes here, too large to build whole:"
                             f" {', '.join(result['unproven'])})")
        if result["disproven"]:  # not a change to the output (the converter wrote them), but worth knowing
            r["summary"] += (f" (ffn-tools' recipe differs from the converter's bytes for "
                             f"{', '.join(result['disproven'])}: the converter wrote those)")
    return r
