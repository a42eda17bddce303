"""The tokens of a tokenizer transformers' GGUF reader rebuilt that the GGUF does not hold as it holds them:
a token it adds past the GGUF's last id (``invented``: left out), a padding token it makes special that the
vocabulary holds as an ordinary token (``ordinary_pad``: made ordinary again). ``repaired`` applies both to the
files ``sidefiles.tokenizer_files`` saves, each file parsed and written once (a 128K-token tokenizer.json is
megabytes of JSON); each repair returns what the conversion's summary says."""

from __future__ import annotations

import json

from ffn_tools.io import nogc

NORMAL = 1  # llama.cpp's token type of an ordinary token: tokenized as text, never matched as a special token


def repaired(files: dict[str, str | bytes], fields: dict) -> list[str]:
    """``files``' tokenizer.json and tokenizer_config.json with ``invented`` and ``ordinary_pad`` applied (``fields``:
    the GGUF's metadata), rewritten where either changed something. Returns what the summary says."""
    if "tokenizer.json" not in files:
        return []
    doc = nogc.loads(files["tokenizer.json"])
    cfg = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else None
    said = invented(doc, cfg, len(fields["tokenizer.ggml.tokens"])) + ordinary_pad(doc, cfg, fields)
    if said:
        files["tokenizer.json"] = json.dumps(doc, ensure_ascii=False, indent=2)
        if cfg is not None:
            files["tokenizer_config.json"] = json.dumps(cfg, ensure_ascii=False, indent=2) + "\n"
    return said


def invented(doc: dict, cfg: dict | None, n: int) -> list[str]:
    """Leave out of tokenizer.json (``doc``) and tokenizer_config.json (``cfg``) the tokens transformers' GGUF
    reader adds with an id at or past ``n``, the GGUF's token count (``<|endoftext|>``, GPT-2's tokenizer class's
    default), and the special-token settings naming them. Returns what the summary says."""
    gone = {t["content"]: t["id"] for t in doc.get("added_tokens", []) if t["id"] >= n}
    vocab = doc.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        gone.update({t: i for t, i in vocab.items() if isinstance(i, int) and i >= n})
    if not gone:
        return []
    doc["added_tokens"] = [t for t in doc.get("added_tokens", []) if t["id"] < n]
    if isinstance(vocab, dict):
        doc["model"]["vocab"] = {t: i for t, i in vocab.items() if t not in gone}
    if cfg is not None:
        for key in [k for k, v in cfg.items() if k.endswith("_token") and v in gone]:
            cfg[key] = None
        if isinstance(cfg.get("added_tokens_decoder"), dict):
            cfg["added_tokens_decoder"] = {i: t for i, t in cfg["added_tokens_decoder"].items() if int(i) < n}
    return [f"tokenizer.json: {', '.join(f'{t} (id {i})' for t, i in sorted(gone.items(), key=lambda x: x[1]))} left "
            f"out: transformers' GGUF reader adds it (its GPT-2 tokenizer class's default), the GGUF's {n} tokens and "
            "the model's embedding do not have it"]


def ordinary_pad(doc: dict, cfg: dict | None, fields: dict) -> list[str]:
    """Where the GGUF's padding token is an ordinary token of its BPE vocabulary (type NORMAL: llama.cpp tokenizes it
    as text; convert_hf_to_gguf.py writes config.json's pad_token_id, often 0, GPT-2's "!"), leave it out of the
    special tokens of tokenizer.json (``doc``) and tokenizer_config.json (``cfg``): transformers' reader makes it a
    special added token, which the tokenizers library matches before its BPE ("Hello!!" encoded [15496, 0, 0],
    llama.cpp and the source [15496, 3228]). config.json and generation_config.json keep the id. Returns what the
    summary says."""
    pad, types = fields.get("tokenizer.ggml.padding_token_id"), fields.get("tokenizer.ggml.token_type")
    if pad is None or types is None or not 0 <= int(pad) < len(types) or int(types[int(pad)]) != NORMAL:
        return []
    pad = int(pad)
    entry = next((t for t in doc.get("added_tokens", []) if t["id"] == pad), None)
    vocab = doc.get("model", {}).get("vocab")
    if entry is None or not isinstance(vocab, dict) or vocab.get(entry["content"]) != pad:
        return []
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["id"] != pad]
    if cfg is not None:
        if cfg.get("pad_token") == entry["content"]:
            cfg.pop("pad_token")
        if isinstance(cfg.get("added_tokens_decoder"), dict):
            cfg["added_tokens_decoder"].pop(str(pad), None)
    return [f"tokenizer: the GGUF's padding token {entry['content']!r} (id {pad}) is an ordinary token of its "
            "vocabulary, which llama.cpp tokenizes as text: not made a special token, as transformers' GGUF reader "
            "makes it (text holding it would encode otherwise); config.json keeps pad_token_id"]
