"""``convert SRC --to gguf -o OUT.gguf --outtype TYPE``: a GGUF exactly as llama.cpp's convert_hf_to_gguf.py (and
llama-quantize) writes it, from any checkpoint ffn-tools reads; a quantized one from its codes.

llama.cpp's converter decides everything about a GGUF (tensor names, q/k permutation, expert stacking, which
tensors stay F32, Q8_0 blocks, metadata keys, the tokenizer and its pre-tokenizer); a second implementation of
those rules would drift from it with every release. So the writer runs the converter's own model class
(``worker``, its process started while ``convert`` checks the conversion: ``warm``) with its tensors read from
ffn-tools' view of the input: the output is bit-identical to the converter's for a Hugging Face input, and an MLX,
Meta/Mistral native or Flax input converts the same way. The converter writes the header and what no recipe
makes; ``native`` writes the rest in chunks on every core, from a second process that imports neither torch nor
transformers (recipes proven against the converter's bytes first, in ``worker``). A quantized input's weights go
in as their own codes where a GGUF type holds them exactly (``kept``), else refused or, asked, re-quantized.
K-quants and i-quants (``--outtype q4_k_m``, ...) are llama.cpp's own quantizer run on the converter's bf16/f16
file beside the output (``kquant``). Everything is written to a temporary path beside OUT and moved into place
only when complete.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/`` from llama.cpp's source tree) is
found at ``$FFN_TOOLS_LLAMA_CPP``, else ``sys.prefix/llama.cpp`` (where the dev install puts it), else in this
user's cache, where it is fetched once from the installed llama-cpp-python's source distribution (``source``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ffn_tools import progress
from ffn_tools.child import python_env
from ffn_tools.errors import FFNToolsError
from ffn_tools.io.output import atomic_output
from ffn_tools.io.run import NO_RUN, Run
from ffn_tools.io.store import Checkpoint
from ffn_tools.executor import side_files
from ffn_tools.sizes import human

from . import OUTTYPES, heads as mtp_heads, kquant, zygote
from .source import llama_cpp_dir

# what a terminal shows while llama.cpp's converter starts (before the tensors' progress bar: seconds)
READING = "llama.cpp's converter is reading the model (its class, the vocabulary, the tensors' plan)"


def export(ckpt: Checkpoint, out: Path, *, dtype: str | None = None, force: bool = False,
           max_shard_size: int | None = None, outtype: str | None = None, dry_run: bool = False,
           native: bool = True, output_tensor_type: str | None = None, token_embedding_type: str | None = None,
           imatrix: str | Path | None = None, requantize: bool | None = None, mtp: str | None = None,
           run: Run = NO_RUN) -> dict:
    """Write ``ckpt`` as the GGUF file ``out``.

    Args:
        outtype: f32, f16, bf16, q8_0 (convert_hf_to_gguf.py's), or auto (its default, and ours when None:
            the converter's own choice, bf16 for a bf16 model, f16 for an f16 or f32 one); or one of
            llama-quantize's types (``kquant.FTYPES``: q4_k_m, q6_k, iq4_xs, ...), made by llama.cpp's quantizer
            from the converter's auto file.
        output_tensor_type, token_embedding_type, imatrix: llama-quantize's options of those names (with a
            llama-quantize type only).
        requantize: a quantized input with outtype auto is written from its codes (``kept``), each weight in the
            GGUF type that holds it exactly, and a weight no type holds is refused; True writes those as Q8_0 of
            their dequantized values instead (said per tensor).
        mtp: ``--mtp`` keep (the default), drop or only the MTP heads (``ffn_tools.mtp``): llama.cpp's ``--mtp`` /
            ``--no-mtp`` where the family's converter class has them (``heads``); where it has none (its
            DeepSeek-V3 class), the converter's file, which holds no head: said, recorded in the metadata as
            dropped, and ``only`` refused.
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
    outtype = (outtype or "auto").lower()
    if outtype not in OUTTYPES:
        raise FFNToolsError(f"--outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    quantizing = outtype in kquant.FTYPES
    _check_quantize_options(outtype, quantizing, output_tensor_type, token_embedding_type, imatrix)
    if out.suffix != ".gguf":
        raise FFNToolsError(f"{out}: a GGUF output is one file named *.gguf")
    llama_cpp_dir()  # found, or fetched once, before anything is written
    from . import kept

    view, modules = kept.quantized(ckpt)
    stored_quantized = bool(modules)
    codes = "requantize" if requantize else "keep" if stored_quantized and outtype == "auto" else None
    if requantize and not (stored_quantized and outtype == "auto"):
        raise FFNToolsError("--requantize is for a quantized input written from its codes (--outtype auto): "
                            + ("this input holds no quantized weights" if not stored_quantized else
                               f"--outtype {outtype} writes every weight dequantized, then as {outtype}"))
    dequantized = 0 if codes else sum(1 for n in ckpt if ckpt.quantized(n))
    heads, asked = mtp_heads.request(ckpt, mtp)  # an unknown mode, or only of a model without a head: refused
    said = {"dequantized": dequantized, "format": ckpt.kind, "asked": outtype, "heads": heads}
    with _model_dir(ckpt) as (dir_model, rebuilt):  # config.json and the tokenizer, where the converter reads them
        request = {"source": str(ckpt.path), "dir_model": str(dir_model),
                   "outtype": "auto" if quantizing else outtype, "dry_run": dry_run, "progress": progress.visible(),
                   "native": native, "codes": codes, "rebuilt": rebuilt}
        if asked:  # what the converter is to do with the heads (``heads``)
            request["mtp"] = asked
        if codes:  # what each quantized weight can be, from its codes read once, before the converter starts
            request["choices"] = _choices(ckpt, view, modules, refuse=codes == "keep")
        if dry_run:
            with progress.doing(f"{out.name}: {READING}"):  # its writer in its dry-run mode writes nothing
                result = _run({**request, "out": str(out)})
            _refuse(ckpt, result.get("codes") or [])  # what the conversion would refuse, the plan refuses
            return _summary(out, result, said, plan=True)
        read = [*ckpt.files, *side_files(ckpt), *([Path(imatrix)] if imatrix else [])]  # the receipt's sources
        with atomic_output(out, inputs=[Path(ckpt.path)], force=force, sources=read, run=run) as tmp:
            # a K-quant's intermediate: the converter's file beside the temporary output, removed whatever happens
            first = tmp.with_name(tmp.name + ".intermediate.gguf") if quantizing else tmp
            try:
                with progress.doing(f"{out.name}: {READING}"):  # seconds before its tensors are written: said
                    result = _run({**request, "out": str(first)})
                _refuse(ckpt, result.get("codes") or [])
                if result.get("native"):
                    with progress.doing(f"{out.name}: starting the tensor writer"):  # its bar replaces the line
                        _run({"out": str(first), "tensors": result["native"], "progress": request["progress"]},
                             "native")
                if quantizing:
                    steps = {"intermediate": result["outtype"], "intermediate_bytes": first.stat().st_size}
                    rec = kquant.recipe(outtype, result["outtype"], output_tensor_type, token_embedding_type,
                                        Path(imatrix) if imatrix else None)
                    q = _run({"input": str(first), "out": str(tmp), "outtype": outtype, "recipe": rec,
                              "output_tensor_type": output_tensor_type, "token_embedding_type": token_embedding_type,
                              "imatrix": str(imatrix) if imatrix else None, "progress": request["progress"]}, "kquant")
                    result = {**result, "tensors": q["tensors"], "outtype": outtype,
                              "quantized": {**steps, "recipe": rec, "fallbacks": q.get("fallbacks", [])}}
            finally:
                if quantizing:
                    first.unlink(missing_ok=True)
        return _summary(out, result, said, plan=False)


@contextmanager
def _model_dir(ckpt: Checkpoint):
    """(The directory llama.cpp's converter reads config.json and the tokenizer from, whether its tokenizer was
    rebuilt from a GGUF's metadata): the input's own directory where it has a config.json, else a temporary one
    holding the input's config and the side files it rebuilds (a GGUF's tokenizer from its metadata), removed
    after. The converter then writes the GGUF's own pre-tokenizer name and token types where it would write
    others (``worker._pre_fallback``, ``worker._token_types_as_source``)."""
    if (Path(ckpt.root) / "config.json").is_file():
        yield Path(ckpt.root), False
        return
    from .reader import GGUFCheckpoint

    # named as the input (a GGUF's general.name), from which the converter derives general.name and basename
    name = str(ckpt.fields.get("general.name") or "") if isinstance(ckpt, GGUFCheckpoint) else ""
    name = re.sub(r"[^\w.+-]+", "-", name or Path(ckpt.path).stem).strip(".-") or "model"
    with tempfile.TemporaryDirectory(prefix="ffn-tools-gguf-") as tmp:
        d = Path(tmp) / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(ckpt.config or {}, indent=2))
        files, _ = ckpt.rebuilt_files()
        for name, text in files.items():
            (d / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        try:
            yield d, isinstance(ckpt, GGUFCheckpoint)
        except FFNToolsError as e:
            if "pre-tokenizer was not recognized" not in str(e):
                raise
            raise FFNToolsError(f"{e} (the input has no tokenizer files: the converter read the ones rebuilt from "
                                f"{ckpt.path.name}'s metadata, whose BPE pre-tokenizer it does not recognise; put "
                                "the model's own tokenizer.json and config.json beside the input)") from None


def _fallback_line(fallbacks: list[dict], total: int) -> str:
    """One line: how many tensors llama.cpp's quantizer wrote in a fallback type, by type."""
    counts: dict[tuple, int] = {}
    for f in fallbacks:
        key = (f["wanted"], f["written"], f["block"])
        counts[key] = counts.get(key, 0) + 1
    each = ", ".join(f"{w} -> {x} x{n} (blocks of {b})" for (w, x, b), n in sorted(counts.items()))
    return (f"llama.cpp's quantizer fell back to another type for {len(fallbacks)} of {total} tensors, whose rows "
            f"are not a multiple of the type's block (as llama-quantize does): {each}")


def _choices(ckpt: Checkpoint, view, modules: dict, refuse: bool) -> dict[str, dict]:
    """``kept.choices`` of ``ckpt``'s quantized weights (``kept.quantized``'s ``view`` and ``modules``); with
    ``refuse``, a weight no GGUF type holds exactly is refused here, by its name in the checkpoint, before
    llama.cpp's converter starts.

    Raises:
        FFNToolsError: as ``_refuse``.
    """
    from . import kept

    chosen = kept.choices(view, modules)
    if refuse:
        _refuse(ckpt, [{"tensor": h, "scheme": modules[h].scheme.what(modules[h]), "why": c["why"], "type": c["qtype"],
                        "action": "refused" if c["qtype"] is None else "kept"} for h, c in chosen.items()])
    return chosen


def _refuse(ckpt: Checkpoint, report: list[dict]) -> None:
    """Refuse a conversion from codes in which some quantized weight no GGUF type holds exactly (the worker wrote
    nothing then), naming them with the numbers and the two ways on.

    Raises:
        FFNToolsError: naming the first tensors, why, and how many blocks the best type would hold.
    """
    refused = [t for t in report if t["action"] == "refused"]
    if not refused:
        return
    shown = "; ".join(f"{t['tensor']} ({t['scheme']}): {t['why']}" for t in refused[:3])
    more = f"; and {len(refused) - 3} more" if len(refused) > 3 else ""
    kept: dict[str, set] = {}  # the others (another config group, say), which keep their codes either way
    for t in report:
        if t["action"] == "kept":
            kept.setdefault(t["scheme"], set()).add(t.get("type"))
    held = "; ".join(f"{sum(t['action'] == 'kept' and t['scheme'] == s for t in report)} {s} as "
                     f"{'/'.join(sorted(map(str, ty)))}" for s, ty in sorted(kept.items()))
    others = f" (the other {len(report) - len(refused)} keep their codes exactly: {held})" if kept else ""
    raise FFNToolsError(f"{ckpt.path}: {len(refused)} of {len(report)} quantized weights cannot be written into GGUF "
                        f"from their codes, exactly: {shown}{more}{others}. --requantize writes those as Q8_0 of their "
                        "dequantized values and keeps the others' codes (said per tensor); --outtype bf16 (or f16, "
                        "f32) writes every weight dequantized")


def _check_quantize_options(outtype: str, quantizing: bool, output_tensor_type, token_embedding_type, imatrix):
    """Refuse llama-quantize's options without one of its types, an unknown tensor type, a missing imatrix."""
    given = [f for f, v in (("--output-tensor-type", output_tensor_type), ("--token-embedding-type",
             token_embedding_type), ("--imatrix", imatrix)) if v]
    if given and not quantizing:
        raise FFNToolsError(f"{', '.join(given)}: llama-quantize's options, for its types (--outtype q4_k_m, q6_k, "
                            f"iq4_xs, ...); --outtype {outtype} is the converter's")
    for flag, t in (("--output-tensor-type", output_tensor_type), ("--token-embedding-type", token_embedding_type)):
        if t and t.lower() not in kquant.TENSOR_TYPES:
            raise FFNToolsError(f"{flag} {t!r}: use one of {', '.join(kquant.TENSOR_TYPES)}")
    if imatrix and not Path(imatrix).is_file():
        raise FFNToolsError(f"--imatrix {imatrix}: no such file")


# module -> (what it is, in an error; the key its result always has)
MODULES = {"worker": ("llama.cpp's converter", "tensors"), "native": ("the GGUF tensor writer", "written"),
           "kquant": ("llama.cpp's quantizer", "tensors")}


def _env() -> dict:
    root = llama_cpp_dir()
    env = python_env((str(root), str(root / "gguf-py")))
    env.pop("NO_LOCAL_GGUF", None)
    return env


@contextmanager
def warm(model_type: str | None):
    """The converter's process (``zygote``: torch, transformers and llama.cpp's ``conversion`` imported, about
    3.5 s) started at once, so that its start overlaps what the caller checks before the export; it is kept for the
    next conversion of this process. Nothing starts where llama.cpp's converter is not installed (the export says
    so)."""
    from .source import installed_dir

    if installed_dir() is not None:
        zygote.prestart(model_type, _env())
    yield


def _run(request: dict, module: str = "worker") -> dict:
    """The result of ``module`` (``worker``: the converter; ``native``: the chunked tensor writer; ``kquant``:
    llama.cpp's quantizer) run on ``request`` in a process with llama.cpp's gguf-py (the worker: a child of the
    converter's ``zygote``); its failure as an FFNToolsError."""
    proc = None
    if module == "worker":
        try:
            proc = zygote.run(request, _env())  # None: another thread converts through it; a process of its own
        except OSError as e:
            raise FFNToolsError(f"llama.cpp's converter could not convert this checkpoint: {e}") from None
    if proc is None:
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(request, f)
            f.flush()
            proc = subprocess.run([sys.executable, "-m", f"ffn_tools.converters.gguf.{module}", f.name], env=_env(),
                                  stdout=subprocess.PIPE, stderr=None if request["progress"] else subprocess.PIPE,
                                  text=True)
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except ValueError:
        result = {}
    who, key = MODULES[module]
    if result.get("refused"):  # the worker's own refusal, as it words it
        raise FFNToolsError(f"{request.get('source', '')}: {result['error']}")
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
    if result.get("codes"):
        changes += _codes_changes(result["codes"])
    changes += mtp_heads.changes(result, said["heads"])
    if ids := result.get("token_types"):
        changes.append(f"tokenizer.ggml.token_type of {len(ids)} token{'s' * (len(ids) != 1)} (id "
                       f"{', '.join(map(str, ids[:3]))}{', ...' if len(ids) > 3 else ''}) as the input's: the "
                       "tokenizer rebuilt from its metadata marks them otherwise (transformers' GGUF reader makes the "
                       "padding token special), and llama.cpp decodes a CONTROL token as nothing")
    if result.get("pre_carried"):
        changes.append(f"tokenizer.ggml.pre {result['pre_carried']!r} as the input's: llama.cpp's converter does not "
                       "recognise the pre-tokenizer of the tokenizer rebuilt from the input's tokens and merges by its "
                       "encodings, and those are the input's own")
    if "quantized" in result:
        q = result["quantized"]
        changes.append(f"quantized to {q['recipe'][kquant.RECIPE + '.ftype']} by llama.cpp's own quantizer "
                       f"(llama_model_quantize, as llama-quantize) from the converter's {q['intermediate']} file "
                       f"({human(q['intermediate_bytes'])}, written beside the output and removed); the recipe is "
                       f"in the metadata ({kquant.RECIPE}.*)")
        if q["fallbacks"]:
            changes.append(_fallback_line(q["fallbacks"], len(result["tensors"])))
    elif plan and said["asked"] in kquant.FTYPES:
        changes.append(f"the plan is the converter's {outtype} file that llama.cpp's quantizer would make "
                       f"{kquant.FTYPES[said['asked']]} from: which type each tensor then gets is llama.cpp's choice, "
                       "made when it runs")
    if said["asked"] == "auto":
        changes.append(f"--outtype auto: {outtype}, as convert_hf_to_gguf.py's auto picks it (the dtype of the "
                       "model's first bf16 or f16 weight of 2 or more dimensions; f16 when none)")
    types: dict[str, int] = {}
    for t in result["tensors"]:
        types[t["type"]] = types.get(t["type"], 0) + 1
    data = sum(t["bytes"] for t in result["tensors"])
    # the size said is the file's (its header, metadata and vocabulary too); a plan knows its tensors' only
    nbytes, size = (data, f"{human(data)} of tensor data") if plan else (out.stat().st_size, human(out.stat().st_size))
    r = {"output": str(out), "format": "gguf", "outtype": outtype, "converter": result["class"],
         "architecture": result["architecture"], "tensors": len(result["tensors"]), "bytes": nbytes,
         "tensor_bytes": data, "types": types, "changes": changes,
         "summary": f"{'would write' if plan else 'wrote'} {out}: {len(result['tensors'])} tensors "
                    f"({', '.join(f'{k} x{v}' for k, v in sorted(types.items()))}), {size}, as llama.cpp's "
                    f"{result['class']} writes {result['architecture']}"}
    if result.get("codes"):
        r["codes"] = result["codes"]
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


def _codes_changes(report: list[dict]) -> list[str]:
    """The summary's lines for a conversion from codes: what was kept, as which type, with its blocks counted;
    what was quantized again, each named."""
    kept = [t for t in report if t["action"] == "kept"]
    out = []
    if kept:
        by_type: dict[str, int] = {}
        for t in kept:
            by_type[t["type"]] = by_type.get(t["type"], 0) + 1
        exact, blocks = sum(t["blocks_exact"] for t in kept), sum(t["blocks"] for t in kept)
        out.append(f"kept the codes of {len(kept)} quantized tensors ({', '.join(sorted({t['scheme'] for t in kept}))}) "
                   f"as {', '.join(f'{k} x{v}' for k, v in sorted(by_type.items()))}, not re-quantized: {exact} of "
                   f"{blocks} blocks hold the source's values exactly")
    for t in report:
        if t["action"] == "requantized":
            out.append(f"re-quantized {t['tensor']} ({t['scheme']}) as Q8_0 of its dequantized values "
                       f"(--requantize): {t['why']}")
        elif t["action"] == "dequantized":
            out.append(f"dequantized {t['tensor']} ({t['scheme']}) into the converter's type (--requantize): {t['why']}")
    return out
