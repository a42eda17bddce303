"""Small test helpers: run the CLI in-process, compare checkpoints tensor by tensor, build a fixture once per run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ffn_tools.cli import cli
from ffn_tools.io.readers import open_checkpoint


def run_cli(*args: str, ok: bool | None = True):
    """Invoke ``ffn-tools ARGS`` in-process; assert success, or with ``ok=False`` a could-not-run failure:
    exit status 2 and one clean line saying what is wrong (None: no assertion but that nothing escaped as a
    traceback)."""
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=True)
    if ok is None:
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    elif ok:
        assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}\n{result.exception!r}"
    else:
        assert result.exit_code == 2, f"exit {result.exit_code}: {result.output}"
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        assert "Traceback" not in result.output
        errors = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
        assert len(errors) == 1, result.output  # one line saying what is wrong (usage errors add a usage hint)
    return result


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as c:
        return {n: c[n].clone() for n in c}


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert raw(a[n]) == raw(b[n]), f"{n} differs"


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path``: to prove an input was not modified."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def plant(src: Path, dst: Path, edit=None, config=None) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with ``edit(state_dict)`` / ``config(dict)`` applied."""
    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        sd = load_file(f)
        if edit:
            edit(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, f, metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def failed_ffns(src: Path, planted: bytes, tmp_path: Path) -> list[dict]:
    """``verify SRC BAD --json`` where BAD is a GGUF of the bytes ``planted`` (a defect planted in an output's
    blocks): it must fail (exit 1); the FFNs that failed, as its JSON gives them."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(planted)
    result = run_cli("verify", src, bad, "--backend", "reference", "--json", ok=None)
    assert result.exit_code == 1, result.output
    return [f for f in json.loads(result.stdout)["ffns"] if not f["passed"]]


def write_tokenizer(path: Path, vocab_size: int | None = None) -> None:
    """A real word-level tokenizer: mlx_lm.load and mlx_lm.convert load one, and there is no hub here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import tiny_models

    vocab_size = vocab_size or tiny_models.COMMON["vocab_size"]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)


def progress_bars(monkeypatch) -> list:
    """The progress bars plans open from now on, each recording its total and its updates."""
    bars = []

    class Recorder:
        def __init__(self, total, desc):
            self.total, self.desc, self.steps = total, desc, []
            bars.append(self)

        def update(self, n):
            self.steps.append(n)

        def close(self):
            pass

    monkeypatch.setattr("ffn_tools.executor.Progress", Recorder)
    return bars


def once(path: Path, make) -> Path:
    """``path``, made by ``make(tmp)`` into a temporary sibling and moved into place, unless this run made it
    already (another xdist worker, or an earlier test); concurrent callers wait on its lock."""
    from filelock import FileLock

    with FileLock(f"{path}.lock"):
        if not path.exists():
            tmp = path.with_name(path.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            make(tmp)
            os.replace(tmp, path)
    return path
