"""What llama.cpp's client compares when B is a GGUF: its metadata against A's config, its tokenizer against A's,
its weights stored plus one against A's.

llama.cpp builds the model from the GGUF's metadata (``{arch}.rope.freq_base``, ``.attention.layer_norm_rms_
epsilon``, head counts, context, experts; ``converters.gguf.config.METADATA``), not from a config.json; so
each key the converter writes is compared with A's config as transformers reads it (GGUF floats are float32:
A's value is rounded to float32 first), and the architecture with the one the converter writes for A's
model type. Values llama.cpp assumes for an architecture rather than reads (Gemma's query scale and which
layers slide: ``config.implied_values``) are compared with A's likewise. The tokenizer is
``tokenizer.ggml.*``: its tokens against A's tokenizer's vocabulary, id by id (the converter pads the vocabulary to the embedding's rows with ``[PAD…]`` tokens), and the special token
ids against A's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ffn_tools.checks.config import ConfigResult, transformers_view
from ffn_tools.checks.diagnose import first_difference
from ffn_tools.checks.outside import DIFFER, IDENTICAL, WITHIN, Derived, outside_tolerance
from ffn_tools.checks.rounded import derive, plus_ops
from ffn_tools.checks.side_files import SideFilesResult
from ffn_tools.checks.tokenizer_behaviour import transformers_tokenizer
from ffn_tools.errors import listing
from ffn_tools.tolerances import tolerance_for

from .config import IMPLIED, absent_values, implied_values, metadata_keys, metadata_values, original_context, rope_theta
from .names import BY_TYPE

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # as transformers' config classes name it
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "rms_norm_eps")  # llama.cpp needs them


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return np.float32(a) == np.float32(b)
        except (TypeError, ValueError):
            return False
    return a == b


def compare_metadata(ca, cb, allow=()) -> ConfigResult:
    """A's config (transformers' reading) against GGUF B's metadata, key by key."""
    res = ConfigResult(readers=["transformers (A)", "llama.cpp's GGUF metadata (B)"])
    a = ca.config
    if not a or "model_type" not in a:
        res.skipped = "A has no config.json naming a model_type"
        return res
    na, why = transformers_view(a)
    na = na or dict(a)
    if why:
        res.notes.append(f"A's config compared as written: {why}")
    family = cb.family
    want = BY_TYPE.get(str(a.get("model_type")))
    arch_key = "general.architecture"
    if want is not None and want.arch != family.arch:
        res.problems.append(f"{arch_key}: A is a {a['model_type']} model, which llama.cpp's converter writes as "
                            f"{want.arch!r}; B says {family.arch!r}")
    values = metadata_values(cb.fields, family)
    experts = next((na[k] for k in EXPERT_KEYS if na.get(k) is not None), None)
    a_values = {**na, "rope_theta": rope_theta(na), "sliding_rope_theta": rope_theta(na, "sliding_attention"),
                "original_max_position_embeddings": original_context(na), family.moe_key: experts,
                **IMPLIED.get(str(a.get("model_type")), {})}  # what A's client runs whatever its config says
    absent = absent_values(family.model_type)  # what llama.cpp runs where B's metadata has no key
    for key, gkey in metadata_keys(family).items():
        gkey = gkey.format(arch=family.arch)
        va, vb = a_values.get(key), values.get(key, absent.get(key))
        if key not in values and key in absent:
            gkey = f"no {gkey}: llama.cpp's default"
        if va is None and vb is None:
            continue
        res.compared += 1
        if vb is None:
            if key in REQUIRED:
                res.problems.append(f"{key}: A {va!r}, B has no {gkey}")
            continue
        if va is None or not _same(va, vb):
            line = f"{key}: A {va!r}, B {vb!r} ({gkey})"
            (res.allowed if key in allow else res.problems).append(line)
    for key, assumed in implied_values(family.arch, na).items():  # what llama.cpp assumes: no GGUF key holds it
        if na.get(key) is None:
            continue
        res.compared += 1
        if na[key] != assumed:
            (res.allowed if key in allow else res.problems).append(_assumed_line(key, na[key], assumed, family.arch))
    tied = "lm_head.weight" not in cb
    res.compared += 1
    if bool(na.get("tie_word_embeddings")) != tied:
        res.problems.append(f"tie_word_embeddings: A {na.get('tie_word_embeddings')!r}, B "
                            f"{'has no' if tied else 'has an'} output.weight")
    res.ties = (na.get("tie_word_embeddings"), tied)
    return res


def _assumed_line(key: str, a, assumed, arch: str) -> str:
    """One line: A's ``key`` is not what llama.cpp assumes for ``arch`` (per layer, for a per-layer list)."""
    why = f"(the GGUF has no key for it: llama.cpp assumes it for {arch})"
    if isinstance(a, list) and isinstance(assumed, list) and len(a) == len(assumed):
        wrong = [f"{i}: A {x}, llama.cpp {y}" for i, (x, y) in enumerate(zip(a, assumed)) if x != y]
        return f"{key}: {len(wrong)} of {len(a)} layers differ ({listing(wrong, 3)}) {why}"
    return f"{key}: A {a!r}, but llama.cpp assumes {assumed!r} {why}"


def compare_tokenizer(root_a: Path, cb) -> SideFilesResult:
    """A's tokenizer (its files, as transformers loads them) against B's ``tokenizer.ggml.*``."""
    res = SideFilesResult()
    tokens = cb.fields.get("tokenizer.ggml.tokens")
    try:
        tok = transformers_tokenizer(root_a)
    except Exception as e:  # noqa: BLE001 - no tokenizer files, or ones transformers cannot read
        if tokens:
            res.notes.append(f"A's tokenizer was not compared with B's tokenizer.ggml.tokens: transformers cannot "
                             f"load one from {root_a} ({type(e).__name__})")
        res.skipped = "A has no tokenizer transformers loads"
        return res
    if not tokens:
        res.problems.append("tokenizer: A has one, B has no tokenizer.ggml.tokens (llama.cpp cannot tokenize)")
        return res
    vocab = {i: t for t, i in tok.get_vocab().items()}
    wrong = [f"{i}: A {vocab[i]!r}, B {tokens[i]!r}" for i in sorted(vocab) if i < len(tokens) and tokens[i] != vocab[i]]
    beyond = [i for i in vocab if i >= len(tokens)]
    padding = [t for i, t in enumerate(tokens) if i not in vocab and not str(t).startswith("[PAD")]
    if wrong:
        res.problems.append(f"tokenizer: {len(wrong)} of {len(vocab)} tokens differ: {listing(wrong)}")
    if beyond:
        res.problems.append(f"tokenizer: {len(beyond)} of A's token ids are beyond B's {len(tokens)} tokens")
    if padding:
        res.problems.append(f"tokenizer: B has {len(padding)} tokens A lacks: {listing(padding)}")
    for what, key in (("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id")):
        va = getattr(tok, f"{what}_token_id", None)
        vb = cb.fields.get(key)
        if va is not None and vb is not None and int(va) != int(vb):
            res.problems.append(f"tokenizer: {what} token id A {va}, B {vb} ({key})")
    ta, tb = chat_templates(tok), gguf_chat_templates(cb.fields)
    res.problems += compare_chat_templates(ta, tb)
    if not res.problems:
        said = f", {len(ta)} chat template{'s' * (len(ta) > 1)}" if ta else ""
        res.identical.append(f"tokenizer ({len(vocab)} tokens as tokenizer.ggml.tokens, special ids{said})")
    return res


def chat_templates(tok) -> dict[str, str]:
    """A transformers tokenizer's chat templates by name (its one template is ``default``)."""
    t = getattr(tok, "chat_template", None)
    return {"default": t} if isinstance(t, str) else dict(t) if isinstance(t, dict) else {}


def gguf_chat_templates(fields: dict) -> dict[str, str]:
    """A GGUF's chat templates by name, as gguf-py's ``SpecialVocab`` writes them: ``tokenizer.chat_template``
    the default, ``tokenizer.chat_template.{name}`` each one ``tokenizer.chat_templates`` names."""
    out = {"default": fields["tokenizer.chat_template"]} if "tokenizer.chat_template" in fields else {}
    for name in fields.get("tokenizer.chat_templates") or []:
        if f"tokenizer.chat_template.{name}" in fields:
            out[str(name)] = fields[f"tokenizer.chat_template.{name}"]
    return out


def compare_chat_templates(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """One line per chat template A and B's runtime would render otherwise (missing on one side, or its text
    differs: the first differing character and its surroundings)."""
    lines = []
    for name in sorted(set(a) | set(b)):
        key = "tokenizer.chat_template" + ("" if name == "default" else f".{name}")
        ta, tb = a.get(name), b.get(name)
        if ta == tb:
            continue
        if ta is None or tb is None:
            lines.append(f"chat template {name!r}: only {'B' if ta is None else 'A'} has one ({key}): a chat "
                         f"is formatted otherwise")
            continue
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        lines.append(f"chat template {name!r} differs from character {k} ({key}): A {ta[max(0, k - 20):k + 40]!r}, "
                     f"B {tb[max(0, k - 20):k + 40]!r}")
    return lines


def compare_plus_one(outside, ca, cb, atol=None, rtol=None) -> list[str]:
    """B's weights the converter stores plus one (Gemma's norms, ``cb.shifts``), each compared once with what the
    converter's own ops make of A's (``checks.rounded.plus_ops``: the expected B tensor, A's through the ops that
    make B), never with A's as stored: stored F32 (as this converter writes them), the bits must be equal; stored
    otherwise (a GGUF some other tool quantized), within the tolerance row. A GGUF A that stores them so too is
    compared by its stored bits. The outcomes are added to ``outside`` (which left these tensors out:
    ``compare_outside``'s ``elsewhere``); returns the note saying how they were compared.
    """
    names = sorted(cb.shifts)
    if not names or outside.skipped:
        return []
    exact = 0
    for name in names:
        if name not in ca:
            outside.only_b.append(name)
            continue
        d = _plus_one(name, ca, cb, atol, rtol)
        outside.add(d)
        exact += d.outcome == IDENTICAL
    outside.only_b.sort()
    return [f"{len(names)} of B's tensors are stored plus one by llama.cpp's converter (Gemma's norms: "
            f"{listing(names, 3)}): compared with A's through the converter's ops (plus one, float32), "
            f"{exact} bit for bit"]


def _plus_one(name: str, ca, cb, atol, rtol) -> Derived:
    """B's ``name``, stored plus ``cb.shifts[name]``, against A's through the converter's ops (see
    ``compare_plus_one``)."""
    from .reader import LOSSLESS  # gguf and numpy: a GGUF B has them

    a, b = ca[name], cb.read_stored(name)
    if tuple(a.shape) != tuple(b.shape):
        return Derived(name, DIFFER, f"{name}: A is {list(a.shape)}, B is {list(b.shape)}")
    same_kind = ca.format is cb.format and name in ca.shifts  # A a GGUF storing it so too: its stored bits
    want = ca.read_stored(name) if same_kind else derive(plus_ops(a.dtype, cb.shifts[name]), a)
    lossless = cb.types[name] in LOSSLESS and b.dtype == want.dtype
    why = (first_difference(name, want, b) if lossless else
           outside_tolerance(name, want, b, tolerance_for([b.dtype], None, atol=atol, rtol=rtol)))
    if why:
        return Derived(name, DIFFER, f"{why} (B stores it plus one: compared with A's plus one, as the converter "
                                     "computes it)")
    return Derived(name, IDENTICAL if lossless else WITHIN)
