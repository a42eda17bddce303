"""llama.cpp's LoRA adapters: a GGUF of ``general.type`` "adapter", as llama.cpp's own ``convert_lora_to_gguf.py``
writes it and llama.cpp applies it (``--lora``, llama-cpp-python's ``lora_path``).

Writing runs that converter itself (the file is its bytes, as ``--to gguf`` runs ``convert_hf_to_gguf.py``), on a
PEFT adapter ffn-tools lays out for it first:

* targets named as the base's checkpoint names its tensors (``adapters.conform``): a LoRA of transformers v5's
  stacked experts (PEFT ``target_parameters``), which the converter refuses, becomes one LoRA per expert, which it
  stacks into ``blk.L.ffn_{gate,up,down}_exps``; an expert projection without factors gets zero ones (the
  converter needs every expert's gate, up and down);
* llama.cpp scales each tensor by ``alpha / rank`` with one ``adapter.lora.alpha`` for the file, and reads no
  rsLoRA flag and no per-module alpha: an adapter whose ``scale · rank`` is one number is written with that as
  alpha (an rsLoRA adapter's ``alpha / sqrt(r) · r``); one where it differs is refused, as a file llama.cpp would
  run with other scales (the converter itself writes those without a word).

The temporary PEFT directory has the source adapter's name and model card (README.md), from which the converter
takes ``general.name`` and ``general.base_model.*``: a PEFT adapter that needs no re-layout gives the bytes
``convert_lora_to_gguf.py --base BASE`` gives on it (tested).

Reading maps llama.cpp's tensor names back to Hugging Face's (``names``; q and k rows out of llama.cpp's rotary
order), ``blk.L.ffn_*_exps`` into per-expert LoRAs; scale ``alpha / rank`` (llama.cpp's: 1 where alpha is 0).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from ffn_tools.adapters.formats import AdapterFormat
from ffn_tools.adapters.model import Adapter, AdapterError, Lora

OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # convert_lora_to_gguf.py's --outtype (its "auto" fails on LoRAs)


def _is_lora_gguf(path: Path) -> bool:
    if path.suffix != ".gguf" or not path.is_file():  # asked of every path: gguf and numpy only for a GGUF
        return False
    from .header import string_field

    return string_field(path, "general.type") == "adapter"


class GgufAdapter(AdapterFormat):
    name = "gguf"
    needs_base = True
    options = frozenset({"outtype"})

    def can_read(self, path: Path) -> bool:
        return _is_lora_gguf(path)

    def read(self, path: Path, config: dict | None = None) -> Adapter:
        import torch
        from gguf import GGUFReader

        from .names import expert_names, family_for, hf_names
        from .reader import rotary_to_hf

        reader = GGUFReader(path)
        fields = {f.name: f for f in reader.fields.values()}
        arch = bytes(fields["general.architecture"].parts[-1]).decode()
        alpha = float(fields["adapter.lora.alpha"].parts[-1][0]) if "adapter.lora.alpha" in fields else 0.0
        data = {}
        for t in reader.tensors:
            if t.tensor_type.name not in ("F32", "F16", "BF16"):
                raise AdapterError(f"{path}: {t.name} is {t.tensor_type.name}; ffn-tools reads f32, f16 and bf16 "
                                   "GGUF LoRAs")
            raw = torch.from_numpy(t.data.copy())
            if t.tensor_type.name == "BF16":
                raw = raw.view(torch.bfloat16)
            data[t.name] = raw.reshape([int(x) for x in reversed(t.shape.tolist())])
        bases = sorted({n.rsplit(".", 1)[0] for n in data})
        family = family_for(arch, bases)
        layers = (config or {}).get("num_hidden_layers") or 1 + max(int(n.split(".")[1]) for n in bases
                                                                      if n.startswith("blk."))
        names = hf_names(family, int(layers))
        loras: dict[str, Lora] = {}
        for g in bases:
            a, b = data.get(g + ".lora_a"), data.get(g + ".lora_b")
            if a is None or b is None:
                raise AdapterError(f"{path}: {g} lacks lora_a or lora_b")
            scale = alpha / a.shape[-2] if alpha else 1.0
            if g.endswith("_exps.weight"):
                layer, kind = int(g.split(".")[1]), g.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
                for e, name in enumerate(expert_names(family, layer, kind, a.shape[0])):
                    loras[name] = Lora(name, a[e].contiguous(), b[e].contiguous(), scale, alpha or None)
                continue
            hf = names.get(g)
            if hf is None:
                raise AdapterError(f"{path}: {g} is no tensor llama.cpp's {arch} names")
            if family.rotary and hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                if not config:
                    raise AdapterError(f"{path}: its q/k LoRAs are in llama.cpp's rotary order; give the base "
                                       "(base=) for the head counts that undo it", flags={"base=": "--base"})
                key = "num_attention_heads" if "q_proj" in hf else "num_key_value_heads"
                b = rotary_to_hf(b, int(config.get(key) or config["num_attention_heads"])).contiguous()
            loras[hf] = Lora(hf, a.contiguous(), b.contiguous(), scale, alpha or None)
        return Adapter(path, self.name, loras, config, {})

    def write(self, adapter: Adapter, out: Path, config: dict | None = None, base: Path | None = None,
              **options) -> list[str]:
        from ffn_tools.adapters.conform import conform
        from ffn_tools.converters import open_any

        from . import zygote
        from .source import LORA as CONVERTER
        from .source import cache_dir, llama_cpp_dir
        from .writer import _env

        if base is None or not (Path(base) / "config.json").is_file():
            raise AdapterError("convert_lora_to_gguf.py reads the base model's config.json: give the base model's "
                               "directory (base=)", flags={"base=": "--base"})
        outtype = options.get("outtype") or "f32"  # the converter's default
        if outtype not in OUTTYPES:
            raise AdapterError(f"--outtype {outtype}: a GGUF LoRA is one of {', '.join(OUTTYPES)}")
        with open_any(Path(base)) as ckpt:
            shapes = {n: tuple(ckpt.info(n).shape) for n in ckpt}
            adapter, _ = conform(adapter, shapes, None)
            adapter = _complete_experts(adapter, ckpt)
        alphas = {x.target: x.scale * x.rank for x in adapter.loras.values()}
        if len(set(alphas.values())) > 1:
            by = sorted(set(alphas.values()))
            raise AdapterError(f"{adapter.path}: llama.cpp scales every LoRA by one alpha / its rank; this adapter's "
                               f"scale x rank differs across targets ({', '.join(f'{v:g}' for v in by[:4])}), so "
                               "llama.cpp would run it with other scales")
        alpha = next(iter(alphas.values()))
        if not alpha:
            raise AdapterError(f"{adapter.path}: alpha 0: llama.cpp would scale by 1")
        adapter = adapter.with_loras({t: replace(x, alpha=alpha, rslora=False) for t, x in adapter.loras.items()})
        from ffn_tools.adapters.formats import get

        root = llama_cpp_dir()
        if not (root / CONVERTER).is_file():
            raise AdapterError(f"{root} holds llama.cpp's convert_hf_to_gguf.py but not its {CONVERTER} (a tree an "
                               f"older ffn-tools fetched, or your $FFN_TOOLS_LLAMA_CPP): remove it (under "
                               f"{cache_dir()}, it is fetched again with both) or point $FFN_TOOLS_LLAMA_CPP at a "
                               "llama.cpp checkout")
        with tempfile.TemporaryDirectory() as tmp:
            peft = Path(tmp) / (adapter.path.name if adapter.path.is_dir() else adapter.path.stem)
            get("peft").write(adapter, peft, config, None)
            if adapter.path.is_dir() and (adapter.path / "README.md").is_file():  # the converter's model card
                shutil.copy2(adapter.path / "README.md", peft / "README.md")
            argv = ["--base", str(base), "--outtype", outtype, "--outfile", str(out), str(peft)]
            proc = zygote.script(root / CONVERTER, argv, _env())  # the script as it is, forked from the zygote
        if proc.returncode != 0 or not out.is_file():
            raise AdapterError(f"llama.cpp's {CONVERTER} could not convert this adapter: {zygote.last_line(proc)}")
        return [out.name]


def _complete_experts(adapter: Adapter, ckpt) -> Adapter:
    """Zero LoRAs for the expert projections of a layer whose other experts have some: llama.cpp's converter
    stacks a layer's experts and refuses a layer with some missing."""
    import torch

    from ffn_tools.detect import find_ffns

    loras = dict(adapter.loras)
    experts = [f for f in find_ffns(ckpt).ffns if f.ref.kind == "expert"]
    layers = {f.ref.layer for f in experts if any(n in loras for n in f.names.values())}
    some = next(iter(loras.values()), None)
    added = []
    for f in experts:
        if f.ref.layer not in layers or f.index is not None:
            continue
        for role, name in f.names.items():
            if role.endswith("_bias") or name in loras or some is None:
                continue
            out, inp = ckpt.info(name).shape
            loras[name] = Lora(name, torch.zeros(some.rank, inp, dtype=some.a.dtype),
                               torch.zeros(out, some.rank, dtype=some.b.dtype), some.scale, some.alpha, some.rslora)
            added.append(name)
    return adapter.with_loras(loras) if added else adapter


ADAPTER = GgufAdapter()
