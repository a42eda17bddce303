"""llama.cpp, the client of GGUF files (through llama-cpp-python).

llama.cpp builds the model from the GGUF's metadata, not a config.json (``checks.compare_metadata``), reads its
tokenizer from ``tokenizer.ggml.*`` (``checks.compare_tokenizer``) and tokenizes with its own code
(``tokenization``), stores Gemma's norms plus one (``checks.compare_plus_one``), and computes GELU through a
float16 table (ggml-cpu's GGML_GELU_FP16: input and output rounded to float16, so its logits of a float32 Gemma
differ from transformers' by float16 roundings: measured 2.8e-4 on the tiny Gemma 2, 1.7e-5 with transformers'
GELU rounded so too). Its load check is llama.cpp building the model; its logits run in a process of their own
(``llama_cpp_run``), the KV cache in float32.
"""

from __future__ import annotations

from pathlib import Path

from ffn_tools.checks.load import LoadCheck, MissingClient
from ffn_tools.clients import Client
from ffn_tools.errors import FFNToolsError, pip_install

from .checks import compare_metadata, compare_plus_one, compare_tokenizer


class LlamaCpp(Client):
    """llama.cpp (see the module docstring)."""

    name = "llama.cpp"
    precision = {"gelu": "float16", "gelu_tanh": "float16"}
    tokenizes = True

    def load_check(self, ckpt) -> LoadCheck:
        return check_llama_cpp(Path(ckpt.path))

    def compare_config(self, ca, cb, allow=()):
        return compare_metadata(ca, cb, allow)

    def compare_side_files(self, ca, cb):
        return compare_tokenizer(Path(ca.root), cb)

    def compare_tokenization(self, ca, cb):
        from .tokenization import compare_tokenization

        return compare_tokenization(Path(ca.root), Path(cb.stored.path), cb.fields)

    def runs(self, config: dict):
        """What llama.cpp runs for the architecture ``config``'s model type converts to, where it assumes it
        (``implied_values``) whatever the GGUF's metadata says: its top-k renormalization, and which layers slide
        (Gemma's pattern) with the window the metadata carries (``config.sliding_window``)."""
        from ffn_tools.checks.config import transformers_view
        from ffn_tools.checks.semantics import Runs, topk_words, windows, windows_words

        from .config import SLIDING_PATTERN, implied_values
        from .names import BY_TYPE

        family = BY_TYPE.get(str(config.get("model_type")))
        if family is None:
            return {}
        normalized = transformers_view(config)[0] or config
        assumed = implied_values(family.arch, normalized)
        graph = f" (llama.cpp's {family.arch} graph, whatever the GGUF says)"
        out = {}
        if "norm_topk_prob" in assumed:
            norm = assumed["norm_topk_prob"]
            out["norm_topk_prob"] = Runs(norm, topk_words(norm) + graph)
        layers = normalized.get("num_hidden_layers")
        if family.arch in SLIDING_PATTERN and isinstance(layers, int):
            ws = windows(normalized.get("sliding_window"), assumed["layer_types"], layers,
                         normalized.get("max_position_embeddings"))
            out["sliding_window"] = Runs(ws, windows_words(ws) + graph)
        return out

    def stored_otherwise(self, cb) -> frozenset[str]:
        return frozenset(cb.shifts)

    def compare_stored_otherwise(self, outside, ca, cb, atol, rtol) -> list[str]:
        return compare_plus_one(outside, ca, cb, atol, rtol)

    def ready_for_logits(self, ckpt, side: str) -> None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as e:
            raise FFNToolsError(f"--logits: {side} is a GGUF and llama-cpp-python does not import here ({e}): "
                                f"{pip_install('gguf')}") from None

    def logits(self, path: Path, tokens, dtype: str | None = None):
        """llama.cpp's logits of every position, one sequence at a time, its KV cache in float32 (its default f16
        cache would add its own rounding to what is compared); in a process of its own (``llama_cpp_run``). It
        computes in its own types whatever ``dtype`` says."""
        import json
        import tempfile

        import numpy as np
        import torch

        from .llama_cpp_run import run

        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "tokens.json").write_text(json.dumps(tokens.tolist()))
            run(str(path), str(Path(d) / "tokens.json"), str(Path(d) / "logits.npy"))
            return torch.from_numpy(np.load(Path(d) / "logits.npy")), []


    def anchor(self, a: Path, recipe: dict, out: Path, like: Path | None = None) -> str | None:
        """A converted by llama.cpp's own converter (and quantizer): ``verify --locate``'s independent floor."""
        from .anchor import anchor

        return anchor(a, recipe, out)

    def generate(self, path: Path, prompts, new_tokens, score=None, dtype=None):
        """The prompts as llama-cpp-python runs them (``llama_cpp_run.generate``), in a process of its own. It
        computes in its own types whatever ``dtype`` says."""
        import json
        import tempfile

        import numpy as np

        from ffn_tools.generation import Generation

        from .llama_cpp_run import run

        with tempfile.TemporaryDirectory() as d:
            request = {"prompts": prompts, "new_tokens": new_tokens, "score": score}
            (Path(d) / "request.json").write_text(json.dumps(request, ensure_ascii=False), encoding="utf-8")
            run("--generate", str(path), str(Path(d) / "request.json"), d)
            got = json.loads((Path(d) / "generation.json").read_text(encoding="utf-8"))
            with np.load(Path(d) / "logits.npz") as z:
                logits = [z[f"arr_{i}"] for i in range(len(got["sequences"]))]
        return Generation(self.name, got["prompts"], got["templated"], got["eos"], got["sequences"],
                          [len(p) for p in got["prompts"]], logits, {int(k): v for k, v in got["pieces"].items()})


LLAMA_CPP_CONTEXT = 32  # tokens of context the load check asks llama.cpp for: building the model is the check


def check_llama_cpp(path: Path) -> LoadCheck:
    """llama.cpp itself (llama-cpp-python's ``Llama``) builds the model of a GGUF: every tensor its
    architecture needs, of the shape and type it needs, with the metadata it reads; it refuses otherwise."""
    try:
        import llama_cpp
    except ImportError as e:
        raise MissingClient(f"verify's load check of a GGUF needs llama-cpp-python, which does not import here "
                            f"({e}): {pip_install('gguf')}, or pass --no-load-check") from None
    try:
        with _quiet_stderr():
            model = llama_cpp.Llama(model_path=str(path), n_ctx=LLAMA_CPP_CONTEXT, vocab_only=False, verbose=False)
        arch = model.metadata.get("general.architecture")
        model.close()
    except Exception as e:  # noqa: BLE001 - llama.cpp's refusal (a ValueError naming the file, or worse)
        return LoadCheck("llama.cpp", refused=f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
    return LoadCheck("llama.cpp", architecture=arch)


class _quiet_stderr:
    """llama.cpp logs while loading, from C to file descriptor 2 and through llama-cpp-python's callback to
    ``sys.stderr``; both silenced (its refusal is the exception)."""

    def __enter__(self):
        import contextlib
        import io
        import os

        self._python = contextlib.redirect_stderr(io.StringIO())
        self._python.__enter__()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        import os

        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._python.__exit__(*exc)
