"""PEFT's LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors`` (or a weights-only
``adapter_model.bin``), read into and written from ``ffn_tools.adapters.Adapter``.

What PEFT 0.21-0.22 saves (checked against both; ``tests/test_adapters.py`` runs PEFT itself):

* ``target_modules``: per module ``base_model.model.<module>.lora_A.weight`` (r, in) and ``.lora_B.weight``
  (out, r); the module's weight ``<module>.weight`` is the target.
* ``target_parameters`` (a parameter of a module, transformers v5's stacked experts ``mlp.experts.gate_up_proj``):
  the wrappers nest on the module in the order its parameters are registered, the first innermost, so with k
  parameters targeted the i-th's keys carry ``.base_layer`` k-1-i times. Its lora_A (r·E, in) holds expert e's
  rows at ``e·r:(e+1)·r``; its lora_B (out, r·E) holds expert e's columns at ``e::E`` (interleaved, unlike A).
  PEFT 0.22 turns ``target_modules`` naming gate/up/down on such experts into ``target_parameters`` of bare names
  (``gate_up_proj``, ``down_proj``; rank and alpha doubled for ``gate_up_proj`` by a pattern), so a name in both
  lists is a ``target_modules`` weight on a module ``target_modules`` names, a parameter elsewhere.
* how PEFT merges (``merge_and_unload``; its live forward the same): a ``target_modules`` LoRA's float32 delta
  is added to the weight in place, one rounding to the weight's dtype; a ``target_parameters`` one
  (``ParamWrapper.get_delta_weight``) is cast to the parameter's dtype first, then added: two roundings
  (``Lora.delta_rounded``, which verify allows).
* scale ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), r and alpha per target from ``rank_pattern`` /
  ``alpha_pattern``: the first key (in order) for which ``(.*\\.)?(key)$`` matches the module name (the parameter's
  full name for ``target_parameters``).

Refused with a message: DoRA, LoRA biases, ``fan_in_fan_out`` (Conv1D bases), embedding LoRAs, ``modules_to_save``,
other PEFT methods.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ffn_tools.adapters.formats import AdapterFormat
from ffn_tools.adapters.model import Adapter, AdapterError, Lora

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PREFIX = "base_model.model."
# transformers v5's expert modules register their stacked parameters in this order (PEFT nests its wrappers by it)
PARAMETER_ORDER = ("gate_up_proj", "gate_up_proj_bias", "gate_proj", "up_proj", "down_proj", "down_proj_bias")
_KEY = re.compile(r"(?P<module>.+?)(?P<nest>(?:\.base_layer)*)\.lora_(?P<ab>[AB])\.weight")
# settings ffn-tools does not carry, each with what it would change
REFUSED = {"use_dora": "DoRA (a magnitude vector on top of B·A)", "lora_bias": "a bias on lora_B",
           "fan_in_fan_out": "fan_in_fan_out (Conv1D weights stored (in, out))"}


def pattern_value(patterns: dict | None, name: str, default):
    """PEFT's ``get_pattern_key``: the value of the first key of ``patterns`` matching a dot-bounded suffix of
    ``name``, else ``default``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def scale_of(alpha: float, r: int, rslora: bool) -> float:
    """PEFT's scaling, computed as PEFT computes it."""
    return alpha / math.sqrt(r) if rslora else alpha / r


def alpha_for(scale: float, r: int, rslora: bool, stated: float | None = None) -> float | int:
    """An ``lora_alpha`` PEFT turns into exactly ``scale`` at rank ``r`` (``stated`` where it does)."""
    candidates = [stated] if stated is not None else []
    guess = scale * (math.sqrt(r) if rslora else r)
    candidates += [round(guess), guess, math.nextafter(guess, math.inf), math.nextafter(guess, -math.inf)]
    for alpha in candidates:
        if alpha is not None and alpha > 0 and scale_of(alpha, r, rslora) == scale:
            return int(alpha) if float(alpha).is_integer() else float(alpha)
    raise AdapterError(f"no lora_alpha gives PEFT's scale {scale!r} at rank {r} exactly")


class PeftAdapter(AdapterFormat):
    name = "peft"

    def can_read(self, path: Path) -> bool:
        try:
            if not (path.is_dir() and (path / CONFIG).is_file() and any((path / w).is_file() for w in WEIGHTS)):
                return False
            return "peft_type" in json.loads((path / CONFIG).read_text()) or (path / WEIGHTS[0]).is_file()
        except (OSError, ValueError):
            return False

    def read(self, path: Path, config: dict | None = None) -> Adapter:
        cfg = _config(path)
        tensors = _tensors(path)
        rslora = bool(cfg.get("use_rslora"))
        r0, alpha0 = cfg.get("r", 8), cfg.get("lora_alpha", 8)
        params = [str(p) for p in (cfg.get("target_parameters") or [])]
        found: dict[tuple[str, int], dict[str, Any]] = {}
        for key, t in tensors.items():
            m = _KEY.fullmatch(key.removeprefix(PREFIX))
            if not key.startswith(PREFIX) or m is None:
                what = "embedding LoRA" if "lora_embedding" in key else "a tensor that is no LoRA factor"
                raise AdapterError(f"{path}: {key} is {what}; ffn-tools reads LoRA factors of linear layers and "
                                   "stacked expert parameters only")
            found.setdefault((m["module"], m["nest"].count(".base_layer")), {})[m["ab"]] = t
        loras: dict[str, Lora] = {}
        for (module, depth), ab in found.items():
            if set(ab) != {"A", "B"}:
                raise AdapterError(f"{path}: {module} has lora_{next(iter(ab))} without lora_{'AB'[next(iter(ab)) == 'A']}")
            a, b = ab["A"], ab["B"]
            target = _target(module, depth, params, path, cfg.get("target_modules"))
            pattern_key = target if not target.endswith(".weight") else module
            r = int(pattern_value(cfg.get("rank_pattern"), pattern_key, r0))
            alpha = pattern_value(cfg.get("alpha_pattern"), pattern_key, alpha0)
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] % r:
                raise AdapterError(f"{path}: {module}: lora_A{list(a.shape)} and lora_B{list(b.shape)} do not "
                                   f"fit rank {r}")
            experts = a.shape[0] // r
            if target.endswith(".weight") and experts != 1:
                raise AdapterError(f"{path}: {module}: lora_A has {a.shape[0]} rows for rank {r}")
            if not target.endswith(".weight"):  # a stacked parameter: (E, r, in), (E, out, r)
                a = a.reshape(experts, r, a.shape[-1])
                b = b.reshape(b.shape[0], r, experts).permute(2, 0, 1).contiguous()
            # a target_parameters LoRA's delta is rounded to the parameter's dtype before PEFT adds it (its
            # ParamWrapper); a target_modules one is added in float32 and rounded once
            loras[target] = Lora(target, a, b, scale_of(alpha, r, rslora), alpha, rslora,
                                 delta_rounded=not target.endswith(".weight"))
        if not loras:
            raise AdapterError(f"{path}: holds no LoRA factors")
        meta = {k: cfg[k] for k in ("task_type", "base_model_name_or_path", "revision") if cfg.get(k) is not None}
        return Adapter(path, self.name, loras, config, meta)

    def write(self, adapter: Adapter, out: Path, config: dict | None = None, base: Path | None = None,
              **options) -> list[str]:
        from safetensors.torch import save_file

        tensors, modules, parameters = {}, [], []
        ranks: dict[str, int] = {}
        scales: dict[str, tuple[float, float | None, bool]] = {}
        by_module: dict[str, list[Lora]] = {}
        for target, lora in adapter.loras.items():
            if target.endswith(".weight"):
                if lora.experts is not None:
                    raise AdapterError(f"{target}: a stacked LoRA of a .weight tensor has no PEFT form")
                module = target.removesuffix(".weight")
                modules.append(module)
                tensors[f"{PREFIX}{module}.lora_A.weight"] = lora.a.contiguous()
                tensors[f"{PREFIX}{module}.lora_B.weight"] = lora.b.contiguous()
                ranks[module], scales[module] = lora.rank, (lora.scale, lora.alpha, lora.rslora)
            else:
                by_module.setdefault(target.rpartition(".")[0], []).append(lora)
                parameters.append(target)
                ranks[target], scales[target] = lora.rank, (lora.scale, lora.alpha, lora.rslora)
        for module, loras in by_module.items():
            order = sorted(loras, key=lambda x: _order(x.target))
            for i, lora in enumerate(order):
                nest = ".base_layer" * (len(order) - 1 - i)
                e, r = lora.experts or 1, lora.rank
                a = lora.a.reshape(e * r, lora.a.shape[-1]) if lora.a.ndim == 3 else lora.a
                b = lora.b.permute(1, 2, 0).reshape(lora.b.shape[-2], r * e) if lora.b.ndim == 3 else lora.b
                tensors[f"{PREFIX}{module}{nest}.lora_A.weight"] = a.contiguous()
                tensors[f"{PREFIX}{module}{nest}.lora_B.weight"] = b.contiguous()
        rslora = {s[2] for s in scales.values()}
        if len(rslora) > 1:
            raise AdapterError("some LoRAs scale by alpha/r and others by alpha/sqrt(r) (rsLoRA); PEFT has one rule")
        use_rslora = rslora.pop() if rslora else False
        r0 = max(set(ranks.values()), key=list(ranks.values()).count)
        alphas = {k: alpha_for(s, ranks[k], use_rslora, a) for k, (s, a, _) in scales.items()}
        alpha0 = max(set(alphas.values()), key=list(alphas.values()).count)
        cfg = {"peft_type": "LORA", "r": r0, "lora_alpha": alpha0, "use_rslora": use_rslora,
               "target_modules": modules, "target_parameters": parameters or None,
               "rank_pattern": {re.escape(k): v for k, v in ranks.items() if v != r0},
               "alpha_pattern": {re.escape(k): v for k, v in alphas.items() if v != alpha0},
               "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
               "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
               "task_type": adapter.meta.get("task_type", "CAUSAL_LM"),
               "base_model_name_or_path": str(base) if base is not None else adapter.meta.get("base_model_name_or_path")}
        out.mkdir()
        save_file(tensors, str(out / WEIGHTS[0]), metadata={"format": "pt"})
        (out / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        return [WEIGHTS[0], CONFIG]


def _order(target: str) -> tuple[int, str]:
    param = target.rpartition(".")[2]
    return (PARAMETER_ORDER.index(param) if param in PARAMETER_ORDER else len(PARAMETER_ORDER), param)


def _config(path: Path) -> dict:
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path / CONFIG}: cannot be read ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: a PEFT {cfg['peft_type']} adapter; ffn-tools reads LoRA adapters only")
    for key, what in REFUSED.items():
        if cfg.get(key):
            raise AdapterError(f"{path}: uses {what}, which ffn-tools does not carry yet; its delta is not B·A alone")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{path}: has modules_to_save {cfg['modules_to_save']} (whole trained tensors besides "
                           "the LoRA), which ffn-tools does not carry yet")
    return cfg


def _tensors(path: Path) -> dict:
    """The adapter's factors, through the checkpoint readers (safetensors; a pickle only with weights_only)."""
    from ffn_tools.io.readers import open_checkpoint

    weights = next(path / w for w in WEIGHTS if (path / w).is_file())
    with open_checkpoint(weights) as ckpt:
        return {n: ckpt[n] for n in ckpt}


def _target(module: str, depth: int, params: list[str], path: Path, modules: list | str | None = None) -> str:
    """The base tensor a LoRA on ``module`` nested ``depth`` wrappers deep changes: the module's weight, or for
    ``target_parameters`` the parameter registered at that depth. A module ``target_modules`` names is a linear
    layer, its LoRA on its weight, even where a bare ``target_parameters`` name (PEFT 0.22 writes ``down_proj``
    for stacked experts) ends its name as it ends every ``module.down_proj``."""
    if not depth and _named(module, modules):
        return f"{module}.weight"
    names = sorted({p.rpartition(".")[2] for p in params}, key=lambda p: _order("x." + p))
    mine = [p for p in names if any(f"{module}.{p}" == t or f"{module}.{p}".endswith("." + t) for t in params)]
    if not mine:
        if depth:
            raise AdapterError(f"{path}: {module} nests {depth} LoRA wrappers, but target_parameters names none of "
                               "its parameters")
        return f"{module}.weight"
    if depth >= len(mine):
        raise AdapterError(f"{path}: {module} nests {depth + 1} LoRA wrappers; target_parameters names {len(mine)}")
    return f"{module}.{mine[len(mine) - 1 - depth]}"


def _named(module: str, modules: list | str | None) -> bool:
    """PEFT's ``check_target_module_exists`` on ``target_modules``: a regex string matches the whole name, a list's
    entry the name or a dot-bounded suffix of it."""
    if isinstance(modules, str):
        return re.fullmatch(modules, module) is not None
    return any(module == m or module.endswith(f".{m}") for m in modules or ())


ADAPTER = PeftAdapter()
