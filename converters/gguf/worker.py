"""The process that writes a GGUF: llama.cpp's own model class, fed from an ffn-tools checkpoint view.

Run by ``writer`` as ``python -m ffn_tools.converters.gguf.worker REQUEST.json`` with llama.cpp's
``conversion/`` package and its vendored ``gguf-py`` first on the path: the converter needs that gguf-py (newer
than the released ``gguf`` package it shares a name with), so it runs in a process of its own. The converter's
class does everything convert_hf_to_gguf.py does (names, q/k permutation, expert stacking, the type of each
tensor, quantization, metadata, tokenizer); only where its tensors come from is replaced: ``index_tensors``
yields each tensor of the view lazily (read when the writer reaches it), so any format ffn-tools reads
converts, and memory stays about one tensor. Prints one JSON line: the tensors written (or planned, with
``dry_run``), or ``{"error": ...}``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

FTYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


def model_class(ckpt):
    """The converter's class for the view, and its own base (for its lazy tensor type)."""
    import conversion
    from conversion import ModelType, get_model_architecture, get_model_class
    from conversion.base import LazyTorchTensor

    arch = get_model_architecture(dict(ckpt.config or {}), ModelType.TEXT)
    base = get_model_class(arch)

    class FromView(base):  # type: ignore[valid-type, misc]
        """The converter's class, its tensors read from the view."""

        model_arch = base.model_arch  # the converter's classes must each name it

        def index_tensors(self, remote_hf_model_id=None):
            tensors = {}
            for name in ckpt:
                info = ckpt.info(name)
                meta = LazyTorchTensor.meta_with_dtype_and_shape(info.dtype, tuple(info.shape))
                gen = (lambda n=name, m=meta: LazyTorchTensor(meta=m, args=(n,), func=lambda x: ckpt[x]))
                if item := self.filter_tensors((name, gen)):
                    tensors[item[0]] = item[1]
            return tensors

    del conversion
    return FromView, arch


def run(request: dict) -> dict:
    import gguf
    import torch

    from ffn_tools.converters import open_any

    logging.getLogger("hf-to-gguf").setLevel(logging.WARNING)
    with open_any(request["source"]) as ckpt, torch.inference_mode():
        cls, arch = model_class(ckpt)
        out = Path(request["out"])
        model = cls(Path(request["dir_model"]), getattr(gguf.LlamaFileType, FTYPES[request["outtype"]]), out,
                    hparams=dict(ckpt.config or {}), dry_run=request["dry_run"])
        model.prepare_tensors()
        tensors = [{"name": n, "type": t.dtype.name, "shape": [int(d) for d in reversed(t.shape)], "bytes": t.nbytes}
                   for n, t in model.gguf_writer.tensors[0].items()]
        if not request["dry_run"]:
            model.prepare_metadata(vocab_only=False)
            model.gguf_writer.write_header_to_file(path=out)
            model.gguf_writer.write_kv_data_to_file()
            model.gguf_writer.write_tensors_to_file(progress=request["progress"])
            model.gguf_writer.close()
        return {"architecture": arch, "class": cls.__mro__[1].__name__, "tensors": tensors}


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    try:
        result = run(request)
    except Exception as e:  # noqa: BLE001 - the converter's own refusals (NotImplementedError, ValueError, ...)
        print(json.dumps({"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}))
        sys.exit(1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
