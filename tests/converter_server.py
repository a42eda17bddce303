"""Run llama.cpp's convert_hf_to_gguf.py many times, each run a fork of one process that imported its modules once.

``python converter_server.py CONVERTER`` imports what the converter imports (it runs the script under another name
than ``__main__``: its module-level imports, not its ``main``), then reads one JSON request per line on stdin,
``{"argv": [...], "log": path}``, and for each forks a child that runs the script as ``__main__`` with that argv
(stdout and stderr into ``log``), exactly as ``python CONVERTER ARGV`` does, and answers ``{"code": exit status}``.
A fresh interpreter spends about 3 s of CPU importing torch, transformers and gguf-py before converting anything
(measured: the tiny Llama's f32 conversion 4.3 s in a new process, 1.2 s forked; the same file, byte for byte).
This process starts no thread (only imports): forking it is safe.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def convert(converter: str, argv: list[str], log: str) -> int:
    pid = os.fork()
    if pid == 0:  # the child: the script as `python converter argv` runs it
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.argv = [converter, *argv]
            runpy.run_path(converter, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - the script's own failure, reported as a process's would be
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    converter = sys.argv[1]
    sys.argv = [converter]
    runpy.run_path(converter, run_name="converter_server_preload")  # its imports: torch, transformers, gguf
    import sentencepiece  # noqa: F401 - imported by the converter when it reads a tokenizer
    import torch._dynamo  # noqa: F401 - imported by every conversion's first lazy tensor op (1-1.4 s a child)
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
    from transformers import CONFIG_MAPPING, AutoTokenizer  # noqa: F401

    CONFIG_MAPPING["llama"]  # noqa: B018 - the first config module a conversion imports, whatever its model type

    for line in sys.stdin:
        request = json.loads(line)
        # "script": another of llama.cpp's scripts (convert_lora_to_gguf.py, which imports the same modules)
        print(json.dumps({"code": convert(request.get("script", converter), request["argv"], request["log"])}),
              flush=True)


if __name__ == "__main__":
    main()
