"""The lazy tensor store: a checkpoint is a read-only mapping ``name -> tensor`` (``Checkpoint``).

Names, shapes and dtypes are known from headers without reading data (``TensorInfo``); ``ckpt[name]`` reads one
tensor. Readers subclass ``Checkpoint``: the PyTorch files' in ``readers`` (safetensors, pickles, indexes), the
other formats' in ``converters/``, each presenting the same mapping with Hugging Face PyTorch names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, listing
from .dtypes import as_st, nbytes, torch_dtype
from .raw import RawTensor

PICKLE_SUFFIXES = (".bin", ".pth", ".pt")
# Files that hold weights; everything else in a checkpoint directory is carried over by writers.
WEIGHT_SUFFIXES = (".safetensors", ".msgpack", ".gguf", *PICKLE_SUFFIXES)
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "flax_model.msgpack.index.json")
# The non-weight files a client reads beside the weights: what verify compares (``checks.side_files``) and, with
# config.json, what an output carries over from beside a single weight file (``executor.side_files``).
SIDE_FILES = (
    "tokenizer.json",  # fast tokenizer (transformers, mlx_lm, vLLM): vocab, merges, added tokens, post-processor
    "tokenizer.model",  # sentencepiece model: slow tokenizers, llama.cpp's converter (bytes)
    "tokenizer.model.v3",  # mistral_common's sentencepiece tokenizer (vLLM --tokenizer-mode mistral; bytes)
    "tekken.json",  # mistral_common's tiktoken-style tokenizer: ranked vocab, special tokens
    "tokenizer_config.json",  # transformers: tokenizer class, special tokens, chat template, max length
    "special_tokens_map.json",  # legacy special tokens, read when tokenizer_config.json has no added_tokens_decoder
    "added_tokens.json",  # legacy added tokens of slow tokenizers, {token: id}
    "vocab.json",  # vocabulary of slow byte-level BPE (GPT-2 style) tokenizers, {token: id}
    "merges.txt",  # their merges, one a line, in priority order
    "chat_template.jinja",  # the chat template (transformers >= 4.47 reads it before tokenizer_config.json's)
    "additional_chat_templates/*.jinja",  # named templates (tool_use, rag), read beside it
    "chat_template.json",  # a processor's chat template (multimodal models)
    "generation_config.json",  # generate()'s defaults: eos/bos/pad ids, do_sample, temperature, top_p, ...
)

if TYPE_CHECKING:
    import torch


class TensorInfo:
    """Where a tensor lives and what it is, known without reading it.

    Args:
        name: the tensor's name.
        dtype: a torch dtype or a safetensors dtype string ("BF16"); ``.dtype`` gives the torch dtype
            (importing torch), ``.st_dtype`` the string (without importing torch).
        shape: its shape.
        file: the file holding it.
        start: the absolute byte offset of its data in ``file`` when the bytes can be copied verbatim
            (C-contiguous little-endian data in a safetensors file), else None.
    """

    __slots__ = ("name", "st_dtype", "shape", "file", "start")

    def __init__(self, name: str, dtype, shape: tuple[int, ...], file: Path, start: int | None = None):
        self.name, self.st_dtype, self.shape, self.file, self.start = name, as_st(dtype), tuple(shape), file, start

    @property
    def dtype(self) -> "torch.dtype":
        return torch_dtype(self.st_dtype)

    @property
    def nbytes(self) -> int:
        return nbytes(self.st_dtype, self.shape)

    def __repr__(self) -> str:
        return f"TensorInfo({self.name!r}, {self.st_dtype}, {list(self.shape)}, {self.file.name}, start={self.start})"


class Checkpoint(Mapping[str, "torch.Tensor"]):
    """A read-only, lazy mapping of tensor names to tensors, with the checkpoint's config and metadata.

    Every reader implements this one interface; what a reader can do beyond the mapping is a method here
    with a default (``read_raw``, ``quantized``, ``quantized_parts``, ``stored``, ``decoded``), so core code
    never probes a checkpoint for attributes.

    What a reader is, declared by its class (views of another checkpoint take them from it: ``view_of``):
    ``kind`` (the storage as reports name it: "safetensors", "mlx"), ``described`` (with its article, as a
    sentence names it), ``rewritable`` (Hugging Face PyTorch weights as stored: what transformers loads and
    split/fuse rewrite), ``preads`` (tensors read with ``pread`` into memory of their own, from any thread:
    verify reads them ahead in the background). ``format`` is the format plug-in that opened it
    (``ffn_tools.formats.Format``: its options, its client), set by the plug-in; None for a checkpoint opened
    by the core alone.

    Attributes:
        path: the path the user gave.
        root: the directory holding config.json and the other non-weight files.
        files: the weight files, in order.
        config: config.json as a dict, or None.
        metadata: safetensors ``__metadata__`` (of the first shard), empty if none.
        format: the format plug-in that opened it (see above).
        absent: shard file name -> the tensors the index maps to it, for the shards of an index that are not
            on disk (opened with ``absent_shards=True``: ``verify --layers`` on a machine holding only the
            shards its range needs); empty for a whole checkpoint. Views that read another checkpoint report
            it through ``stored``.
    """

    kind: str = "safetensors"
    described: str = "a safetensors"
    rewritable: bool = False
    preads: bool = False
    format: Any = None  # an ffn_tools.formats.Format (typed loosely: the store sits below the formats)
    absent: Mapping[str, tuple[str, ...]] = MappingProxyType({})
    resolves_quantization = False  # True: ``quantized`` says per tensor how it is stored (views that decode)
    kept_codes: frozenset[str] = frozenset()  # tensors that hold another checkpoint's stored codes (a GGUF's)
    like: "Checkpoint | None" = None  # the checkpoint its format read it beside (``Format.open``'s ``like``)
    # what opens it again where no format did (``io.readers`` registers its ``open_checkpoint`` as it is imported:
    # a checkpoint without a format was opened by it; the store imports no reader)
    opener: Any = None

    def __init__(self, path: Path, root: Path, files: list[Path], infos: dict[str, TensorInfo],
                 metadata: dict[str, str] | None = None, config: dict | None = None):
        self.path = path
        self.root = root
        self.files = files
        self._infos = infos
        self.metadata = dict(metadata or {})
        self.config = config if config is not None else read_config(root)
        if self.config is None and "hidden_act" in self.metadata:  # a single-file extract output
            self.config = {"hidden_act": self.metadata["hidden_act"]}
            if "ffn_tools_clamped" in self.metadata:  # ffn.CLAMPED_RECORD: its source's clamped unit
                try:
                    self.config["ffn_tools_clamped"] = json.loads(self.metadata["ffn_tools_clamped"])
                except ValueError:
                    pass  # not ours: the unit reads as plain, and verify against the source says so

    def info(self, name: str) -> TensorInfo:
        """Shape, dtype and location of a tensor, without reading it."""
        return self._infos[name]

    def __getitem__(self, name: str) -> "torch.Tensor":
        return self._read(self._infos[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def _read(self, info: TensorInfo) -> "torch.Tensor":
        raise NotImplementedError

    def read_raw(self, name: str) -> RawTensor:
        """Tensor ``name``'s bytes as a ``RawTensor``: read from their place in the file where they lie there
        as stored (no torch), else decoded by the reader (views that decode without torch override this)."""
        info = self._infos[name]
        if info.start is not None:
            try:
                return RawTensor(info.st_dtype, info.shape, read_bytes(info.file, info.start, info.nbytes))
            except OSError as e:
                raise CheckpointError(f"{info.file}: cannot read tensor {name!r} ({e})") from None
        return RawTensor.of(self[name])

    def quantized(self, name: str) -> Any:
        """How tensor ``name`` is stored quantized while this view reads it decoded: its ``quant.Module`` (scheme,
        parameters, stored parts); None for a tensor stored as it reads (every tensor, here). Typed loosely: the
        store sits below the quantization schemes."""
        return None

    def quantized_parts(self, name: str):
        """The stored parts of quantized tensor ``name`` as its scheme reads them (``QuantScheme.requantized``
        re-derives them from the other side's weight); None where it is stored as it reads."""
        return None

    def carried_metadata(self) -> tuple[dict[str, str], list[str]]:
        """Safetensors metadata an export of this checkpoint carries so that verify against its source knows what
        it holds (a GGUF's norms read back minus one: ``checks.rounded``), and a line for each in a summary's
        changes; ({}, []) where nothing needs saying."""
        return {}, []

    def rebuilt_files(self) -> tuple[dict[str, str | bytes], list[str]]:
        """The side files a Hugging Face client reads (tokenizer, generation_config.json, README.md) that this
        checkpoint stores otherwise and rebuilds (a GGUF's tokenizer from its metadata), name -> content, and a
        line for each in a summary's changes; ({}, []) where its own files are carried as they are."""
        return {}, []

    @property
    def stored(self) -> "Checkpoint":
        """The checkpoint as stored: views that decode tensors (MXFP4, FP8 dequantized) give the one they
        decode, which is what a client loads; every other checkpoint is itself."""
        return self

    def absent_line(self) -> str | None:
        """``2 of 5 shards absent (model-00001-of-00005.safetensors, ...)``: the stored checkpoint's ``absent``
        shards, said in one line; None for a whole checkpoint."""
        stored = self.stored
        if not stored.absent:
            return None
        return (f"{len(stored.absent)} of {len(stored.files) + len(stored.absent)} shards absent "
                f"({listing(list(stored.absent), 4)})")

    @property
    def label(self) -> str:
        """The format as reports name it ("safetensors, MXFP4 read dequantized")."""
        return self.kind

    def view_of(self, ckpt: "Checkpoint") -> None:  # noqa: D401
        """Take what ``ckpt`` is (``kind``, ``described``, ``rewritable``, ``preads``, ``format``): this is a view of
        it."""
        self.kind, self.described, self.rewritable = ckpt.kind, ckpt.described, ckpt.rewritable
        self.preads, self.format = ckpt.preads, ckpt.format

    def decoded(self) -> list[dict]:
        """What this view decodes, for ``inspect``: one {dtype, scales, block, weights} per kind; [] when
        nothing is."""
        return []

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())

    def __reduce__(self):
        """Pickled as how to open it again, not as its open files: its format plug-in (``Format.open``, the core's
        reader where none opened it), path (made absolute: a task runs elsewhere), ``absent_shards`` and ``like``
        (the checkpoint it was read beside: an MLX model's layout is traced from its source's), and which of what
        that opens it is (the view, or the checkpoint the view decodes). A ``--ray`` task's plan slice reads its input
        so (``cluster``), and ``verify --ray``'s tasks both sides."""
        return reopen, (self.format, Path(os.path.abspath(self.path)), bool(self.stored.absent), type(self),
                        self.like, None if self.format is not None else self.opener)

    def close(self) -> None:
        """Release open files; the mapping is unusable afterwards."""

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_bytes(file, start: int, size: int) -> bytearray:
    """``size`` bytes of ``file`` from ``start``, read with ``pread`` into a buffer of their own.

    Raises:
        OSError: the file ends early.
    """
    data = bytearray(size)
    with open(file, "rb", buffering=0) as f:
        read_into(f.fileno(), memoryview(data), start, file)
    return data


def read_into(fd: int, view: memoryview, start: int, name) -> None:
    """Fill ``view`` with the bytes of the open file ``fd`` (``name``, for the error) from ``start`` (``pread``): a
    caller reading chunk after chunk gives the same buffer each time.

    Raises:
        OSError: the file ends early.
    """
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], start + done)
        if n <= 0:
            raise OSError(f"{name}: ended early at byte {start + done}")
        done += n


STRING_KEYS = ("model_type", "hidden_act", "hidden_activation")  # config.json keys ffn-tools reads as names


def read_config(root: Path) -> dict | None:
    """config.json of a checkpoint directory, or None when there is none.

    Raises:
        CheckpointError: config.json exists but is not valid JSON.
    """
    p = root / "config.json"
    if not p.is_file():
        return None
    try:
        config = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{p}: not a JSON object (found {type(config).__name__})")
    wrong = [k for k in STRING_KEYS if config.get(k) is not None and not isinstance(config[k], str)]
    arch = config.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        wrong.append("architectures")
    if wrong:
        what = "; ".join(f"{k} must be {'a list of strings' if k == 'architectures' else 'a string'} "
                         f"(found {json.dumps(config[k])[:40]})" for k in wrong)
        raise CheckpointError(f"{p}: {what}; fix config.json")
    return config



_GIVEN: list[dict] = []  # the config ``ffn-tools --config FILE`` gave, for checkpoints that carry none


def give_config(path: Path | None) -> None:
    """Take config.json ``path`` as the config of checkpoints read without one (a training run's: DCP, MaxText);
    None forgets it.

    Raises:
        CheckpointError: the file is not a JSON object.
    """
    _GIVEN.clear()
    if path is not None:
        config = read_config(Path(path).parent) if Path(path).name == "config.json" else None
        if config is None:
            try:
                config = json.loads(Path(path).read_text())
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path}: cannot read it as a config ({e})") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{path}: not a JSON object")
        _GIVEN.append(config)


def given_config() -> dict | None:
    """The config ``give_config`` took, or None."""
    return _GIVEN[0] if _GIVEN else None


def config_beside(*roots: Path) -> dict | None:
    """The config of a checkpoint that may carry none (a training run's): the first of ``roots`` holding a
    config.json, else the one ``ffn-tools --config FILE`` gave (a copy), else None."""
    for root in roots:
        config = read_config(root)
        if config is not None:
            return config
    given = given_config()
    return dict(given) if given is not None else None


def say_assumed(root: Path, assumed: list[str]) -> None:
    """One line on stderr naming what a reader assumed for want of a config, and how to give one."""
    if assumed:
        from ..progress import say

        say(f"{root}: no config.json; {'; '.join(assumed)}. Give the model's own with ffn-tools --config FILE")


def config_dtype(config: dict | None) -> str | None:
    """The dtype a config declares: the newer ``dtype`` key, else ``torch_dtype``."""
    if not config:
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None


def reopen(fmt, path: Path, absent_shards: bool, kind: type, like: Checkpoint | None = None,
           opener: Callable[[Path, bool], Checkpoint] | None = None) -> Checkpoint:
    """``Checkpoint.__reduce__``'s other half: ``path`` opened again as ``fmt`` opened it, the one of type ``kind``
    (the view, or what it decodes).

    Raises:
        CheckpointError: ``path`` no longer reads as it did (another node sees other files there).
    """
    if fmt is None:
        if opener is None:
            raise CheckpointError(f"{path}: opened by neither a format nor a reader, it cannot be opened again")
        ckpt = opener(path, absent_shards)
    else:
        ckpt = fmt.open(path, absent_shards=absent_shards, like=like)
    c: Checkpoint
    for c in (ckpt, ckpt.stored):
        if type(c) is kind:
            return c
    raise CheckpointError(f"{path}: opened again here, it reads as {type(ckpt).__name__}, not {kind.__name__}")
