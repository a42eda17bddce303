"""A Meta or Mistral native checkpoint seen with Hugging Face names (the converter surface's ``open``).

Each model-parallel shard is opened lazily by the store (pickles memory-mapped with ``weights_only=True``,
safetensors by header). A Hugging Face tensor is made when asked for: its pieces are read from every shard
and concatenated along the dimension ``layout.TENSORS`` declares, then q and k rows are put in Hugging Face's
rotary order. So memory stays one tensor (and its pieces), and a single-shard tensor without the permutation
keeps its place in a safetensors file: converting it copies bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ffn_tools.errors import CheckpointError, listing
from ffn_tools.io.dtypes import short_name
from ffn_tools.io.store import Checkpoint, TensorInfo
from ffn_tools.io.readers import open_checkpoint

from .layout import DROPPED, EMBED, TENSORS, Native, hf_config, permute

PARAMS = "params.json"


def shard_files(root: Path) -> list[Path]:
    """The native weight files of a directory, in rank order (empty when it has none)."""
    pth = sorted(root.glob("consolidated.*.pth"))
    return pth or sorted(root.glob("consolidated*.safetensors"))


@dataclass(frozen=True)
class _Source:
    native: str
    dim: int | None
    heads: int | None  # rotary permutation over this many heads, or None


class NativeCheckpoint(Checkpoint):
    """A lazy, read-only Hugging Face-named view of a Meta or Mistral native checkpoint (see the module doc)."""

    kind, described = "native", "a native (Meta/Mistral)"

    def __init__(self, path: Path):
        root = path if path.is_dir() else path.parent
        try:
            params = json.loads((root / PARAMS).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{root / PARAMS}: cannot read it ({e}); a native checkpoint needs the "
                                  "params.json its publisher ships beside the weights") from None
        if not isinstance(params, dict) or not all(isinstance(params.get(k), int) for k in ("dim", "n_layers", "n_heads")):
            raise CheckpointError(f"{root / PARAMS}: needs integer dim, n_layers and n_heads")
        files = shard_files(root)
        if not files:
            raise CheckpointError(f"{root}: no consolidated.*.pth or consolidated.safetensors beside params.json")
        self.shards = [open_checkpoint(f) for f in files]
        self._sources: dict[str, _Source] = {}
        infos, unknown, problems = {}, [], []
        heads = {"q": params["n_heads"], "k": params.get("n_kv_heads") or params["n_heads"]}
        first = self.shards[0]
        for name in first:
            if name in DROPPED:
                continue
            spec, m = next(((t, m) for t in TENSORS if (m := t.pattern().fullmatch(name))), (None, None))
            if spec is None or m is None:  # both or neither
                unknown.append(name)
                continue
            hf = spec.hf.format(**m.groupdict())
            try:
                infos[hf] = self._plan(hf, name, spec, params, heads)
            except CheckpointError as e:
                problems.append(str(e))
        if unknown:
            problems.append(f"{len(unknown)} tensor(s) of no known native name: {listing(unknown)}")
        if problems:
            self.close()
            raise CheckpointError(f"{root}: cannot read this native checkpoint: " + "; ".join(problems))
        shapes = {n: i.shape for n, i in infos.items()}
        config = hf_config(params, shapes, short_name(next(iter(infos.values())).st_dtype),
                           any(".experts." in n for n in infos))
        super().__init__(path, root, files, infos, {"format": "pt"}, config)

    def _plan(self, hf: str, name: str, spec: Native, params: dict, heads: dict) -> TensorInfo:
        infos = []
        for s in self.shards:
            if name not in s:
                raise CheckpointError(f"{name} is in {self.shards[0].files[0].name} but not in {s.files[0].name}")
            infos.append(s.info(name))
        first = infos[0]
        dim = spec.dim
        if dim == EMBED:  # split along the width (Llama 2) unless one shard already has all of it (Llama 3)
            dim = 1 if first.shape[1] * len(infos) == params["dim"] else 0
        shape = list(first.shape)
        if dim is not None and len(infos) > 1:
            shape[dim] = sum(i.shape[dim] for i in infos)
        for i in infos[1:]:
            other = [d for k, d in enumerate(i.shape) if k != dim]
            if other != [d for k, d in enumerate(first.shape) if k != dim] or i.st_dtype != first.st_dtype:
                raise CheckpointError(f"{name}: shards disagree ({first.st_dtype}{list(first.shape)} vs "
                                      f"{i.st_dtype}{list(i.shape)})")
        self._sources[hf] = _Source(name, dim if len(infos) > 1 else None, heads.get(spec.rotary))
        copyable = len(infos) == 1 and spec.rotary is None and first.start is not None
        return TensorInfo(hf, first.st_dtype, tuple(shape), first.file, first.start if copyable else None)

    def _read(self, info: TensorInfo):
        import torch

        src = self._sources[info.name]
        if src.dim is None:  # one shard, or replicated on every rank
            t = self.shards[0][src.native]
        else:
            t = torch.cat([s[src.native] for s in self.shards], dim=src.dim)
        return permute(t, src.heads) if src.heads else t

    def rebuilt_files(self) -> tuple[dict[str, str | bytes], list[str]]:
        """generation_config.json as transformers' conversion scripts write it (their ``save_pretrained`` derives
        it from the config: ``GenerationConfig.from_model_config``), where the native directory has none."""
        if (self.root / "generation_config.json").is_file():
            return {}, []
        try:
            from transformers import AutoConfig, GenerationConfig
        except ImportError:  # no transformers: its client derives the same settings when it loads the output
            return {}, []
        cfg = AutoConfig.for_model(**{k: v for k, v in (self.config or {}).items() if k != "transformers_version"})
        text = GenerationConfig.from_model_config(cfg).to_json_string()
        return {"generation_config.json": text}, ["generation_config.json: as transformers' save_pretrained writes "
                                                  "it from config.json (the native checkpoint has none)"]

    def close(self) -> None:
        for s in getattr(self, "shards", []):
            s.close()

