"""llama.cpp run in a process of its own: a GGUF's logits (``logits._llama_cpp_logits``), and its tokenization of
texts from its vocabulary alone (``tokenization``).

llama.cpp is C: a failed assertion aborts, and a build for another CPU dies of an illegal instruction (a
llama-cpp-python built with ``-march=native`` where the kernel does not grant AMX tiles, say); in its own
process that is a line in verify's report, not the end of verify. Where this process's GGUF converter zygote runs
(``zygote``: a conversion started it), that process is a fork of it, its imports made; else a fresh interpreter.

    python -m ffn_tools.converters.gguf.llama_cpp_run MODEL.gguf TOKENS.json OUT.npy
    python -m ffn_tools.converters.gguf.llama_cpp_run --tokenize MODEL.gguf TEXTS.json OUT.json
    python -m ffn_tools.converters.gguf.llama_cpp_run --generate MODEL.gguf REQUEST.json OUT_DIR
"""

from __future__ import annotations

import json
import sys

SIGILL_HINT = (" (an instruction this CPU or its kernel refuses: a llama-cpp-python built for another CPU, or with AMX "
               "where the kernel grants no AMX tiles; rebuild it with CMAKE_ARGS=-DGGML_NATIVE=OFF)")


def run(*args: str) -> None:
    """``python -m ffn_tools.converters.gguf.llama_cpp_run ARGS`` in a child process.

    Raises:
        RuntimeError: the child failed; the message is the signal it died of (with what SIGILL means here) or
            the last line it wrote to stderr.
    """
    import signal
    import subprocess

    from ffn_tools.child import python_env

    from . import zygote
    from .source import installed_dir

    proc = None
    if installed_dir() is not None:  # forked from the converter's zygote where one runs (a conversion of this
        from .writer import _env  # process started it): its imports made, ~0.5 s a run less; a child all the same

        if zygote.alive(env := _env()):
            try:
                proc = zygote.run({"module": __name__, "argv": list(args)}, env)  # None: it is busy
            except OSError:
                proc = None
    if proc is None:
        proc = subprocess.run([sys.executable, "-m", "ffn_tools.converters.gguf.llama_cpp_run", *args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=python_env())
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        raise RuntimeError(f"llama.cpp died of {name}" + (SIGILL_HINT if name == "SIGILL" else ""))
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise RuntimeError(lines[-1] if lines else f"exit status {proc.returncode}")


def logits(path: str, tokens_file: str, out: str) -> None:
    """Every position's logits of each token sequence, KV cache in float32, as one .npy array."""
    import llama_cpp
    import numpy as np

    tokens = json.loads(open(tokens_file).read())
    length = max(len(s) for s in tokens)
    model = llama_cpp.Llama(model_path=path, n_ctx=max(32, length), n_batch=length, logits_all=True, verbose=False,
                            type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    rows = []
    for seq in tokens:
        model.reset()
        model.eval(seq)
        rows.append(np.array(model.scores[:model.n_tokens], dtype=np.float64))
    model.close()
    np.save(out, np.stack(rows))


def tokenize(path: str, texts_file: str, out: str) -> None:
    """Each text's token ids as llama.cpp's tokenizer gives them, from the vocabulary alone (no weights read):
    the special tokens the GGUF says to add added (``add_bos`` is llama_tokenize's ``add_special``), special
    tokens written in the text parsed as such (as transformers does), as a JSON list of lists."""
    import llama_cpp

    texts = json.loads(open(texts_file, encoding="utf-8").read())
    model = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    ids = [model.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in texts]
    model.close()
    with open(out, "w") as f:
        json.dump(ids, f)


def generate(path: str, request_file: str, out_dir: str) -> None:
    """Prompts run as llama-cpp-python runs a chat (``Llama.create_chat_completion`` with the GGUF's
    ``tokenizer.chat_template``: rendered by its ``Jinja2ChatFormatter`` with the GGUF's BOS and EOS texts,
    tokenized without adding BOS again), or as a completion (BOS added as the GGUF says) where there is no
    template; continued greedily until an end-of-generation token (``llama_vocab_is_eog``) or the budget; every
    position's logits in one pass, KV cache in float32. Writes ``OUT_DIR/generation.json`` and ``logits.npz``."""
    import llama_cpp
    import numpy as np
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from ffn_tools.checks.prompts import greedy, pieces

    request = json.loads(open(request_file, encoding="utf-8").read())
    prompts, new_tokens, score = request["prompts"], request["new_tokens"], request.get("score")
    probe = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    template = probe.metadata.get("tokenizer.chat_template")
    text = {t: probe._model.token_get_text(t) if t != -1 else "" for t in (probe.token_eos(), probe.token_bos())}
    if template:
        formatter = Jinja2ChatFormatter(template=template, eos_token=text[probe.token_eos()],
                                        bos_token=text[probe.token_bos()])
        rendered = [formatter(messages=[{"role": "user", "content": p}]) for p in prompts]
        ids = [probe.tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True) for r in rendered]
    else:
        ids = [probe.tokenize(p.encode("utf-8"), add_bos=True, special=True) for p in prompts]
    vocab = probe._model.vocab
    eos = [t for t in range(probe.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    probe.close()
    longest = max(len(s) for s in (score or ids)) + (0 if score else new_tokens)
    model = llama_cpp.Llama(model_path=path, n_ctx=max(32, longest), n_batch=max(32, longest), logits_all=True,
                            verbose=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)

    def run(tokens: list[int]):
        model.eval(tokens)
        return np.asarray(model.scores[model.n_tokens - 1])

    if score is None:
        score = []
        for p in ids:
            model.reset()
            score.append(greedy(p, new_tokens, set(eos), run))
    logits = []
    for seq in score:
        model.reset()
        model.eval(seq)
        logits.append(np.array(model.scores[:model.n_tokens], dtype=np.float32))
    names = pieces(lambda t: model.detokenize([t], special=True).decode("utf-8", errors="replace"), score, logits)
    model.close()
    np.savez(f"{out_dir}/logits.npz", *logits)
    with open(f"{out_dir}/generation.json", "w") as f:
        json.dump({"prompts": ids, "templated": bool(template), "eos": eos, "sequences": score,
                   "pieces": {str(k): v for k, v in names.items()}}, f)


def main() -> None:
    if sys.argv[1] == "--tokenize":
        tokenize(*sys.argv[2:5])
    elif sys.argv[1] == "--generate":
        generate(*sys.argv[2:5])
    else:
        logits(*sys.argv[1:4])


if __name__ == "__main__":
    main()
