"""The tokenizer.json form the page hands its Python (npm/src/model.js compactTokenizer): a BPE vocabulary whose
ids are 0 .. n - 1 and its merges as binary tables beside a small tokenizer.json (npm/src/bpe_tables.js,
py_engine/tokenizer/tables.py), or, where the tables cannot say the same, the vocabulary as a token list and
merges as "a b" strings. Pyodide's heap never shrinks, and the usual form's Python objects were its
high-water mark. py_engine's tokenizer over the compact files must give Hugging Face `tokenizers`' ids and
text over the original file, for real tokenizers of both merge layouts, with and without byte fallback.
"""
from __future__ import annotations

import json
import shutil
import struct
import subprocess

import pytest

from tests.paths import REPO, shared_fixture
from tests.requires import tool
from tests.tokenizer.tokenizer_corpus import CORPUS, SPECIAL_STRINGS

tokenizers = pytest.importorskip("tokenizers")

NAMES = ["llama-3.2", "qwen2.5", "gpt2", "tinyllama-1.1b-chat-v1.0", "phi-2"]
DRIVER = REPO / "tests" / "web" / "js" / "compact_tokenizer.mjs"


def _compact(out, files, timeout=120):
    done = subprocess.run([tool("node"), str(DRIVER), str(REPO / "npm" / "src"), str(out), *map(str, files)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return [out / str(i) for i in range(len(files))]


@pytest.fixture(scope="module")
def compacted(tmp_path_factory):
    files = [shared_fixture("tokenizers", name, "tokenizer.json") for name in NAMES]
    folders = _compact(tmp_path_factory.mktemp("compact"), files)
    return dict(zip(NAMES, zip(files, folders)))


@pytest.mark.parametrize("name", NAMES)
def test_compact_tokenizer_equals_tokenizers(compacted, name):
    from py_engine.tokenizer import Tokenizer
    from py_engine.tokenizer.tables import TokenList

    src, folder = compacted[name]
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["model"]["ruvllm_tables"] == "tokenizer.bpe" and "vocab" not in spec["model"]
    ours, hf = Tokenizer.from_file(folder / "tokenizer.json"), tokenizers.Tokenizer.from_file(str(src))
    assert isinstance(ours.model.vocab_r, TokenList)
    for text in CORPUS + SPECIAL_STRINGS:
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add).ids
            assert ours.encode(text, add_special_tokens=add) == ids, (name, text, add)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    size = hf.get_vocab_size(with_added_tokens=False)
    assert ours.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    for i in (0, 1, size // 2, size - 1):
        token = hf.id_to_token(i)
        assert ours.id_to_token(i) == token and ours.token_to_id(token) == hf.token_to_id(token)
    assert ours.model.vocab_r.get(size + 10**6) is None and ours.model.vocab_r.get(-1) is None
    assert ours.token_to_id("no such token \u2603\u2603") is None and ours.token_to_id("\ud800") is None


def test_compact_folder_loads_as_the_original(compacted, tmp_path):
    """from_pretrained over the page's files: the tokenizer_config's BOS flag finds its id in the tables."""
    from py_engine.tokenizer import Tokenizer

    src, folder = compacted["tinyllama-1.1b-chat-v1.0"]
    for f in ("tokenizer.json", "tokenizer.bpe"):
        shutil.copy(folder / f, tmp_path / f)
    config = json.loads((src.parent / "tokenizer_config.json").read_text(encoding="utf-8"))
    spec = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<s>"]  # BOS from the vocabulary
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, add_bos_token=True)), encoding="utf-8")
    ours = Tokenizer.from_pretrained(tmp_path)
    hf = tokenizers.Tokenizer.from_file(str(src))
    assert ours.encode("Hello world") == [1, *hf.encode("Hello world", add_special_tokens=False).ids]


def test_other_forms_are_handed_over_as_they_are(tmp_path):
    """Ids with a gap, a non-BPE model, bytes that are not JSON: the file as it was (Python reads it). A merge
    whose merged token is not in the vocabulary: the list form, which tokenizes as before."""
    from py_engine.tokenizer import Tokenizer

    cases = [{"model": {"type": "BPE", "vocab": {"a": 0, "b": 2}, "merges": []}},
             {"model": {"type": "WordPiece", "vocab": {"a": 0, "b": 1}}}]
    files = []
    for i, case in enumerate(cases):
        files.append(tmp_path / f"t{i}.json")
        files[-1].write_text(json.dumps(case), encoding="utf-8")
    files.append(tmp_path / "bad.json")
    files[-1].write_bytes(b"\xff{not json")
    odd = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "bc": 3}, "merges": ["a b", "b c"]}}
    files.append(tmp_path / "odd.json")
    files[-1].write_text(json.dumps(odd), encoding="utf-8")
    folders = _compact(tmp_path / "out", files, timeout=60)
    for f, folder in zip(files[:3], folders):
        assert (folder / "tokenizer.json").read_bytes() == f.read_bytes()
        assert not (folder / "tokenizer.bpe").exists()
    spec = json.loads((folders[3] / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["model"]["vocab"] == ["a", "b", "c", "bc"] and not (folders[3] / "tokenizer.bpe").exists()
    assert Tokenizer.from_file(folders[3] / "tokenizer.json").encode("bcb") == \
        Tokenizer.from_file(files[3]).encode("bcb") == [3, 1]


def test_bad_tables_are_refused(compacted, tmp_path):
    """A truncated or inconsistent tables file, or a name that leaves the folder: a ConfigError naming it."""
    from py_engine.config import ConfigError
    from py_engine.tokenizer import Tokenizer

    _, folder = compacted["gpt2"]
    data = (folder / "tokenizer.bpe").read_bytes()
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    n_tokens, token_bits = struct.unpack_from("<i", data, 8)[0], struct.unpack_from("<i", data, 16)[0]
    full = bytearray(data)  # every token slot taken: a probe for a missing token would never stop
    struct.pack_into(f"<{1 << token_bits}i", full, 4 * (8 + n_tokens + 1), *[0] * (1 << token_bits))
    cases = {"cut": (data[:-1], "tokenizer.bpe", "the header says otherwise"),
             "magic": (b"XXXX" + data[4:], "tokenizer.bpe", "no RBPE header"),
             "full": (bytes(full), "tokenizer.bpe", "no empty slot"),
             "escape": (data, "../escape/tokenizer.bpe", "must be a file name")}
    for case, (payload, name, why) in cases.items():
        (tmp_path / case).mkdir()
        (tmp_path / case / "tokenizer.bpe").write_bytes(payload)
        model = dict(spec["model"], ruvllm_tables=name)
        (tmp_path / case / "tokenizer.json").write_text(json.dumps(dict(spec, model=model)), encoding="utf-8")
        with pytest.raises(ConfigError, match=f"tokenizer.json.*{why}"):
            Tokenizer.from_file(tmp_path / case / "tokenizer.json")
        with pytest.raises(ConfigError, match=f"tokenizer.json.*{why}"):
            Tokenizer.from_pretrained(tmp_path / case)
