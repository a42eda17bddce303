"""Tiny compressed-tensors checkpoints, written by compressed-tensors' own code from a real transformers model.

``build(arch, path, groups, ignore)`` saves the unquantized model (the twin) at ``path / "twin"``, applies
compressed-tensors' ``QuantizationConfig`` to it (``apply_quantization_config``), sets each module's scale and
zero point with compressed-tensors' ``calculate_qparams`` from the weight's own min/max per group (what a
min-max observer of llm-compressor computes), compresses it with ``ModelCompressor.compress_model`` and writes
it with ``save_pretrained`` plus ``ModelCompressor.update_config`` at ``path / "ct"``.
"""

from __future__ import annotations

from pathlib import Path

import torch

import tiny_models


def args(bits: int = 4, strategy: str = "group", group_size: int | None = 32, symmetric: bool = True):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size if strategy == "group" else None)


def build(arch: str, path: Path, groups: dict[str, tuple[list[str], object]], ignore: list[str] | None = None,
          dtype: torch.dtype = torch.bfloat16, fmt: str = "pack-quantized", prepare=None, **config) -> tuple[Path, Path]:
    """(twin, compressed) directories of a tiny ``arch`` model; ``groups``: name -> (targets, weights args);
    ``prepare(model)`` edits the model's weights first (both are saved from the edited model)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    model = _model(arch, dtype, **config)
    if prepare is not None:
        with torch.no_grad():
            prepare(model)
    twin, ct = path / "twin", path / "ct"
    model.save_pretrained(twin)
    qc = QuantizationConfig(config_groups={g: QuantizationScheme(targets=t, weights=a) for g, (t, a) in groups.items()},
                            ignore=ignore or ["lm_head"], quantization_status="calibration")
    apply_quantization_config(model, qc)
    with torch.no_grad():
        for _, m in model.named_modules():
            scheme = getattr(m, "quantization_scheme", None)
            if scheme is None:
                continue
            w, a = m.weight.data, scheme.weights
            size = a.group_size if a.strategy in ("group", "tensor_group") else w.shape[-1]
            x = w.unflatten(-1, (w.shape[-1] // size, size)) if a.strategy != "tensor" else w.reshape(1, 1, -1)
            gs = None
            if a.strategy == "tensor_group":  # NVFP4: a global scale first, as llm-compressor's observers
                gs = generate_gparam(w.amin().reshape(1), w.amax().reshape(1))
                m.weight_global_scale.data.copy_(gs)
            scale, zp = calculate_qparams(x.amin(-1), x.amax(-1), a, global_scale=gs)
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zp.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(ct)
    compressor.update_config(ct)
    return twin, ct


def _model(arch: str, dtype: torch.dtype, seed: int = 0, **config):
    """``tiny_models.make_model`` with config overrides (say ``intermediate_size``)."""
    import transformers

    cfg_name, model_name, extra = tiny_models.ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(**{**tiny_models.COMMON, **extra, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def decompressed(ct: Path, base: str) -> torch.Tensor:
    """Module ``base``'s weight as compressed-tensors' own compressor decompresses it (the oracle)."""
    import json

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    qc = QuantizationConfig.model_validate(json.loads((ct / "config.json").read_text())["quantization_config"])
    from compressed_tensors.utils.match import match_name

    scheme = next(s for s in qc.config_groups.values() if any(match_name(base, t) or t == "Linear" for t in s.targets))
    with safe_open(str(ct / "model.safetensors"), "pt") as f:
        sd = {k[len(base) + 1:]: f.get_tensor(k) for k in f.keys() if k.startswith(base + ".")}
    return BaseCompressor.load_from_registry(qc.format).decompress(sd, scheme)["weight"]


def nvfp4_args():
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    return NVFP4A16["weights"]


def to_modelopt(ct: Path, out: Path, inverted: bool = False) -> Path:
    """The ModelOpt NVFP4 twin of compressed-tensors NVFP4 checkpoint ``ct``, written by the inverse of
    compressed-tensors' own ModelOpt converter (``ModelOptNvfp4Converter.process``): ``X.weight_packed`` ->
    ``X.weight``, ``X.weight_scale_2 = 1 / X.weight_global_scale``, config.json's ModelOpt quantization_config
    (``inverted``: the global scale written as compressed-tensors stores it, the known mix-up)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(ct, out)
    sd = load_file(out / "model.safetensors")
    for k in [k for k in sd if k.endswith(".weight_packed")]:
        base = k[: -len(".weight_packed")]
        sd[base + ".weight"] = sd.pop(k)
        gs = sd.pop(base + ".weight_global_scale")
        sd[base + ".weight_scale_2"] = gs.clone() if inverted else (1 / gs).to(torch.float32)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                  "exclude_modules": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def modelopt_decompressed(path: Path, base: str) -> torch.Tensor:
    """ModelOpt module ``base`` as compressed-tensors reads it: its own converter to compressed-tensors NVFP4,
    then its NVFP4 decompression."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys() if k.startswith(base + ".")}
    sd = ModelOptNvfp4Converter(ignore=["lm_head"], targets=["Linear"]).process(sd)
    local = {k[len(base) + 1:]: v for k, v in sd.items()}
    return NVFP4PackedCompressor.decompress(local, QuantizationScheme(targets=["Linear"], weights=nvfp4_args()))["weight"]
