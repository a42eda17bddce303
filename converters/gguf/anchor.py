"""llama.cpp's own tools as ``verify --locate``'s independent floor for a GGUF B: A converted by llama.cpp's
convert_hf_to_gguf.py (for a K-quant, to its ``auto`` type and then by llama.cpp's quantizer, as ``llama-quantize``
makes one), not by ffn-tools' export, so that a defect in that export (in B and in ffn-tools' floor alike) shows.

llama.cpp exposes no activations: the anchor, like B and the floor, is read back by ffn-tools into A's format and
run in A's client, so the one step all three share is that reading (``verify A B`` proves it tensor by tensor).
"""

from __future__ import annotations

from pathlib import Path


def anchor(a: Path, recipe: dict, out: Path) -> str | None:
    """The anchor written to ``out`` (see the module docstring): its words, or None where llama.cpp's converter is
    not installed here. ``recipe``: the GGUF's convert options (``outtype``).

    Raises:
        RuntimeError: B keeps a quantized source's codes (no llama.cpp tool makes that file from A), or the
            converter or the quantizer failed (its last line).
    """
    from . import kquant, zygote
    from .source import installed_dir
    from .writer import _env, _run

    root = installed_dir()
    if root is None:
        return None
    outtype = recipe.get("outtype")
    if not outtype:
        raise RuntimeError("B keeps its source's quantized codes, which no llama.cpp tool writes from A")
    quantizing = outtype in kquant.FTYPES
    first = out.with_name(out.name + ".intermediate.gguf") if quantizing else out
    argv = [str(a), "--outfile", str(first), "--outtype", "auto" if quantizing else outtype]
    proc = zygote.script(root / "convert_hf_to_gguf.py", argv, _env())
    if proc.returncode != 0 or not first.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py: {zygote.last_line(proc)}")
    words = f"llama.cpp's convert_hf_to_gguf.py --outtype {argv[-1]}"
    if quantizing:
        try:
            _run({"input": str(first), "out": str(out), "outtype": outtype, "progress": False}, "kquant")
        finally:
            first.unlink(missing_ok=True)
        words += f", then llama.cpp's quantizer to {outtype}"
    return words
