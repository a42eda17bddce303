"""The side files a client reads (tokenizer, chat template, generation defaults) are compared as it reads them.

A is a real tokenizer (helpers.write_tokenizer) and a generation_config.json from transformers'
GenerationConfig; each defect is planted in a copy and must fail naming the file and the key or token; a
no-op re-save by transformers (what mlx_lm.convert does) must pass.
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import write_tokenizer

from ffn_tools.checks.side_files import SIDE_FILES, compare_side_files

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


@pytest.fixture
def a(tmp_path):
    from transformers import GenerationConfig

    root = tmp_path / "a"
    write_tokenizer(root)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=True, temperature=0.7,
                     top_p=0.9).save_pretrained(root)
    return root


def copy(a, tmp_path, name="b"):
    return shutil.copytree(a, tmp_path / name)


def edit(path, change):
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=2))


def resave(src, dst):
    """transformers' no-op re-save: the tokenizer as loaded, the generation config as read."""
    from transformers import AutoTokenizer, GenerationConfig

    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    if (src / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(src).save_pretrained(dst)
    return dst


def test_identical_directories_pass(a, tmp_path):
    res = compare_side_files(a, copy(a, tmp_path))
    assert res.passed and not res.notes
    assert res.identical == ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert res.line() == ("side files: 3 identical (tokenizer.json, tokenizer_config.json, generation_config.json), "
                          "0 differ, 0 missing in B")
    assert res.as_dict()["passed"] and res.failures() == []


def test_reformatted_json_passes(a, tmp_path):
    b = copy(a, tmp_path)
    for name in ("tokenizer.json", "generation_config.json"):
        doc = json.loads((b / name).read_text())
        (b / name).write_text(json.dumps(dict(reversed(list(doc.items()))), indent=7))
    res = compare_side_files(a, b)
    assert res.passed, res.problems
    assert "tokenizer.json" in res.identical and "generation_config.json" in res.identical


def test_resaved_tokenizer_passes(a, tmp_path):
    b = resave(a, tmp_path / "b")
    assert (b / "tokenizer_config.json").read_bytes() != (a / "tokenizer_config.json").read_bytes()  # is_local ...
    res = compare_side_files(a, b)
    assert res.passed, res.problems
    assert res.identical == ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def test_resave_of_a_v4_style_tokenizer_config_passes_with_notes(a, tmp_path):
    """A hub tokenizer written by transformers 4 (AddedToken dicts, added_tokens_decoder, special_tokens_map.json,
    add_bos_token, the template in the config) re-saved by transformers 5, which rewrites all of it."""
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    (a / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(i): {"content": t, **flags, "special": True}
                                 for i, t in enumerate(("<pad>", "<s>", "</s>", "<unk>"))},
        "add_bos_token": True, "additional_special_tokens": ["<s>"], "chat_template": TEMPLATE,
        "bos_token": {"__type": "AddedToken", "content": "<s>", **flags}, "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "name_or_path": "/somewhere",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (a / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = json.loads((a / "tokenizer.json").read_text())
    tok["added_tokens"] = [{"id": i, "content": t, **flags, "special": True}
                           for i, t in enumerate(("<pad>", "<s>", "</s>", "<unk>"))]
    (a / "tokenizer.json").write_text(json.dumps(tok))
    b = resave(a, tmp_path / "b")
    assert not (b / "special_tokens_map.json").exists() and (b / "chat_template.jinja").read_text() == TEMPLATE
    res = compare_side_files(a, b)
    assert res.passed, res.problems
    assert "tokenizer_config.json" in res.identical
    assert "special_tokens_map.json is in A and missing in B; its tokens are in B's tokenizer_config.json" in res.notes
    assert "B has chat_template.jinja, A has none" in res.notes
    assert any("add_bos_token is true in A and not in B" in n for n in res.notes)
    assert any("tokenizer_class is 'PreTrainedTokenizerFast' in A, 'TokenizersBackend' in B" in n for n in res.notes)
    (b / "chat_template.jinja").write_text(TEMPLATE.replace("</s>", ""))  # the moved template is compared
    res = compare_side_files(a, b)
    assert res.problems == ["tokenizer_config.json: chat_template differs from character 61: '</s>{% endfor %}' "
                            "in A, '{% endfor %}' in B"]


def bpe(root, old: bool, merges=(("a", "b"), ("ab", "c"))):
    """A tiny byte-level BPE tokenizer.json, as tokenizers writes it today or (old) as older versions did."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "c": 3, "abc": 4}, list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    doc = json.loads(tok.to_str())
    if old:  # merges as "a b" strings, no ignore_merges / use_regex
        doc["model"]["merges"] = [" ".join(m) for m in doc["model"].pop("merges")]
        del doc["model"]["ignore_merges"], doc["pre_tokenizer"]["use_regex"]
    root.mkdir()
    (root / "tokenizer.json").write_text(json.dumps(doc))
    return root


MERGES_SWAPPED = ("tokenizer.json: model.merges: the same 2 merges in another order (1 moved against the rest; first "
                  "at rank 0: 'a b' in A, 'ab c' in B): BPE applies merges by rank, so text tokenizes differently")


def test_an_older_tokenizers_format_reads_the_same(tmp_path):
    a = bpe(tmp_path / "a", old=True)
    res = compare_side_files(a, bpe(tmp_path / "b", old=False))
    assert res.passed and res.identical == ["tokenizer.json"]
    res = compare_side_files(a, bpe(tmp_path / "c", old=False, merges=(("ab", "c"), ("a", "b"))))
    assert res.problems == [MERGES_SWAPPED]


def test_vocab_and_merges_dropped_beside_the_same_tokenizer_json_pass(tmp_path):
    """Qwen-style A (tokenizer.json, vocab.json, merges.txt); transformers 5 re-saves tokenizer.json alone."""
    a = bpe(tmp_path / "a", old=False)
    model = json.loads((a / "tokenizer.json").read_text())["model"]
    (a / "vocab.json").write_text(json.dumps(model["vocab"]))
    (a / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{x} {y}\n" for x, y in model["merges"]))
    res = compare_side_files(a, bpe(tmp_path / "b", old=False))
    assert res.passed and res.notes == [
        "vocab.json is in A and missing in B; B's tokenizer.json holds the same vocabulary",
        "merges.txt is in A and missing in B; B's tokenizer.json holds the same merges"]
    res = compare_side_files(a, bpe(tmp_path / "c", old=False, merges=(("ab", "c"), ("a", "b"))))
    assert res.problems == [MERGES_SWAPPED,
                            "merges.txt is in A and missing in B"]


def test_named_chat_templates_are_compared(a, tmp_path):
    (a / "chat_template.jinja").write_text(TEMPLATE)
    (a / "additional_chat_templates").mkdir()
    (a / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    b = copy(a, tmp_path)
    assert compare_side_files(a, b).identical[-2:] == ["additional_chat_templates/tool_use.jinja",
                                                      "generation_config.json"]
    (b / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}\n{{ x }}")
    assert compare_side_files(a, b).problems == ["additional_chat_templates/tool_use.jinja: A has 1 lines, B 2"]
    shutil.rmtree(b / "additional_chat_templates")
    assert compare_side_files(a, b).problems == ["additional_chat_templates/tool_use.jinja is in A and missing in B"]


def test_chat_template_moved_into_the_config_passes(a, tmp_path):
    (a / "chat_template.jinja").write_text(TEMPLATE)
    b = copy(a, tmp_path)
    (b / "chat_template.jinja").unlink()
    edit(b / "tokenizer_config.json", lambda d: d.update(chat_template=TEMPLATE))
    res = compare_side_files(a, b)
    assert res.passed, res.problems
    assert res.notes == ["chat_template.jinja is in A and missing in B; B's tokenizer_config.json holds the chat "
                         "template (compared there)"]


def swap_w7_w9(d):
    vocab = d["model"]["vocab"]
    vocab["w7"], vocab["w9"] = vocab["w9"], vocab["w7"]


def del_key(key):
    return lambda d: d.pop(key)


# file edited in B, edit, the problem (without "side files: ")
DEFECTS = {
    "ids exchanged": ("tokenizer.json", swap_w7_w9, "tokenizer.json: model.vocab['w7'] is 7 in A, 9 in B"),
    "token dropped": ("tokenizer.json", lambda d: d["model"]["vocab"].pop("w95"),
                      "tokenizer.json: model.vocab['w95'] is 95 in A and missing in B"),
    "unk changed": ("tokenizer.json", lambda d: d["model"].update(unk_token="<pad>"),
                    "tokenizer.json: model.unk_token is '<unk>' in A, '<pad>' in B"),
    "eos changed": ("tokenizer_config.json", lambda d: d.update(eos_token="<unk>"),
                    "tokenizer_config.json: eos_token is '</s>' in A, '<unk>' in B"),
    "template added": ("tokenizer_config.json", lambda d: d.update(chat_template="{{ x }}"),
                       "tokenizer_config.json: chat_template is only in B ('{{ x }}')"),
    "eos id changed": ("generation_config.json", lambda d: d.update(eos_token_id=5),
                       "generation_config.json: eos_token_id is 2 in A, 5 in B"),
    "eos id dropped": ("generation_config.json", del_key("eos_token_id"),
                       "generation_config.json: eos_token_id is 2 in A and missing in B"),
    "sampling off": ("generation_config.json", lambda d: d.update(do_sample=False),
                     "generation_config.json: do_sample is true in A, false in B"),
    "temperature": ("generation_config.json", lambda d: d.update(temperature=1.0),
                    "generation_config.json: temperature is 0.7 in A, 1.0 in B"),
}


@pytest.mark.parametrize("case", sorted(DEFECTS))
def test_defects_fail_naming_file_and_key(a, tmp_path, case):
    name, change, problem = DEFECTS[case]
    b = copy(a, tmp_path)
    edit(b / name, change)
    res = compare_side_files(a, b)
    assert not res.passed and res.problems == [problem]
    assert res.failures() == [f"side files: {problem}"]
    assert "1 differs, 0 missing in B" in res.line() and name not in res.line().split("identical")[1]


def test_chat_template_changed_in_tokenizer_config_fails(a, tmp_path):
    edit(a / "tokenizer_config.json", lambda d: d.update(chat_template=TEMPLATE))
    b = copy(a, tmp_path)
    edit(b / "tokenizer_config.json", lambda d: d.update(chat_template=TEMPLATE.replace("role", "name")))
    assert compare_side_files(a, b).problems == [
        "tokenizer_config.json: chat_template differs from character 32: \"role'] }}: {{ m['content'] }}</s>{% "
        "endfor %}\" in A, \"name'] }}: {{ m['content'] }}</s>{% endfor %}\" in B"]


def test_added_token_changed_names_its_id(a, tmp_path):
    b = copy(a, tmp_path)
    edit(b / "tokenizer.json", lambda d: d["added_tokens"][2].update(content="<eos>"))
    assert compare_side_files(a, b).problems == ["tokenizer.json: added_tokens[id=2].content is '</s>' in A, "
                                                 "'<eos>' in B"]


def test_without_tokenizers_tokenizer_json_is_compared_as_written(a, tmp_path, monkeypatch):
    """Without the tokenizers library (its import fails), tokenizer.json is compared as written: a changed added
    token still fails, named as with it (the text comparison of both files as tokenizers writes them needs it)."""
    import sys

    b = copy(a, tmp_path)
    edit(b / "tokenizer.json", lambda d: d["added_tokens"][2].update(content="<eos>"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    assert compare_side_files(a, b).problems == ["tokenizer.json: added_tokens[id=2].content is '</s>' in A, "
                                                 "'<eos>' in B"]


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_missing_in_b_fails_naming_the_file(a, tmp_path, name):
    b = copy(a, tmp_path)
    (b / name).unlink()
    res = compare_side_files(a, b)
    assert res.problems == [f"{name} is in A and missing in B"]
    assert res.line().endswith("0 differ, 1 missing in B")


def test_special_tokens_map_changed_or_dropped_fails(a, tmp_path):
    (a / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    b = copy(a, tmp_path)
    edit(b / "special_tokens_map.json", lambda d: d.update(eos_token="<unk>"))
    assert compare_side_files(a, b).problems == ["special_tokens_map.json: eos_token is '</s>' in A, '<unk>' in B"]
    (b / "special_tokens_map.json").unlink()
    edit(b / "tokenizer_config.json", lambda d: d.update(eos_token="<unk>"))  # not carried by B's config
    assert "special_tokens_map.json is in A and missing in B" in compare_side_files(a, b).problems


def test_text_and_binary_files_name_the_line_and_the_byte(a, tmp_path):
    (a / "merges.txt").write_text("#version: 0.2\nw 4\nw 5\n")
    (a / "tokenizer.model").write_bytes(bytes(range(16)))
    b = copy(a, tmp_path)
    (b / "merges.txt").write_text("#version: 0.2\nw 5\nw 4\n")
    (b / "tokenizer.model").write_bytes(bytes(range(9)) + b"\xff" + bytes(range(10, 16)))
    assert compare_side_files(a, b).problems == ["tokenizer.model: bytes differ from offset 9 (A 16 bytes, B 16 bytes)",
                                                 "merges.txt: line 2 is 'w 4' in A, 'w 5' in B"]


def test_a_file_only_in_b_is_a_note(a, tmp_path):
    b = copy(a, tmp_path)
    (b / "chat_template.jinja").write_text(TEMPLATE)
    res = compare_side_files(a, b)
    assert res.passed and res.notes == ["B has chat_template.jinja, A has none"]
    assert res.line().endswith("0 missing in B, 1 note")


def test_ignored_keys_pass(a, tmp_path):
    b = copy(a, tmp_path)
    edit(b / "generation_config.json", lambda d: d.update(transformers_version="4.40.0"))
    edit(b / "tokenizer_config.json", lambda d: d.update(name_or_path="/elsewhere", is_local=False))
    assert compare_side_files(a, b).passed


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json", "tokenizer.json"])
def test_invalid_json_in_b_is_a_problem(a, tmp_path, name):
    b = copy(a, tmp_path)
    (b / name).write_text('{"eos_token": ')
    (problem,) = compare_side_files(a, b).problems
    assert problem.startswith(f"{name} in B is not valid JSON (Expecting value: line 1")


def test_a_tokenizer_json_tokenizers_cannot_load_is_a_problem(a, tmp_path):
    b = copy(a, tmp_path)
    edit(b / "tokenizer.json", lambda d: d["model"].update(type="NoSuchModel"))
    (problem,) = compare_side_files(a, b).problems
    assert problem.startswith("tokenizer.json in B cannot be loaded by tokenizers (")


def test_skipped_without_a_directory(a, tmp_path):
    res = compare_side_files(None, a)
    assert res.skipped == "A is a single weight file: no side files beside it" and res.passed
    assert res.line() == "side files: not compared (A is a single weight file: no side files beside it)"
    assert res.as_dict()["passed"] is None  # a check that did not run is never a pass in the JSON
    (tmp_path / "w.safetensors").write_bytes(b"")
    res = compare_side_files(a, tmp_path / "w.safetensors")
    assert res.skipped == f"B {tmp_path / 'w.safetensors'} is not a directory: no side files beside it"


def test_the_table_has_each_file_once():
    assert len(set(SIDE_FILES)) == len(SIDE_FILES) and "tokenizer.json" in SIDE_FILES


def test_a_pad_token_only_in_b_is_a_note_an_eos_token_is_not(tmp_path):
    """A GGUF names a padding token its source's tokenizer lacked: A cannot pad, so B's pad token changes no
    call A answers (a note); an eos token only in B changes where generation stops (a problem)."""
    a, b = bpe(tmp_path / "a", old=False), bpe(tmp_path / "b", old=False)
    (a / "tokenizer_config.json").write_text(json.dumps({"pad_token": None, "unk_token": "c"}))
    (b / "tokenizer_config.json").write_text(json.dumps({"pad_token": "c", "unk_token": "c"}))
    res = compare_side_files(a, b)
    assert res.passed and res.notes == ["tokenizer_config.json: pad_token is 'c' in B and not set in A: A's "
                                        "tokenizer cannot pad (padding raises), so every call it answers reads the "
                                        "same in B"]
    (b / "tokenizer_config.json").write_text(json.dumps({"eos_token": "c", "unk_token": "c"}))
    assert compare_side_files(a, b).problems == ["tokenizer_config.json: eos_token is only in B ('c')"]


def test_the_collector_pause_is_counted_across_threads_and_ends_with_the_last():
    """``nogc.paused`` (large tokenizer.json files parsed, tokenizers built): verify's model checks run on a thread
    beside the FFN comparison, so pauses overlap; the collector runs again when the last ends, and one switched off
    by someone else stays off."""
    import gc
    import threading

    from ffn_tools.io import nogc

    assert gc.isenabled()
    entered, release, seen = threading.Event(), threading.Event(), []

    def other():
        with nogc.paused():
            entered.set()
            release.wait(30)
            seen.append(("other", gc.isenabled()))

    t = threading.Thread(target=other)
    with nogc.paused():
        t.start()
        assert entered.wait(30)
        seen.append(("here", gc.isenabled()))
    seen.append(("between", gc.isenabled()))  # the other thread's pause holds still
    release.set()
    t.join()
    assert seen == [("here", False), ("between", False), ("other", False)] and gc.isenabled()
    assert nogc.loads('{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]} and gc.isenabled()
    gc.disable()
    try:
        with nogc.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_tokenizer_is_built_once_until_its_files_change(a):
    """transformers' tokenizer of a directory is built once while its files stay as they are (a GGUF verify asks
    for A's three times), and again, from the new files, when one changes."""
    from ffn_tools.checks.tokenizer_behaviour import transformers_tokenizer

    first = transformers_tokenizer(a)
    assert transformers_tokenizer(a) is first
    edit(a / "tokenizer_config.json", lambda d: d.update(model_max_length=77))
    again = transformers_tokenizer(a)
    assert again is not first and again.model_max_length == 77 and first.model_max_length != 77
