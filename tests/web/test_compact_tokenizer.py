"""The tokenizer.json form the page hands its Python (npm/src/model.js compactTokenizer): a BPE vocabulary
whose ids are 0 .. n - 1 as a list of tokens in id order, merges as "a b" strings where no token holds a
space. Pyodide's heap never shrinks, and parsing the usual form (a 49k-key object, 49k two-string lists) was
its high-water mark. py_engine's tokenizer over the compact file must give Hugging Face `tokenizers`' ids
and text over the original file, for real tokenizers of both merge layouts, with and without byte fallback.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.paths import REPO, shared_fixture
from tests.requires import tool
from tests.tokenizer.tokenizer_corpus import CORPUS, SPECIAL_STRINGS

tokenizers = pytest.importorskip("tokenizers")

NAMES = ["llama-3.2", "qwen2.5", "gpt2", "tinyllama-1.1b-chat-v1.0", "phi-2"]
DRIVER = REPO / "tests" / "web" / "js" / "compact_tokenizer.mjs"


@pytest.fixture(scope="module")
def compacted(tmp_path_factory):
    files = [shared_fixture("tokenizers", name, "tokenizer.json") for name in NAMES]
    out = tmp_path_factory.mktemp("compact")
    done = subprocess.run([tool("node"), str(DRIVER), str(REPO / "npm" / "src"), str(out), *map(str, files)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return {name: (src, out / f"{i}-tokenizer.json.compact.json") for i, (name, src) in enumerate(zip(NAMES, files))}


@pytest.mark.parametrize("name", NAMES)
def test_compact_tokenizer_equals_tokenizers(compacted, name):
    from py_engine.tokenizer import Tokenizer
    from py_engine.tokenizer.bpe import IdTable

    src, compact = compacted[name]
    spec = json.loads(compact.read_text(encoding="utf-8"))
    original = json.loads(src.read_text(encoding="utf-8"))["model"]
    assert isinstance(spec["model"]["vocab"], list)  # every one of these has ids 0 .. n - 1
    pairs = original["merges"] and not isinstance(original["merges"][0], str)
    if pairs and not any(" " in t for m in original["merges"] for t in m):
        assert all(isinstance(m, str) for m in spec["model"]["merges"])
    ours, hf = Tokenizer.from_file(compact), tokenizers.Tokenizer.from_file(str(src))
    assert isinstance(ours.model.vocab_r, IdTable)
    for text in CORPUS + SPECIAL_STRINGS:
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add).ids
            assert ours.encode(text, add_special_tokens=add) == ids, (name, text, add)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    size = hf.get_vocab_size(with_added_tokens=False)
    for i in (0, 1, size // 2, size - 1):
        assert ours.id_to_token(i) == hf.id_to_token(i)
    assert ours.model.vocab_r.get(size + 10**6) is None and ours.model.vocab_r.get(-1) is None


def test_other_forms_are_handed_over_as_they_are(tmp_path):
    """Ids with a gap, a non-BPE model, bytes that are not JSON: the file as it was (Python reads it)."""
    cases = [{"model": {"type": "BPE", "vocab": {"a": 0, "b": 2}, "merges": []}},
             {"model": {"type": "WordPiece", "vocab": {"a": 0, "b": 1}}}]
    files = []
    for i, case in enumerate(cases):
        files.append(tmp_path / f"t{i}.json")
        files[-1].write_text(json.dumps(case), encoding="utf-8")
    files.append(tmp_path / "bad.json")
    files[-1].write_bytes(b"\xff{not json")
    done = subprocess.run([tool("node"), str(DRIVER), str(REPO / "npm" / "src"), str(tmp_path), *map(str, files)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    for i, f in enumerate(files):
        assert (tmp_path / f"{i}-{f.name}.compact.json").read_bytes() == f.read_bytes()
