"""mlx_lm's LoRA adapters: ``adapters.safetensors`` + ``adapter_config.json``, as ``mlx_lm.lora`` saves them and
``mlx_lm.load(path, adapter_path=...)`` applies them (``mlx_lm.tuner.utils.load_adapters``).

What mlx_lm 0.32 reads (checked against it; the tests load every output with ``mlx_lm.load``):

* ``adapter_config.json``: ``num_layers`` (LoRA goes into the last ``num_layers`` blocks; -1 or 0: all),
  ``lora_parameters``: ``rank``, ``scale`` (multiplied as it is, no alpha), ``dropout``, and ``keys`` (module paths
  inside a block; without it every linear layer of the block, routers included).
* ``<module>.lora_a`` / ``.lora_b``: a linear layer's (in, r) and (r, out), the transposes of PEFT's A and B;
  a ``SwitchLinear``'s (a stack of experts) (E, r, in) and (E, out, r), not transposed.
* one rank and one scale for the whole adapter; a LoRA layer the file leaves out keeps its initial value
  (lora_b zeros, lora_a random), silently: this writer gives every LoRA layer ``keys`` and ``num_layers`` create
  its factors, zeros where the adapter has none, so nothing is left to chance.

Which mlx_lm parameter a base tensor becomes is mlx_lm's own ``sanitize`` (``names.map_outputs``) run on the
tensors transformers saves for the base's config, so this format needs the base's config.json. Ranks that differ
are padded with zeros to the largest (exact); scales that differ are refused (one scale, and folding a ratio into
B would round).
"""

from __future__ import annotations

import json
from pathlib import Path

from ffn_tools.adapters.formats import AdapterFormat, no_base
from ffn_tools.adapters.model import Adapter, AdapterError, Lora
from ffn_tools.adapters.relayout import pad
from ffn_tools.errors import listing

CONFIG = "adapter_config.json"
WEIGHTS = "adapters.safetensors"


def _layout(config: dict | None, where: Path):
    """(mlx_lm's model Target, [Output], the base's tensors name -> shape): every mlx_lm parameter and the base
    tensors (as transformers saves them for ``config``) it is made of."""
    if not config:
        raise AdapterError(f"{where}: an mlx_lm adapter names mlx_lm's modules, so reading one needs the base model's "
                           f"config.json (its architecture), and {no_base(where)}: give the base model's directory "
                           "with base=", flags={"base=": "--base"})
    from .inverse import source_layout
    from .models import target
    from .names import map_outputs

    tg = target(dict(config), str(where))
    layout = source_layout(config)
    outputs, _ = map_outputs(tg.build() if tg.build else tg.model, {n: (s, "F32") for n, s in layout.items()})
    return tg, outputs, layout


def _layers(config: dict) -> int:
    from ffn_tools.registry import config_int

    return config_int(config, "num_hidden_layers", "the base's config.json")


class MlxAdapter(AdapterFormat):
    name = "mlx"
    needs_base = True

    def can_read(self, path: Path) -> bool:
        try:
            return path.is_dir() and (path / WEIGHTS).is_file() and \
                "lora_parameters" in json.loads((path / CONFIG).read_text())
        except (OSError, ValueError):
            return False

    def read(self, path: Path, config: dict | None = None) -> Adapter:
        from ffn_tools.io.readers import open_checkpoint

        cfg = json.loads((path / CONFIG).read_text())
        if cfg.get("fine_tune_type", "lora") != "lora":
            raise AdapterError(f"{path}: an mlx_lm {cfg['fine_tune_type']} adapter; ffn-tools reads LoRA ones")
        scale = float(cfg["lora_parameters"]["scale"])
        with open_checkpoint(path / WEIGHTS) as ckpt:
            tensors = {n: ckpt[n] for n in ckpt}
        _, outputs, _ = _layout(config, path)
        sources = {o.name.removesuffix(".weight"): o.sources for o in outputs if o.name.endswith(".weight")}
        loras: dict[str, Lora] = {}
        for key in sorted(k for k in tensors if k.endswith(".lora_a")):
            module = key.removesuffix(".lora_a")
            a, b = tensors[key], tensors.get(module + ".lora_b")
            if b is None:
                raise AdapterError(f"{path}: {key} has no lora_b")
            src = sources.get(module)
            if not src:
                raise AdapterError(f"{path}: {module} is no linear layer of mlx_lm's model for this base")
            if a.ndim == 3:  # SwitchLinear: (E, r, in), (E, out, r); one base tensor per expert
                if len(src) != a.shape[0]:
                    raise AdapterError(f"{path}: {module} holds {a.shape[0]} experts, the base {len(src)}")
                for e, name in enumerate(src):
                    loras[name] = Lora(name, a[e].contiguous(), b[e].contiguous(), scale)
            elif len(src) == 1:
                loras[src[0]] = Lora(src[0], a.T.contiguous(), b.T.contiguous(), scale)
            else:
                raise AdapterError(f"{path}: {module} is made of {len(src)} base tensors in mlx_lm; its LoRA is not")
        unknown = sorted(k for k in tensors if not k.endswith((".lora_a", ".lora_b")))
        if unknown:
            raise AdapterError(f"{path}: tensors that are no LoRA factors ({listing(unknown, 3)}): a DoRA or full "
                               "fine-tune, which ffn-tools does not read")
        return Adapter(path, self.name, loras, config, {"mlx": {k: v for k, v in cfg.items() if k != "lora_parameters"}})

    def write(self, adapter: Adapter, out: Path, config: dict | None = None, base: Path | None = None,
              **options) -> list[str]:
        import torch
        from safetensors.torch import save_file

        from ffn_tools.adapters.conform import conform

        tg, outputs, layout = _layout(config, adapter.path)
        adapter, _ = conform(adapter, layout, None)
        scales = {x.scale for x in adapter.loras.values()}
        if len(scales) > 1:
            raise AdapterError(f"{adapter.path}: its LoRAs have different scales ({sorted(scales)}); mlx_lm's adapter "
                               "has one, and folding the ratios into B would round")
        rank = max(x.rank for x in adapter.loras.values())
        modules: dict[str, tuple] = {}
        for o in outputs:
            hit = [adapter.loras[s] for s in o.sources if s in adapter.loras]
            if not hit:
                continue
            if len(hit) != len(o.sources):
                raise AdapterError(f"{o.name}: mlx_lm stacks {len(o.sources)} base tensors into it, the adapter has "
                                   f"LoRAs of {len(hit)}; give every expert of a layer factors")
            module = o.name.removesuffix(".weight")
            if not o.name.endswith(".weight") or not module.startswith("model.layers."):
                raise AdapterError(f"{o.name}: a LoRA outside the decoder blocks has no mlx_lm adapter form here")
            padded = [pad(x, rank) for x in hit]
            if len(o.sources) == 1 and len(o.shape) == 2:
                modules[module] = (padded[0].a.T.contiguous(), padded[0].b.T.contiguous())
            else:
                modules[module] = (torch.stack([x.a for x in padded]), torch.stack([x.b for x in padded]))
        taken = sum(len(o.sources) for o in outputs if o.name.removesuffix(".weight") in modules)
        if taken != len(adapter.loras):
            left = [t for t in adapter.loras if not any(t in o.sources for o in outputs
                                                       if o.name.removesuffix(".weight") in modules)]
            raise AdapterError(f"LoRAs with no mlx_lm module to go to: {listing(left, 4)}")
        layer_of = {m: int(m.split(".")[2]) for m in modules}
        keys = sorted({m.split(".", 3)[3] for m in modules})
        n = _layers(tg.config)
        first = min(layer_of.values())
        tensors: dict[str, torch.Tensor] = {}
        dtype = adapter.dtype
        for layer in range(first, n):
            for key in keys:
                module = f"model.layers.{layer}.{key}"
                if module in modules:
                    a, b = modules[module]
                else:  # a LoRA layer mlx_lm will create: zero factors, not its random initial lora_a
                    shape = tg.params.get(module + ".weight")
                    if shape is None:
                        raise AdapterError(f"{module}: mlx_lm's model has no such layer for keys {keys}")
                    a, b = _zeros(shape, rank, dtype)
                tensors[module + ".lora_a"], tensors[module + ".lora_b"] = a.to(dtype), b.to(dtype)
        cfg = {"fine_tune_type": "lora", "num_layers": n - first,
               "lora_parameters": {"rank": rank, "scale": scales.pop(), "dropout": 0.0, "keys": keys}}
        if base is not None:
            cfg["model"] = str(Path(base).resolve())
        out.mkdir()
        save_file(tensors, str(out / WEIGHTS), metadata={"format": "mlx"})
        (out / CONFIG).write_text(json.dumps(cfg, indent=4, sort_keys=True) + "\n")
        return [WEIGHTS, CONFIG]


def _zeros(shape: tuple[int, ...], rank: int, dtype):
    import torch

    if len(shape) == 3:  # (E, out, in)
        return torch.zeros(shape[0], rank, shape[2], dtype=dtype), torch.zeros(shape[0], shape[1], rank, dtype=dtype)
    return torch.zeros(shape[1], rank, dtype=dtype), torch.zeros(rank, shape[0], dtype=dtype)


ADAPTER = MlxAdapter()
