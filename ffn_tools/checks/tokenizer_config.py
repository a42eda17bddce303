"""tokenizer_config.json as transformers 5 reads it: what save_pretrained rewrites without changing the
tokenizer (null tokens, renamed keys, special tokens as AddedTokens, templates in files or in the config, the
loader's defaults, one class under two names) made equal on both sides, and said where a client could tell."""

from __future__ import annotations

from pathlib import Path

from .json_diff import clip, parse, read_json

# Keys that provably change nothing a client does: from_pretrained overwrites the first three with where it
# loaded from (transformers' tokenization_utils_base); transformers_version records the writer's version.
# loader arguments, not settings: where the files were read from (transformers 5 saves a sentencepiece tokenizer's
# vocab_file as the absolute path it was loaded from; the file itself is compared as tokenizer.model)
IGNORED = {"tokenizer_config.json": ("name_or_path", "is_local", "local_files_only", "vocab_file"),
           "generation_config.json": ("transformers_version",)}
# What transformers 5 uses for a tokenizer_config.json key it does not find: VERY_LARGE_INTEGER; the backend
# the tokenizer's class picks; the byte decoder's error handling of the byte-level BPE classes (GPT-2's, Qwen's:
# "replace", their default in transformers 4 and 5; 5 decodes through tokenizers, which reads none).
LOADER_DEFAULTS = {"model_max_length": (int(1e30),), "backend": ("tokenizers", "sentencepiece"), "errors": ("replace",)}
CLASS_ALIASES = ({"PreTrainedTokenizerFast", "TokenizersBackend"},)  # one class in transformers 5
# tokenizer_config.json keys that may be set in B only: without a pad token A's tokenizer refuses to pad
# (padding=True raises), so every call A's tokenizer answers, B's answers the same; the other special tokens
# change what a client does (eos stops generation, chat templates write bos), and are compared.
ONLY_IN_B = {"pad_token": "A's tokenizer cannot pad (padding raises), so every call it answers reads the same in B"}


def content(v):
    """A special token as its string (an AddedToken's flags are in tokenizer.json's added_tokens)."""
    return [content(x) for x in v] if isinstance(v, list) else v.get("content", v) if isinstance(v, dict) else v


def tokenizer_views(ra: Path, rb: Path, va: dict, vb: dict, notes: list[str]) -> tuple[dict, dict]:
    """A's and B's tokenizer_config.json as transformers 5 reads them, with what save_pretrained rewrites
    without changing the tokenizer made equal (the module docstring lists it)."""
    fast = (ra / "tokenizer.json").is_file() and (rb / "tokenizer.json").is_file()
    ja, jb = (ra / "chat_template.jinja").is_file(), (rb / "chat_template.jinja").is_file()
    for v, r, side, jinja, other in ((va, ra, "A", ja, vb), (vb, rb, "B", jb, va)):
        for k in [k for k in v if k.endswith("_token") and v[k] is None]:  # a null token is no token
            del v[k]
        if "additional_special_tokens" in v and not v.get("extra_special_tokens"):
            v["extra_special_tokens"] = v.pop("additional_special_tokens")  # transformers 5 renames it on load
        if fast:  # tokenizer.json holds the added tokens and their flags, and is compared in full
            v.update({k: content(x) for k, x in v.items() if k.endswith("_token") or k == "extra_special_tokens"})
            added = {t.get("id"): t for t in read_json(r / "tokenizer.json").get("added_tokens", [])}
            dec = v.get("added_tokens_decoder")
            if isinstance(dec, dict) and all(str(i).isdigit() and isinstance(t, dict) and added.get(int(i)) ==
                                             {**t, "id": int(i)} for i, t in dec.items()):
                del v["added_tokens_decoder"]
        if jinja and not (ja and jb) and "chat_template" in other:  # in files on one side, the config on the other
            files = [r / "chat_template.jinja", *sorted((r / "additional_chat_templates").glob("*.jinja"))]
            named = {f.stem if f.parent != r else "default": parse(f.name, f.read_bytes(), side) for f in files}
            v["chat_template"] = named["default"] if len(named) == 1 else named
        if isinstance(v.get("chat_template"), list):  # [{name, template}]: read by name
            v["chat_template"] = {t.get("name"): t.get("template") for t in v["chat_template"] if isinstance(t, dict)}
    for k in ("add_bos_token", "add_eos_token") if fast else ():
        if k in va and k not in vb:
            notes.append(f"tokenizer_config.json: {k} is {clip(va.pop(k))} in A and not in B: transformers 5 "
                         "ignores it beside tokenizer.json (its post_processor decides), transformers 4 reads it")
    for k, why in ONLY_IN_B.items():
        if k in vb and k not in va:
            notes.append(f"tokenizer_config.json: {k} is {clip(vb.pop(k))} in B and not set in A: {why}")
    for k, defaults in LOADER_DEFAULTS.items():
        for v, w in ((va, vb), (vb, va)):
            if k not in v and w.get(k) in defaults:
                v[k] = w[k]
    cls = va.get("tokenizer_class"), vb.get("tokenizer_class")
    if cls[0] != cls[1] and set(cls) in CLASS_ALIASES:
        notes.append(f"tokenizer_config.json: tokenizer_class is {cls[0]!r} in A, {cls[1]!r} in B: one class in "
                     f"transformers 5; transformers 4 cannot load {cls[1]!r}")
        vb["tokenizer_class"] = cls[0]
    return va, vb
