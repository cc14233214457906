"""GGUF memory: metadata arrays read compactly (importers/gguf/arrays.py) and a quantized token_embd gathered
from its codes (QuantEmbedding), against gguf's own reader and dequantization.

- every metadata value (string, int, float and bool arrays, non-ASCII and empty strings, an empty and a
  nested array, scalars) reads the same as gguf.GGUFReader's ReaderField.contents();
- a string array running past the end of the file is an error naming the file;
- a tied Q8_0 model gathers its embedding rows from the head's codes: gguf's dequantization of token_embd,
  bit for bit, with no float table left; an untied Q4_0 token_embd gets its own codes.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

from tests.importers.gguf_builder import byte_level_vocab, hf_model, write_gguf  # noqa: E402
from tests.tiny_models import train_tokenizer  # noqa: E402

from py_engine.hub import resolve_model  # noqa: E402
from py_engine.importers.gguf.arrays import ArrayField  # noqa: E402
from py_engine.importers.gguf.reader import GGUFFile  # noqa: E402
from py_engine.models import ModelLoadError, load_model  # noqa: E402
from py_engine.quant.embedding import QuantEmbedding  # noqa: E402
from py_engine.quant.linear import QuantLinear  # noqa: E402


def metadata_file(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["a", "", "Ġhé", "日本語", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.string", "plain")
    w.add_uint32("t.u32", 7)
    w.add_tensor("w", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_reads_as_gguf_reads_it(tmp_path):
    path = metadata_file(tmp_path / "meta.gguf")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        assert ours.get(key) == (list(expected) if isinstance(expected, list) else expected), key
    assert isinstance(ours.fields["t.strings"], ArrayField) and len(ours.fields["t.strings"].data) == 5
    assert ours.fields["t.strings"].contents(3) == "日本語"
    assert not isinstance(ours.fields["t.nested"], ArrayField)  # nested arrays: the reader's own parts


def test_string_array_past_the_end_names_the_file(tmp_path):
    data = bytearray(metadata_file(tmp_path / "meta.gguf").read_bytes())
    at = data.index(b"x" * 300) - 8  # the last string's u64 length
    data[at:at + 8] = (1 << 40).to_bytes(8, "little")
    bad = tmp_path / "long.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"long\.gguf: not a readable GGUF file .*past the end"):
        GGUFFile(bad)


@pytest.mark.parametrize("key", ["t.strings", "t.ints"])
def test_a_hostile_array_count_is_refused_before_anything_is_sized_by_it(tmp_path, key):
    """An array's u64 entry count comes from the file: 2^62 strings or ints must be a clear error, not an
    allocation of 2^65 bytes (MemoryError) or a misleading "runs past the end"."""
    data = bytearray(metadata_file(tmp_path / "meta.gguf").read_bytes())
    name = key.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 8  # past the key, the value type and the item type
    data[at:at + 8] = (1 << 62).to_bytes(8, "little")
    bad = tmp_path / "huge.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"huge\.gguf: not a readable GGUF file .*over the limit"):
        GGUFFile(bad)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(folder)
    return byte_level_vocab(folder / "tokenizer.json", "gpt-2")


@pytest.mark.parametrize("qtype, tied", [("Q8_0", True), ("Q4_0", False)])
def test_token_rows_come_from_the_codes(vocab, tmp_path, qtype, tied):
    hf = hf_model("llama", len(vocab.tokens), tie_word_embeddings=tied)
    path = write_gguf(tmp_path / "m.gguf", hf, vocab, qtype)
    model, config = load_model(resolve_model(str(path), str(tmp_path / "cache")))
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding) and embedding.tied == tied
    assert isinstance(model.lm_head, QuantLinear) and (embedding.rows is model.lm_head) == tied
    table = gguf.GGUFReader(str(path)).tensors
    raw = next(t for t in table if t.name == "token_embd.weight")
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw.data, raw.tensor_type), np.float32))
    ids = torch.tensor([[0, 3, len(vocab.tokens) - 1, 3]])
    assert torch.equal(embedding(ids), expected[ids])
    shape = (config.vocab_size, config.hidden_size)
    assert not [n for n, p in model.named_parameters() if tuple(p.shape) == shape]
