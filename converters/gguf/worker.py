"""The process that writes a GGUF: llama.cpp's own model class, fed from an ffn-tools checkpoint view.

Run by ``writer`` in a child of ``python -m ffn_tools.converters.gguf.worker --zygote`` (``zygote``: its imports
made once for every conversion of the process; ``converters/gguf/zygote.py``), with llama.cpp's ``conversion/``
package and its vendored ``gguf-py`` first on the path: the converter needs that gguf-py (newer than the released
``gguf`` package it shares a name with), so it runs in a process of its own. The converter's
class does everything convert_hf_to_gguf.py does (names, q/k permutation, expert stacking, the type of each
tensor, quantization, metadata, tokenizer); only where its tensors come from is replaced: ``index_tensors``
yields each tensor of the view lazily (read when the writer reaches it), so any format ffn-tools reads
converts, and memory stays about one tensor. Prints one JSON line: the tensors written (or planned, with
``dry_run``), or ``{"error": ...}``.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import sys
from pathlib import Path

# --outtype -> the converter's gguf.LlamaFileType (convert_hf_to_gguf.py's ftype_map); auto is its GUESSED, which
# the model class resolves when built (ModelBase.__init__: the dtype of the first 2-D+ bf16/f16 tensor, else f16)
FTYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "auto": "GUESSED"}


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
            # the converter's order: its parts by file name, each part's tensors by name (SafetensorsLocal)
            for name in sorted(ckpt, key=lambda n: (ckpt.info(n).file.name, n)):
                info = ckpt.info(name)
                meta = LazyTorchTensor.meta_with_dtype_and_shape(info.dtype, tuple(info.shape))
                gen = (lambda n=name, m=meta: LazyTorchTensor(meta=m, args=(n,), func=lambda x: ckpt[x]))
                if item := self.filter_tensors((name, gen)):
                    tensors[item[0]] = item[1]
            return tensors

    del conversion
    return FromView, arch


def _pre_fallback(cls, pre: str | None) -> list:
    """Where the converter's ``get_vocab_base_pre`` does not recognise a BPE tokenizer's pre-tokenizer by its
    encodings, ``pre`` (the source GGUF's ``tokenizer.ggml.pre``: the tokenizer was rebuilt from its tokens and
    merges) rather than its refusal; the list returned gets an item when that happens. Nothing changes without
    ``pre``, or where the converter recognises it."""
    used: list = []
    own = getattr(cls, "get_vocab_base_pre", None)
    if pre and own is not None:
        def fallback(self, tokenizer):
            try:
                return own(self, tokenizer)
            except NotImplementedError as e:
                if "not recognized" not in str(e):
                    raise
                used.append(pre)
                return pre

        cls.get_vocab_base_pre = fallback  # ``model_class``'s subclass, made for this conversion
    return used


def _token_types_as_source(writer, fields: dict) -> list[int]:
    """Where the converter wrote the source GGUF's own tokens (``fields``: a tokenizer rebuilt from them) but other
    token types (transformers' reader makes the GGUF's pad token a special token, which the converter writes as
    CONTROL: llama.cpp would then drop an ordinary "!" from what it decodes), the source's types; the ids
    changed back (empty: none)."""
    kv = writer.kv_data[0]
    ours, theirs = kv.get("tokenizer.ggml.token_type"), fields.get("tokenizer.ggml.token_type")
    tokens = kv.get("tokenizer.ggml.tokens")
    if ours is None or theirs is None or tokens is None or list(tokens.value) != list(fields.get(
            "tokenizer.ggml.tokens") or []) or len(ours.value) != len(theirs):
        return []
    changed = [i for i, (x, y) in enumerate(zip(ours.value, theirs)) if int(x) != int(y)]
    if changed:
        kv["tokenizer.ggml.token_type"] = type(ours)(value=[int(t) for t in theirs], type=ours.type,
                                                     sub_type=ours.sub_type)
    return changed


def run(request: dict) -> dict:
    import gguf
    import torch

    from ffn_tools.converters import open_any

    from ffn_tools import quant

    from . import heads as mtp_heads

    logging.getLogger("hf-to-gguf").setLevel(logging.WARNING)
    with open_any(request["source"]) as opened, torch.inference_mode():
        # from codes: every quantized weight read decoded (FP8 blocks too), the kept ones replaced after
        ckpt = quant.decoded(opened, every=True) if request.get("codes") else opened
        hparams = dict(ckpt.config or {})
        if not quant.find(ckpt, every=True):  # the view decodes them all: the converter sees plain weights, and
            hparams.pop("quantization_config", None)  # its own dequantization (which asserts on some) must not run
        cls, arch = model_class(ckpt)
        heads = mtp_heads.set_class(cls, request.get("mtp"))
        source = getattr(opened, "fields", None) if request.get("rebuilt") else None  # a GGUF's tokenizer, rebuilt
        carried = _pre_fallback(cls, (source or {}).get("tokenizer.ggml.pre"))
        out = Path(request["out"])
        model = cls(Path(request["dir_model"]), getattr(gguf.LlamaFileType, FTYPES[request["outtype"]]), out,
                    hparams=hparams, dry_run=request["dry_run"])
        model.prepare_tensors()
        chosen = {getattr(gguf.LlamaFileType, v): k for k, v in FTYPES.items() if k != "auto"}
        outtype = chosen.get(model.ftype, model.ftype.name)  # auto resolved; a class may pick its own
        codes = keep_codes(ckpt, model, request) if request.get("codes") else None
        tensors = [{"name": n, "type": t.dtype.name, "shape": [int(d) for d in reversed(t.shape)], "bytes": t.nbytes}
                   for n, t in model.gguf_writer.tensors[0].items()]
        result = {"architecture": arch, "class": cls.__mro__[1].__name__, "tensors": tensors, "outtype": outtype}
        if heads is not None:
            result["mtp"] = heads
        if codes is not None:
            result["codes"] = [t.report for t in codes]
            if any(t.action == "refused" for t in codes):
                return result  # nothing written: the writer refuses, naming each tensor
        if not request["dry_run"]:
            writer = model.gguf_writer
            skip = {t.name for t in codes or () if t.action in ("kept", "requantized")}
            plan = prove(ckpt, writer, skip) if request.get("native") and len(writer.tensors) == 1 else None
            model.prepare_metadata(vocab_only=False)  # the tokenizer: after the proofs, so their memory is given back
            if carried:
                result["pre_carried"] = carried[0]
            if source:
                result["token_types"] = _token_types_as_source(writer, source)
            mtp_heads.record(writer, heads)  # what became of the heads, as other formats record it
            writer.write_header_to_file(path=out)
            writer.write_kv_data_to_file()
            if plan is not None:
                result.update(write_split(writer, *plan))
            else:
                writer.write_tensors_to_file(progress=request["progress"])
            writer.close()
        return result


def keep_codes(ckpt, model, request: dict):
    """``kept``'s plan for ``ckpt``'s quantized weights (``request["codes"]``: "keep", or "requantize" what cannot
    be kept; ``request["choices"]``: what the writer found each can be), applied to the converter's writer unless a
    tensor is refused; the file type set to the kept codes' type."""
    import gguf

    from . import kept, native
    from .names import BY_TYPE, hf_names

    view, modules = kept.quantized(ckpt)
    config = dict(ckpt.config or {})
    family = BY_TYPE.get(config.get("model_type", ""))
    names = hf_names(family, int(config.get("num_hidden_layers") or 0)) if family else {}
    routes = {}
    for name, ti in model.gguf_writer.tensors[0].items():
        r = native.route(name, [int(d) for d in ti.shape], family, config, names) if family else None
        if r is not None:
            routes[name] = r
    plan = kept.plan(modules, request["choices"], routes, request["codes"] == "requantize")
    if not any(t.action == "refused" for t in plan):
        kept.apply(view, model.gguf_writer, plan)
        if (ft := kept.file_type(plan)) is not None:
            model.ftype = getattr(gguf.LlamaFileType, ft)
    return plan


CHECK_LIMIT = 64 << 20  # the largest tensor whose converter bytes the worker builds to prove a recipe


def prove(ckpt, writer, skip=frozenset()) -> tuple[dict, dict]:
    """Each tensor's recipe (``native.recipe``, None where none makes it) and, per tensor class
    (``native.tensor_class``), whether the recipe gives the converter's own bytes on the class's first tensor
    (one no larger than ``CHECK_LIMIT``, ``$FFN_TOOLS_GGUF_CHECK_LIMIT``); a class with no tensor that small (a
    large embedding) is not proven here (the tests prove those families byte for byte against
    convert_hf_to_gguf.py). Run before the tokenizer is read, and the memory given back to the system after,
    so the proofs do not add to the worker's peak."""
    import ctypes

    import numpy as np
    from gguf.lazy import LazyNumpyTensor

    from . import native
    from .names import BY_TYPE, hf_names

    config = dict(ckpt.config or {})
    family = BY_TYPE.get(config.get("model_type", ""))
    names = hf_names(family, int(config.get("num_hidden_layers") or 0)) if family else {}
    limit = int(os.environ.get("FFN_TOOLS_GGUF_CHECK_LIMIT", CHECK_LIMIT))
    recipes: dict[str, dict | None] = {}
    proven: dict[str, bool] = {}
    for name, ti in writer.tensors[0].items():
        shape = [int(d) for d in ti.shape]  # the element shape, numpy order
        rec = native.recipe(name, shape, family, config, names, ckpt.info) if family and name not in skip else None
        if rec is not None and (native.shape_of(rec) != shape or ti.dtype.name not in native.QTYPES
                                or native.out_bytes(rec, ti.dtype.name) != ti.nbytes):
            rec = None
        recipes[name] = rec
        cls = native.tensor_class(name)
        if rec is not None and cls not in proven and ti.nbytes <= limit:
            theirs = np.asarray(LazyNumpyTensor.to_eager(ti.tensor)).tobytes()
            proven[cls] = theirs == native.tensor_bytes(rec, ti.dtype.name)
            del theirs
            if proven[cls]:
                ti.tensor = None  # evaluating cached every step's result in the lazy graph: let it all go
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the memory stays with the process, nothing else changes
    return recipes, proven


def write_split(writer, recipes: dict, proven: dict) -> dict:
    """Write the tensor infos and every tensor no proven recipe makes (the converter's own evaluation, at its
    offset); return the rest, with their offsets, for ``native`` to write."""
    from . import native

    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    offset = writer.ggml_pad(fout.tell(), writer.data_alignment)
    native_tensors, by_converter, unproven = [], [], set()
    for name, ti in writer.tensors[0].items():
        cls, rec = native.tensor_class(name), recipes[name]
        if rec is not None and proven.get(cls, True):
            if cls not in proven:
                unproven.add(cls)
            native_tensors.append({"name": name, "offset": offset, "type": ti.dtype.name, "bytes": ti.nbytes,
                                   "recipe": rec})
        else:
            fout.seek(offset)
            ti.tensor.tofile(fout)
            if fout.tell() - offset != ti.nbytes:
                raise ValueError(f"tensor {name!r} wrote {fout.tell() - offset} bytes, expected {ti.nbytes}")
            by_converter.append(name)
        ti.tensor = None
        offset += writer.ggml_pad(ti.nbytes, writer.data_alignment)
    fout.truncate(offset)
    fout.flush()
    return {"native": native_tensors, "by_converter": by_converter,
            "proven": sorted(c for c, ok in proven.items() if ok), "unproven": sorted(unproven),
            "disproven": sorted(c for c, ok in proven.items() if not ok)}


def imports(model_type: str) -> None:
    """The imports a conversion needs, made first: torch (with the parts its lazy tensors reach), gguf, llama.cpp's
    ``conversion`` and transformers' config class of ``model_type``."""
    import gguf  # noqa: F401
    import torch  # noqa: F401

    import conversion  # noqa: F401
    from ffn_tools import converters

    # every format's package: a child's ``open_any`` detects its input's format by asking each (0.2 s a child)
    converters._available()

    # what every conversion imports on its first lazy tensor op (torch._refs' stack checks, torch._dynamo's
    # disable wrapper): 1-1.4 s a child, made once here instead
    import torch._dynamo  # noqa: F401
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    try:  # llama.cpp's runs (``llama_cpp_run``) fork from here too where this process runs: its library loaded once
        import llama_cpp  # noqa: F401
    except ImportError:
        pass

    try:
        from transformers import CONFIG_MAPPING

        # llama's config module: the first config module a conversion reads, whatever its model type (its tokenizer)
        for name in dict.fromkeys(["llama", model_type]):
            if name in CONFIG_MAPPING:
                CONFIG_MAPPING[name]  # noqa: B018 - imports its module, as the converter's AutoConfig will
    except ImportError:
        pass


def script(request: dict) -> int:
    """``python SCRIPT ARGV`` (``request["script"]``, ``request["argv"]``; or ``python -m MODULE ARGV`` for
    ``request["module"]``) run in this process, its imports made by the zygote: llama.cpp's convert_lora_to_gguf.py
    for ``lora``, ffn-tools' llama.cpp runner, tensor writer and quantizer, the same on the same arguments; its exit
    status as the interpreter would give it."""
    import runpy

    module = request.get("module")
    sys.argv = [module or request["script"], *request["argv"]]
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0


def respond(request: dict) -> int:
    """Run ``request``, print its JSON line (the result, or ``{"error": ...}``); the exit status. A request with a
    ``script`` runs that script instead (``script``)."""
    if "script" in request or "module" in request:
        return script(request)
    from ffn_tools.errors import FFNToolsError

    try:
        result = run(request)
    except FFNToolsError as e:  # ours: the message as it is, the writer's refusal
        print(json.dumps({"error": str(e), "refused": True}))
        return 1
    except Exception as e:  # noqa: BLE001 - the converter's own refusals (NotImplementedError, ValueError, ...)
        print(json.dumps({"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}))
        return 1
    print(json.dumps(result))
    return 0


IDLE_SECONDS = 120  # a zygote with no request for this long ends (the next conversion starts another)


def zygote(model_type: str) -> None:
    """``--zygote``: ``imports`` once, then each request line (``{"request", "cwd", "env", "stdout", "stderr"}``) run
    in a child forked from this process, with the imports made and nothing of an earlier conversion (each dies with
    its child), in the request's directory and environment: prints ``{"pid"}`` when the child starts and ``{"rc"}``
    when it ends. The child writes its result line to the file ``stdout``, its stderr to ``stderr`` (None: this
    process's). Ends at the end of stdin (the writer's process ended), or after ``IDLE_SECONDS`` without a
    request."""
    imports(model_type)
    gc.freeze()  # the imports' objects (torch's, transformers'): a child's collections no longer scan them
    while select.select([sys.stdin], [], [], IDLE_SECONDS)[0]:
        line = sys.stdin.readline()
        if not line.strip():
            return
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.chdir(job["cwd"])
                os.environ.clear()
                os.environ.update(job["env"])
                for fd, path in ((0, os.devnull), (1, job["stdout"]), (2, job.get("stderr"))):
                    if path:
                        f = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                        os.dup2(f, fd)
                        os.close(f)
                code = respond(job["request"])
            except BaseException:  # noqa: BLE001 - said on its stderr; the writer reports the exit status
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


def main() -> None:
    if sys.argv[1] == "--zygote":
        zygote(sys.argv[2] if len(sys.argv) > 2 else "")
        sys.stdout.flush()
        sys.stderr.flush()
        # nothing of it to finish: the interpreter's teardown would only run triton's (torch._dynamo imports it),
        # whose nanobind bindings print some 70 lines of "leaked" objects on stderr, the terminal of the command
        # that started it, after a passing conversion
        os._exit(0)
    sys.exit(respond(json.loads(Path(sys.argv[1]).read_text())))


if __name__ == "__main__":
    main()
