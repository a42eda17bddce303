"""An MTP (NextN) head run as a draft (issue #55 item 3), in float32 with transformers' own decoder layer for the
family: on the main model's hidden states after its final norm (as vLLM's and SGLang's DeepSeek and Qwen3-Next MTP
take them), position i's draft is, in DeepSeek-V3 / GLM-4.5's form,

    x_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])  ->  the NextN block  ->  shared_head.norm  ->  shared_head.head

in Qwen3-Next's ``mtp.fc([pre_fc_norm_embedding(embed(t_{i+1})); pre_fc_norm_hidden(h_i)])`` -> ``mtp.layers.*``
(full attention) -> ``mtp.norm`` -> the main model's ``lm_head``, its norms scaling by 1 + w; in MiMo's (vLLM's
mimo_mtp) ``input_proj([hidden_layernorm(h_i); token_layernorm(embed(t_{i+1}))])``, position 0's embedding zeroed,
-> its Qwen2 block -> ``final_layernorm`` -> the main ``lm_head``. Each family's form is data (``schemes/mtp.json``'s
``draft``). The draft's greedy top-1 is the head's guess of t_{i+2}. ``acceptance`` compares two checkpoints'
heads fed the same hidden states (A's main model's): how often B's draft is A's, and how often each draft is the
main model's own greedy next token (the rate a serving engine accepts it at), beside the floor measured in the same
run (A's head cast to B's dtypes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import FFNToolsError
from ..mtp import LAYOUTS, NESTED, DraftForm, Head, find_heads, text_view

if TYPE_CHECKING:
    import torch

MAIN_LIMIT = 4 * 2**30  # bytes of A's main model in float32 the reference runs on the CPU


@dataclass(frozen=True)
class Acceptance:
    """One head's drafts on ``positions`` positions: ``agree`` the share where B's draft is A's, ``a``/``b`` the share
    where A's/B's draft is the main model's greedy next token; its floor, measured in the same run: A's head cast to
    B's dtype (``dtype``), run alike: ``floor_agree`` its share of A's drafts, ``floor_b`` of the main model's
    next tokens (None: not measured, ``unjudged`` says why)."""

    head: str
    positions: int
    agree: float
    a: float
    b: float
    floor_agree: float | None = None
    floor_b: float | None = None
    dtype: str = ""
    unjudged: str | None = None

    def slack(self, floor: float) -> float:
        """How far below ``floor`` a share may fall by chance: three binomial standard deviations over the
        positions (at least one position's worth)."""
        return 3 * math.sqrt(max(floor * (1 - floor), 1 / self.positions) / self.positions)

    def below(self) -> str | None:
        """Why B's drafts fail their floor (B accepts fewer drafts than A's head in B's dtype, past the slack),
        or None."""
        if self.floor_agree is None or self.floor_b is None:
            return None
        low = [f"{what} {got:.1%} < {floor:.1%} - {self.slack(floor):.1%}"
               for what, got, floor in (("B's drafts as A's", self.agree, self.floor_agree),
                                        ("B's drafts as the main model's next token", self.b, self.floor_b))
               if got < floor - self.slack(floor)]
        return f"below the floor (A's head in {self.dtype}): {'; '.join(low)}" if low else None

    def line(self, named: bool = True) -> str:
        """What the drafts did, as one sentence (``named``: starting with the head's name)."""
        text = (f"MTP head {self.head}: " * named + f"B's drafts are A's on {self.agree:.1%} of {self.positions} positions; they "
                f"match the main model's next token on {self.b:.1%} (A's head: {self.a:.1%})")
        if self.floor_agree is not None and self.floor_b is not None:
            return text + (f"; floor, A's head in {self.dtype}: {self.floor_agree:.1%} as A's, {self.floor_b:.1%} "
                           "as the main model's")
        return text + (f"; not judged: {self.unjudged}" if self.unjudged else "")


def _rms(x: "torch.Tensor", w: "torch.Tensor", eps: float, plus_one: bool = False) -> "torch.Tensor":
    import torch

    return (w.float() + plus_one) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _config(config: Mapping, layers: int, layer_type: str | None = None, family: str | None = None):
    import transformers

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "dtype",
                                                         "torch_dtype", "quantization_config")}
    cfg.update(num_hidden_layers=layers, num_nextn_predict_layers=0)
    if "first_k_dense_replace" in cfg and layers == 1:  # the NextN block is a MoE block: layer 0 of the draft
        cfg["first_k_dense_replace"] = 0
    if isinstance(cfg.get("layer_types"), list):  # the head's blocks as their kind of layer (Qwen3-Next's: full
        # attention), or as the first layers' where the family says none
        cfg["layer_types"] = [layer_type] * layers if layer_type else cfg["layer_types"][:layers]
    model_type = cfg.pop("model_type")
    return transformers.AutoConfig.for_model(family or model_type, **cfg)


def _loaded(config, state: Mapping[str, "torch.Tensor"], what: str):
    """A model of ``config`` with ``state`` (Hugging Face names as checkpoints store them) loaded through
    transformers' own ``from_pretrained`` (its renames: experts one by one into its stacks), in float32.

    Raises:
        FFNToolsError: a parameter the state does not provide, or a tensor the model has no place for.
    """
    import tempfile

    import transformers
    from safetensors.torch import save_file

    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # verify's own report is the output (its --json above all)
    hf_logging.set_verbosity_error()  # its load report: what does not fit is this function's error, said once
    try:
        with tempfile.TemporaryDirectory(prefix="ffn-tools-draft-") as tmp:
            config.save_pretrained(tmp)
            save_file({k: v.float().contiguous() for k, v in state.items()}, f"{tmp}/model.safetensors",
                      metadata={"format": "pt"})
            loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype="float32",
                                                                            output_loading_info=True)
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    model, info = loaded
    missing = [m for m in info.get("missing_keys", ()) if not m.endswith("embed_tokens.weight")]
    if missing or info.get("unexpected_keys"):
        raise FFNToolsError(f"{what} does not fit the family's model (missing {sorted(missing)[:3]}, unexpected "
                            f"{sorted(info.get('unexpected_keys') or ())[:3]})")
    return model.eval()


LANGUAGE_MODEL = "model.language_model."  # a multimodal checkpoint's language model (GLM-4.5V's)


def _runs_as(config: Mapping | None) -> dict:
    """``config`` as the draft reference runs its language model: a multimodal config's text settings
    (``mtp.text_view``: GLM-4.5V's ``text_config``) at the top, without the nested configs."""
    return {k: v for k, v in text_view(config).items() if k not in (*NESTED, "vision_config")}


def _main_name(name: str, composite: bool) -> str | None:
    """Tensor ``name``'s name in the family's text model: in a multimodal checkpoint (``composite``), its language
    model's (``LANGUAGE_MODEL``) as ``model.``, its ``lm_head`` as it is, the rest (a vision tower) not run (None)."""
    if not composite:
        return name
    if name.startswith(LANGUAGE_MODEL):
        return "model." + name[len(LANGUAGE_MODEL):]
    return name if name.startswith("lm_head.") else None


def _form(head: Head, config: Mapping) -> DraftForm:
    """How ``head``'s family runs it as a draft (``schemes/mtp.json``'s ``draft``), for a checkpoint of one of its
    layout's model types (``config``'s): another family laying its head out alike (HY-V4's ``model.mtp_layers``,
    EXAONE-MoE's ``mtp.``) may run it otherwise.

    Raises:
        FFNToolsError: a family whose form this reference does not run.
    """
    form, model_type = head.layout.draft, config.get("model_type")
    if form is None or model_type not in head.layout.model_types:
        runs = "; ".join(f"{lay.name} of {', '.join(lay.model_types)}" for lay in LAYOUTS if lay.draft)
        raise FFNToolsError(f"MTP head {head.name}: the draft reference runs the forms of {runs}, not the "
                            f"{head.layout.name} head of a {model_type} model")
    return form


def _base(head: Head, form: DraftForm) -> str:
    """Where the head's own modules are named from: its first block (``in_block``: MiMo's) or the head."""
    return (head.layout.blocks.format(layer=head.blocks[0]) if form.in_block and head.blocks else head.name) + "."


def draft_model(config: Mapping, tensors: Mapping[str, "torch.Tensor"], head: Head,
                main_head: "torch.Tensor | None" = None):
    """The head's blocks as a model of the family (transformers' classes): its layers the head's blocks, its final
    norm the head's, its output head the head's own or the main model's (``main_head``); run on
    ``inputs_embeds``."""
    form = _form(head, config)
    own = tuple(f"{m}." for m in (form.embed_norm, form.hidden_norm, form.proj, form.norm, form.head, form.embed) if m)
    base = _base(head, form)
    state = {}
    for i, b in enumerate(head.blocks):
        block = head.layout.blocks.format(layer=b) + "."
        for n in head.tensors:  # a NextN (MiMo) block holds the head's own modules too: not the block's
            if n.startswith(block) and not (block == base and n[len(block):].startswith(own)):
                state[f"model.layers.{i}.{n[len(block):]}"] = tensors[n]
    state["model.norm.weight"] = tensors[f"{base}{form.norm}.weight"]
    out = tensors[f"{base}{form.head}.weight"] if form.head else main_head
    if out is None:
        raise FFNToolsError(f"MTP head {head.name} drafts through the main model's output head, which was not given")
    state["lm_head.weight"] = out
    return _loaded(_config(config, len(head.blocks), form.layer_type, form.family), state,
                   f"MTP head {head.name}'s block")


def drafts(config: Mapping, tensors: Mapping[str, "torch.Tensor"], head: Head, hidden: "torch.Tensor",
           tokens: "torch.Tensor", embed: "torch.Tensor", main_head: "torch.Tensor | None" = None) -> "torch.Tensor":
    """The head's greedy drafts for positions 0..T-2 of each sequence (B, T-1): the guess of t_{i+2} (``embed``,
    ``main_head``: the main model's embedding and output head, where the head has none of its own)."""
    import torch

    form = _form(head, config)
    p, eps = _base(head, form), float(config.get("rms_norm_eps", 1e-6))
    own = f"{p}{form.embed}.weight" if form.embed else ""
    table = tensors[own].float() if own in head.tensors else embed
    rows = table[tokens[:, 1:]]
    if form.mask_first:
        rows[:, 0] = 0
    e = _rms(rows, tensors[f"{p}{form.embed_norm}.weight"], eps, form.plus_one)
    h = _rms(hidden[:, :-1].float(), tensors[f"{p}{form.hidden_norm}.weight"], eps, form.plus_one)
    x = torch.cat([h, e] if form.hidden_first else [e, h], dim=-1) @ tensors[f"{p}{form.proj}.weight"].float().T
    with torch.no_grad():
        return draft_model(config, tensors, head, main_head)(inputs_embeds=x).logits.argmax(-1)


def quantized_head(b, names) -> str | None:
    """Why B's head has no floor here: its tensors ``names`` quantized (the floor would be A's head quantized the
    same way, which this reference does not derive), or None."""
    from ..errors import listing
    from .quant import quantization, tensor_bits

    default = None if b.resolves_quantization else (quantization(b) or {}).get("bits")
    q = [n for n in names if tensor_bits(b, n, default) is not None]
    return (f"B's head is quantized ({listing(q, 2)}): its floor would be A's head quantized the same way, which the "
            "draft reference does not derive") if q else None


def as_named(a, b, head: Head) -> dict[str, "torch.Tensor"]:
    """B's tensors of ``head`` under A's names: as stored where B holds that name, else (an FFN B holds in another
    form: fuse-gateup's gate_up_proj) B's same FFN's weights where A stores that FFN separate, as A stores them.

    Raises:
        FFNToolsError: a tensor of the head B holds neither by name nor as its FFN.
    """
    out = {t: b[t] for t in head.tensors if t in b}
    if len(out) == len(head.tensors):
        return out
    from ..detect import find_ffns
    from ..ffn import canonical_weights

    missing = set(head.tensors) - set(out)
    theirs = find_ffns(b).by_ref()
    for f in find_ffns(a).ffns:
        roles = {r: n for r, n in f.names.items() if n in missing}
        g = theirs.get(f.ref)
        if roles and g is not None and f.form_name == "separate" and not any(f.form.turns(r) for r in roles):
            weights = canonical_weights(b, g)
            out.update({n: weights[r] for r, n in roles.items() if r in weights})
    if still := sorted(missing - set(out)):
        raise FFNToolsError(f"MTP head {head.name}: B lacks {len(still)} of its tensors ({still[0]}, ...)")
    return out


def acceptance(a, b, tokens: "torch.Tensor", floor: bool = True) -> list[Acceptance]:
    """Each NextN head of checkpoint ``a`` (a lazy ``Checkpoint``, Hugging Face names) and ``b``'s same head, run
    as drafts on A's main model's hidden states for ``tokens`` (B, T) (see the module docstring); with ``floor``,
    A's head cast to B's dtypes (each tensor to its B counterpart's) run alike, the floor B's drafts are held to
    (``Acceptance.below``).

    Raises:
        FFNToolsError: a head of A that B lacks, a head whose family's form this reference does not run, or a
            main model past ``MAIN_LIMIT`` in float32 (the reference runs it on this machine's CPU).
    """
    import torch

    from ..io.dtypes import short_name

    config = _runs_as(a.config)
    heads = find_heads(a, config)
    if not heads:
        return []
    held = {}
    for head in heads:
        _form(head, config)
        held[head.name] = as_named(a, b, head)
    inside = {t for h in heads for t in h.tensors}
    composite = any(n.startswith(LANGUAGE_MODEL) for n in a)
    size = 4 * sum(math.prod(a.info(n).shape) for n in a if n not in inside and _main_name(n, composite))
    if size > MAIN_LIMIT:
        raise FFNToolsError(f"A's main model is {size / 2**30:.1f} GiB in float32, past the draft reference's "
                            f"{MAIN_LIMIT / 2**30:.0f} GiB (it runs the main model on this machine's CPU)")
    main = _loaded(_config(config, config["num_hidden_layers"], family=_form(heads[0], config).family),
                   {k: a[n] for n in a if n not in inside and (k := _main_name(n, composite)) is not None},
                   "A's main model")
    with torch.no_grad():
        hidden = main.model(tokens).last_hidden_state
        nxt = main.lm_head(hidden).argmax(-1)[:, 1:]  # the main model's greedy t_{i+2}, at position i+1
    embed, out_head = main.model.embed_tokens.weight.float(), main.lm_head.weight.float()
    out = []
    for head in heads:
        ta, tb = {t: a[t] for t in head.tensors}, held[head.name]
        def run(t: Mapping[str, "torch.Tensor"], head: Head = head) -> "torch.Tensor":
            return drafts(config, t, head, hidden, tokens, embed, out_head)

        da, db = run(ta), run(tb)
        share = {"agree": (da == db).float().mean().item(), "a": (da == nxt).float().mean().item(),
                 "b": (db == nxt).float().mean().item()}
        why = quantized_head(b, head.tensors) if floor else "no floor asked"
        if why is None:
            tf = {t: ta[t].to(tb[t].dtype) for t in head.tensors}
            df = da if all(tf[t].dtype == ta[t].dtype for t in tf) else run(tf)
            dtypes = ", ".join(sorted({short_name(tb[t].dtype) for t in head.tensors}))
            out.append(Acceptance(head.name, da.numel(), **share, floor_agree=(df == da).float().mean().item(),
                                  floor_b=(df == nxt).float().mean().item(), dtype=dtypes))
        else:
            out.append(Acceptance(head.name, da.numel(), **share, unjudged=why))
    return out
