"""verify's tied head, compared once (#54 item 3): the ``lm_head.weight`` one side stores and the other does not is
decided before any comparison (``tied.TiedHead.decide``: the comparison by name leaves it out, so it is never listed
"only in B" and forgiven after), then compared once, where that side's client ties its head, with what it derives
from: B's against A's embedding (A's head as A's client ties it). A head B stores differently fails naming it; a
tied export, its head written out bit for bit or cast, passes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import plant, run_cli

from ffn_tools.checks.outside import OutsideResult
from ffn_tools.verification.expected import Expected, Sides
from ffn_tools.verification.tied import HEAD, TiedHead

EMB = "model.embed_tokens.weight"


class Info:
    def __init__(self, t):
        self.shape, self.dtype = tuple(t.shape), t.dtype


class Side(dict):
    """A checkpoint as ``tied`` reads one: tensors by name, their ``info``, no quantization."""

    resolves_quantization = True
    metadata: dict = {}

    def info(self, name):
        return Info(self[name])

    def quantized(self, name):
        return None


class Plain:  # B's client: no transform of its own
    name = "plain"

    def pairing(self, ca, cb):
        return None

    def stored_otherwise(self, cb):
        return frozenset()


def sides(head):
    emb = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ca, cb = Side({EMB: emb, "model.norm.weight": torch.ones(4)}), Side({EMB: emb.clone()})
    if head is not None:
        cb[HEAD] = head(emb).clone()
    return ca, cb


def test_the_head_on_one_side_only_is_decided_before_any_comparison():
    ca, cb = sides(lambda e: e)
    expected = Expected.derive(Plain(), ca, cb, paired=True)
    assert expected.transforms[-1] == TiedHead("B") and HEAD in expected.left_out()  # not compared by name
    assert Expected.derive(Plain(), cb, ca, paired=True).transforms[-1] == TiedHead("A")  # A's, the other way
    both = Side({**ca, HEAD: cb[HEAD]})  # both store one: compared by name
    assert Expected.derive(Plain(), both, cb, paired=True).transforms[-1] == TiedHead(None)
    assert Expected.derive(Plain(), ca, Side({EMB: cb[EMB]}), paired=True).left_out() == frozenset()  # neither
    assert TiedHead.decide((frozenset(), frozenset({HEAD})), frozenset({HEAD})) == TiedHead(None)  # another's


@pytest.mark.parametrize("tie", [True, False, None])
def test_the_head_is_compared_once_where_its_side_ties_it(tie):
    ca, cb = sides(lambda e: e)
    outside = OutsideResult()
    notes = TiedHead("B").compare(outside, Sides(ca, cb, None, None, (tie, tie)))
    if tie:  # compared with A's embedding, counted once, identical
        assert (outside.identical, outside.within, outside.differ, outside.only_b) == (1, 0, [], [])
        assert notes and f"B stores {HEAD}, bit-identical to its {EMB} as A stores it" in notes[0]
    else:  # a head of its own, on B only: listed once, never forgiven
        assert (outside.identical, outside.only_b, notes) == (0, [HEAD], [])
        assert not outside.passed


def test_a_head_that_differs_from_a_embedding_fails_naming_it():
    ca, cb = sides(lambda e: e.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(-1.0)))
    outside = OutsideResult(identical=1)
    assert TiedHead("B").compare(outside, Sides(ca, cb, None, None, (True, True))) == []
    assert outside.identical == 1 and len(outside.differ) == 1 and not outside.passed
    assert outside.differ[0].startswith(f"{HEAD}: B stores one that differs from its embedding ({EMB} as A stores")
    assert f"{HEAD}[1, 2]" in outside.differ[0]  # the first differing element, named
    ca, cb = sides(lambda e: e)
    cb[HEAD] = torch.zeros(3, 5)  # no embedding of its shape in A
    outside = OutsideResult()
    TiedHead("B").compare(outside, Sides(ca, cb, None, None, (True, True)))
    assert "A has no embedding of its shape [3, 5]" in outside.differ[0]


def test_a_cast_head_is_within_the_row_and_a_wrong_one_fails():
    ca, cb = sides(lambda e: e.half())
    outside = OutsideResult()
    notes = TiedHead("B").compare(outside, Sides(ca, cb, None, None, (True, True)))
    assert (outside.identical, outside.within, outside.differ) == (0, 1, []) and "within tolerance of" in notes[0]
    ca, cb = sides(lambda e: e.flip(0).half())  # another row order: out of the float16 row
    outside = OutsideResult()
    TiedHead("B").compare(outside, Sides(ca, cb, None, None, (True, True)))
    assert outside.differ and outside.differ[0].startswith(HEAD)


@pytest.fixture(scope="module")
def tied(model_dir):
    return model_dir("gemma2")  # tie_word_embeddings: no lm_head.weight saved


def verify(a, b):
    r = run_cli("verify", a, b, "--backend", "reference", "--tokens", "4", "--json", ok=None)
    return r.exit_code, json.loads(r.stdout)


def test_verify_a_tied_export_passes_and_a_head_stored_otherwise_fails(tied, tmp_path):
    def head(value):
        def edit(sd):
            sd[HEAD] = value(sd[EMB]).clone()
        return edit

    b = plant(tied, tmp_path / "b", edit=head(lambda e: e))  # its tied head written out: the same model
    code, rep = verify(tied, b)
    assert code == 0, rep["failures"]
    assert not rep["outside"]["only_b"]
    assert any(f"B stores {HEAD}, bit-identical to its {EMB}" in n for n in rep["notes"])
    code, rep = verify(b, tied)  # the other way: A's head against A's own embedding
    assert code == 0, rep["failures"]
    c = plant(tied, tmp_path / "c", edit=head(lambda e: e.roll(1, 0)))  # rows of the embedding shifted by one
    code, rep = verify(tied, c)
    assert code == 1
    assert [f for f in rep["failures"] if HEAD in f] == [
        next(f for f in rep["failures"] if f.startswith(f"outside FFNs: {HEAD}: B stores one that differs"))]
