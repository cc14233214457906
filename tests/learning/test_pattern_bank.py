"""The pattern store and its index: exact search against numpy's brute force, the graph libraries (faiss,
hnswlib) against exact search, scopes (session, global), bounds, deletion, rollback, and the event file
replayed after a restart or a crash mid-line."""
from __future__ import annotations

import json
import random

import pytest

from py_engine.learning.bank import BankConfig, Pattern, PatternBank, VectorIndex


def vectors(n: int, dim: int, seed: int = 0) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.gauss(0, 1) for _ in range(dim)] for _ in range(n)]


def brute_force(stored: dict[int, list[float]], query: list[float], k: int) -> list[int]:
    np = pytest.importorskip("numpy")
    keys = list(stored)
    m = np.asarray([stored[key] for key in keys])
    m = m / np.linalg.norm(m, axis=1, keepdims=True)
    sims = m @ (np.asarray(query) / np.linalg.norm(query))
    return [keys[i] for i in np.argsort(-sims)[:k]]


def test_exact_search_is_numpys_brute_force_with_and_without_numpy(monkeypatch):
    data = vectors(300, 24)
    index = VectorIndex(24, backend="exact")
    for key, v in enumerate(data):
        index.add(key, v)
    for key in range(0, 300, 7):
        index.remove(key)
    stored = {k: v for k, v in enumerate(data) if k % 7}
    for q in vectors(20, 24, seed=1):
        want = brute_force(stored, q, 5)
        assert [k for k, _ in index.search(q, 5)] == want
        index._np = None  # the page's path: plain Python
        assert [k for k, _ in index.search(q, 5)] == want
        index._np = pytest.importorskip("numpy")


def test_the_graph_index_finds_what_exact_search_finds():
    library = "faiss"
    pytest.importorskip(library, reason="pip install faiss-cpu")
    data = vectors(2000, 32, seed=2)
    index = VectorIndex(32, exact_below=500, backend=library)
    for key, v in enumerate(data):
        index.add(key, v)
    assert index.kind == library
    for key in range(0, 2000, 3):  # a third removed: tombstones, then a rebuild
        index.remove(key)
    assert index.kind == library and len(index) == 1333
    stored = {k: v for k, v in enumerate(data) if k % 3}
    recall = sum(len(set(k for k, _ in index.search(q, 10)) & set(brute_force(stored, q, 10)))
                 for q in vectors(50, 32, seed=3)) / 500
    assert recall >= 0.95
    for q in vectors(10, 32, seed=4):
        assert all(k % 3 for k, _ in index.search(q, 10))  # never a removed key
    for key in list(stored)[:900]:
        index.remove(key)
    assert index.kind == "exact" and len(index) == 433  # below the threshold: exact again


def test_bad_vectors_are_refused():
    index = VectorIndex(4)
    with pytest.raises(ValueError, match="4 numbers"):
        index.add(0, [1.0, 2.0])
    with pytest.raises(ValueError, match="non-zero"):
        index.add(0, [0.0] * 4)
    with pytest.raises(ValueError, match="finite"):
        index.add(0, [float("nan"), 1.0, 0.0, 0.0])


def pattern(i: int, session: str, v: list[float]) -> Pattern:
    return Pattern(id=f"fb-{i}", session=session, question=f"q{i}", answer=f"a{i}", embedding=tuple(v),
                   prompt_ids=(1, 2, i), target_ids=(i,), lora=f"fb-{i}.safetensors")


def test_scopes_promotion_rollback_and_removal(tmp_path):
    dropped = []
    bank = PatternBank(BankConfig(), tmp_path, on_drop=dropped.append)
    e = [[1.0 if j == i else 0.0 for j in range(8)] for i in range(8)]
    bank.add(pattern(0, "alice", e[0]))
    bank.add(pattern(1, "bob", e[1]))
    assert [m.pattern.id for m in bank.search("alice", e[0], k=4)] == ["fb-0"]
    assert bank.search("bob", e[0], k=4, threshold=0.5) == []  # alice's pattern is hers
    assert bank.search("carol", e[1], k=4) == []
    assert bank.promote(["fb-0", "fb-1", "fb-9"], version=1) == 2
    assert {m.pattern.id for m in bank.search("carol", e[0], k=4)} == {"fb-0", "fb-1"}
    bank.add(pattern(2, "bob", e[2]))
    assert bank.promote(["fb-2"], version=2) == 1
    assert bank.rollback(1) == 1  # what version 2 promoted is bob's again
    assert [m.pattern.id for m in bank.search("carol", e[2], k=1)] == ["fb-1"] or \
        bank.search("carol", e[2], k=1)[0].similarity < 0.5
    assert [m.pattern.id for m in bank.search("bob", e[2], k=1)] == ["fb-2"]
    assert bank.remove("fb-1").id == "fb-1" and bank.remove("fb-1") is None
    assert [p.id for p in dropped] == ["fb-1"]
    again = PatternBank(BankConfig(), tmp_path)  # a restart replays the events
    assert sorted(again.patterns) == ["fb-0", "fb-2"]
    assert again.get("fb-0").global_since == 1 and again.get("fb-2").global_since is None
    assert [m.pattern.id for m in again.search("carol", e[0], k=4, threshold=0.5)] == ["fb-0"]
    assert again.search("carol", e[2], k=4, threshold=0.5) == []


def test_bounds_drop_the_oldest_and_the_file_stays_small(tmp_path):
    dropped = []
    bank = PatternBank(BankConfig(max_patterns=10, max_per_session=3), tmp_path, on_drop=dropped.append)
    data = vectors(40, 8, seed=5)
    for i in range(40):
        bank.add(pattern(i, f"s{i % 2}", data[i]))
    assert [p.id for p in bank.scope("s0")] == ["fb-34", "fb-36", "fb-38"]
    assert len(bank) == 6 and len(dropped) == 34
    lines = (tmp_path / "bank.jsonl").read_text().splitlines()
    assert len(lines) <= 2 * len(bank) + 64 + 1
    with open(tmp_path / "bank.jsonl", "a") as f:  # a crash mid-line
        f.write('{"op": "add", "pattern": {"id": "fb-x"')
    again = PatternBank(BankConfig(max_patterns=10, max_per_session=3), tmp_path)
    assert sorted(again.patterns) == sorted(bank.patterns)
    assert all(json.loads(line) for line in (tmp_path / "bank.jsonl").read_text().splitlines())


def test_a_pattern_needs_a_consistent_embedding(tmp_path):
    bank = PatternBank(BankConfig(), tmp_path)
    bank.add(pattern(0, "a", [1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="3 numbers expected"):
        bank.add(pattern(1, "a", [1.0, 0.0]))
    with pytest.raises(ValueError, match="max_patterns"):
        BankConfig(max_patterns=0)
