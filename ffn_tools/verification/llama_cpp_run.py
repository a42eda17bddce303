"""llama.cpp's logits of a GGUF, in a process of its own (``logits._llama_cpp_logits`` runs it).

llama.cpp is C: a failed assertion aborts, and a build for another CPU dies of an illegal instruction (a
llama-cpp-python built with ``-march=native`` where the kernel does not grant AMX tiles, say); in its own
process that is a line in verify's report, not the end of verify.

    python -m ffn_tools.verification.llama_cpp_run MODEL.gguf TOKENS.json OUT.npy
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import llama_cpp
    import numpy as np

    path, tokens_file, out = sys.argv[1:4]
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


if __name__ == "__main__":
    main()
