"""Unit tests of py_engine.tokenizer: exact ids on tiny models, refusals, config, streaming."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.paths import shared_fixture

from py_engine.tokenizer.regex import OnigRegex
from py_engine.tokenizer import IncrementalDecoder, Tokenizer

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def tiny(**sections) -> dict:
    """A byte-level BPE over 'a', 'b', space, with merges a+b then Ġ+ab."""
    spec = {
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "Ġab": 4}, "merges": ["a b", "Ġ ab"]},
        "pre_tokenizer": BYTE_LEVEL, "decoder": {"type": "ByteLevel"},
        "added_tokens": [{"id": 5, "content": "<s>", "special": True, "lstrip": False, "rstrip": False,
                          "normalized": False, "single_word": False}],
    }
    spec.update(sections)
    return spec


def test_tiny_encode_decode() -> None:
    tok = Tokenizer(tiny())
    assert tok.encode("ab ab") == [2, 4]
    assert tok.encode("<s>ab") == [5, 2]
    assert tok.decode([5, 2, 4]) == "<s>ab ab"
    assert tok.decode([5, 2, 4], skip_special_tokens=True) == "ab ab"
    assert tok.token_to_id("<s>") == 5 and tok.id_to_token(4) == "Ġab" and tok.vocab_size == 6
    assert tok.decode([99, 2]) == "ab"  # unknown ids are skipped, as tokenizers does


def test_merge_order_is_rank_then_leftmost() -> None:
    vocab = {c: i for i, c in enumerate(["a", "aa", "aaa", "b"])}
    tok = Tokenizer({"model": {"type": "BPE", "vocab": vocab, "merges": [["a", "a"], ["aa", "a"]]}})
    assert tok.encode("aaa") == [2]  # a a -> aa first (rank 0, leftmost), then aa a
    assert tok.encode("aaaa") == [1, 1]  # leftmost a+a twice beats aa+a (rank 1)


def test_pair_merges_with_spaces_in_tokens() -> None:
    """[a, b] merges whose tokens hold a space (tokenizers allows it) rank by the pair, never by a joined
    string two pairs share ("a " + "b" and "a" + " b" both join to "a  b" with a space): HF tokenizers' ids."""
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {c: i for i, c in enumerate(["a", " ", "b", "c", "a ", " b", "bc", "a b"])}
    merges = [[" ", "b"], ["a ", "b"], ["a", " "], ["b", "c"]]
    model = {"type": "BPE", "vocab": vocab, "merges": merges}
    hf = HFTokenizer.from_str(json.dumps({"version": "1.0", "added_tokens": [], "model": {
        **model, "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
        "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}}))
    tok = Tokenizer({"model": model})
    for text in ("a bc", "a b", " bc", "a  b"):
        assert tok.encode(text) == hf.encode(text).ids, text
    with pytest.raises(ValueError, match="pair"):
        Tokenizer({"model": {**model, "merges": [["a", " ", "b"]]}})


@pytest.mark.parametrize("section, spec, words", [
    ("model", {"type": "Unigram", "vocab": []}, ["model", "Unigram"]),
    ("model", {"type": "BPE", "vocab": {}, "merges": [], "dropout": 0.1}, ["dropout"]),
    ("normalizer", {"type": "Precompiled", "precompiled_charsmap": ""}, ["normalizer", "Precompiled"]),
    ("normalizer", {"type": "BertNormalizer"}, ["normalizer", "BertNormalizer"]),
    ("pre_tokenizer", {"type": "UnicodeScripts"}, ["pre_tokenizer", "UnicodeScripts"]),
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": r"\p{Han}+"}, "behavior": "Isolated",
                       "invert": False}, ["Han"]),
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": "[a-z&&[^aeiou]]"}, "behavior": "Isolated",
                       "invert": False}, ["nested"]),
    ("decoder", {"type": "CTC"}, ["decoder", "CTC"]),
    ("decoder", {"type": "WordPiece", "prefix": "##"}, ["decoder", "WordPiece"]),
    ("post_processor", {"type": "Unknown"}, ["post_processor"]),
    ("padding", {"strategy": {"Fixed": 8}}, ["padding"]),
])
def test_unsupported_parts_raise_naming_them(section: str, spec: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        Tokenizer(tiny(**{section: spec}))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_regex_translation() -> None:
    rx = OnigRegex(r"\p{L}+|\p{N}|\s+(?!\S)|\s+|[^\s\p{L}\p{N}]+")
    text = "héllo 𝐀𝐁 ²½ \x1c!"
    compiled, subject = rx.prepared(text)
    assert [text[m.start():m.end()] for m in compiled.finditer(subject)] == \
        ["héllo", " ", "𝐀𝐁", " ", "²", "½", " ", "\x1c!"]  # \x1c is not \s in Oniguruma


def test_truncation_keeps_room_for_specials() -> None:
    template = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                         {"Sequence": {"id": "A", "type_id": 0}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [5], "tokens": ["<s>"]}}}
    tok = Tokenizer(tiny(post_processor=template, truncation={"max_length": 2, "strategy": "LongestFirst",
                                                              "direction": "Right", "stride": 0}))
    assert tok.encode("ab ab ab") == [5, 2]
    assert tok.encode("ab ab ab", add_special_tokens=False) == [2, 4]


def test_stream_never_splits_characters() -> None:
    tok = Tokenizer(tiny())
    ids = tok.encode("ab")
    stream = IncrementalDecoder(tok)
    assert [stream.push(i) for i in ids] + [stream.flush()] == ["ab", ""]


def test_stream_holds_byte_fallback_runs() -> None:
    tok = Tokenizer.from_file(shared_fixture("tokenizers", "tinyllama-1.1b-chat-v1.0", "tokenizer.json"))
    ids = tok.encode("Hi 😀!", add_special_tokens=False)  # the emoji is four <0xXX> tokens
    assert sum(tok.id_to_token(i).startswith("<0x") for i in ids) == 4
    stream = IncrementalDecoder(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids) == "Hi 😀!"
    assert "\ufffd" not in "".join(pieces) and "😀!" in pieces  # whole run once the run ends


def test_stream_byte_level_emoji() -> None:
    tok = Tokenizer.from_file(shared_fixture("tokenizers", "gpt2", "tokenizer.json"))
    ids = tok.encode("a 👨‍👩‍👧 b")
    stream = IncrementalDecoder(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == "a 👨‍👩‍👧 b" and not any("\ufffd" in p for p in pieces)


def test_from_pretrained_specials_and_config() -> None:
    qwen = Tokenizer.from_pretrained(shared_fixture("tokenizers", "qwen2.5"))
    assert qwen.eos_token == "<|im_end|>" and qwen.eos_token_id == 151645
    assert qwen.pad_token_id == 151643 and qwen.bos_token is None and qwen.bos_token_id is None
    assert qwen.config["tokenizer_class"] == "Qwen2Tokenizer" and "im_start" in qwen.chat_template
    llama = Tokenizer.from_pretrained(shared_fixture("tokenizers", "tinyllama-1.1b-chat-v1.0"))
    assert (llama.bos_token_id, llama.eos_token_id, llama.unk_token_id) == (1, 2, 0)
    assert llama.encode("Hi")[0] == 1


def test_from_pretrained_honours_bos_eos_flags(tmp_path: Path) -> None:
    source = shared_fixture("tokenizers", "tinyllama-1.1b-chat-v1.0")
    (tmp_path / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": True,
              "bos_token": "<s>", "eos_token": {"content": "</s>", "__type": "AddedToken"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("Hello world") == [15043, 3186, 2]
    assert tok.encode("Hello world", add_special_tokens=False) == [15043, 3186]


@pytest.mark.parametrize("name", ["llama-3.2", "qwen2.5", "phi-3-mini-4k-instruct", "tinyllama-1.1b-chat-v1.0",
                                  "gpt2", "phi-2"])
def test_from_pretrained_matches_transformers(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    folder = shared_fixture("tokenizers", name)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_pretrained(folder)
    # Plain text only: transformers 5 rebuilds Llama tokenizers from the vocab
    # (Metaspace, no Prepend normalizer), which differs from tokenizer.json
    # around special tokens; our reference there is `tokenizers` itself.
    for text in ["Hello world", "中文 😀\n\n  x", "a  b\tc"]:
        assert ours.encode(text) == ref(text)["input_ids"]
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
