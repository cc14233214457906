"""GGUF import on small files written here with gguf's writer (tests/gguf_builder.py), against transformers.

References: the transformers model the file was written from (logits of the float import), transformers'
own GGUF loader (`from_pretrained(dir, gguf_file=...)`, dequantized with gguf's reference) and gguf's
reference dequantization for the native Q4_0 / Q4_1 / Q8_0 codes. Covers llama (q/k permuted), qwen2,
phi3, gemma, gemma2, tied and untied heads, every native type, F16 / IQ4_NL dequantized, the
import-gguf folder loaded by transformers, and bad files (the block types: test_gguf_kquants.py).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tests.importers.gguf_builder import byte_level_vocab, hf_model, write_gguf  # noqa: E402
from tests.tiny_models import train_tokenizer  # noqa: E402

from py_engine.hub import resolve_model  # noqa: E402
from py_engine.models import DenseKVCache  # noqa: E402
from py_engine.models.loader import ModelLoadError, load_model  # noqa: E402
from py_engine.quant.linear import QuantLinear, set_int8_activations  # noqa: E402

IDS = [5, 17, 200, 3, 99, 42, 7, 150, 64, 8, 250, 33, 1, 77, 120, 9]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(folder)
    return byte_level_vocab(folder / "tokenizer.json", "gpt-2")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(autouse=True)
def _one_thread(torch_one_thread):
    yield


def logits(model, config, ids=IDS, decode=4) -> torch.Tensor:
    """Prefill logits [T, V] then `decode` greedy steps' logits, concatenated."""
    kv = DenseKVCache.allocate(config, 1, len(ids) + decode, torch.float32, "cpu")
    with torch.inference_mode():
        out = [model(torch.tensor([ids]), torch.arange(len(ids))[None], kv)[0]]
        for i in range(decode):
            token = int(out[-1][-1].argmax())
            out.append(model(torch.tensor([[token]]), torch.tensor([[len(ids) + i]]), kv)[0])
    return torch.cat(out)


def hf_logits(model, ids=IDS, decode=4) -> torch.Tensor:
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        rows, past = [out.logits[0]], out.past_key_values
        for _ in range(decode):
            token = int(rows[-1][-1].argmax())
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.past_key_values
    return torch.cat(rows).float()


def hf_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


ARCHS = [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("phi3", {}),
         ("gemma", {}), ("gemma2", {})]


@pytest.mark.parametrize("model_type,overrides", ARCHS, ids=["llama", "llama-tied", "qwen2", "phi3", "gemma", "gemma2"])
def test_float_import_matches_the_original_model(model_type, overrides, vocab, cache, tmp_path):
    original = hf_model(model_type, len(vocab.tokens), **overrides)
    path = write_gguf(tmp_path / f"{model_type}.gguf", original, vocab, "F32")
    model, config = load_model(resolve_model(str(path), cache))
    assert config.tie_word_embeddings == original.config.tie_word_embeddings
    ours = logits(model, config)
    assert (ours - hf_logits(original)).abs().max().item() < 1e-4
    if model_type != "gemma":  # transformers reads no `gemma` GGUF (gemma2 and gemma3 only)
        assert (ours - hf_logits(hf_gguf(path))).abs().max().item() < 1e-4


def test_llama3_rope_scaling_is_read_from_rope_freqs(vocab, cache, tmp_path):
    """Llama 3.1/3.2 files carry their rope scaling as the rope_freqs.weight table, not as metadata."""
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    original = hf_model("llama", len(vocab.tokens), rope_theta=500000.0, rope_scaling=scaling,
                        max_position_embeddings=256)
    path = write_gguf(tmp_path / "llama3.gguf", original, vocab, "F32")
    model, config = load_model(resolve_model(str(path), cache))
    assert config.rope_parameters.rope_type == "llama3" and config.rope_parameters.factor == 32.0
    assert (logits(model, config) - hf_logits(original)).abs().max().item() < 1e-4


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_native_types_stay_codes_and_match_dequantized(qtype, tied, vocab, cache, tmp_path):
    original = hf_model("llama", len(vocab.tokens), tie_word_embeddings=tied)
    path = write_gguf(tmp_path / f"{qtype}.gguf", original, vocab, qtype)
    folder = resolve_model(str(path), cache)
    native, config = load_model(folder)
    floats, _ = load_model(folder, dequantize=True)
    q_proj = native.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear) and isinstance(native.lm_head, QuantLinear)
    assert (q_proj.packed.offsets is not None) == (qtype == "Q4_1")
    # the codes give gguf's reference values exactly (q_proj un-permuted like the float path)
    assert torch.equal(q_proj.dequantize(), floats.model.layers[0].self_attn.q_proj.weight)
    head = floats.lm_head.weight
    assert torch.equal(native.lm_head.dequantize(), head)
    reader = gguf.GGUFReader(path)
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert torch.equal(native.model.layers[1].mlp.down_proj.dequantize(),
                       torch.from_numpy(gguf.quants.dequantize(down.data, down.tensor_type)))
    set_int8_activations(native, False)  # the exact float decode path: the codes' own error only
    reference = logits(floats, config)
    assert (logits(native, config) - reference).abs().max().item() < 1e-3
    assert (reference - hf_logits(hf_gguf(path))).abs().max().item() < 1e-4
    set_int8_activations(native, True)  # llama.cpp's scheme: x rounded to int8 per 32 values
    for n in (1, len(IDS)):  # one row, and 16 rows in integer tiles; no greedy steps: each would follow its own argmax
        got, expected = logits(native, config, IDS[:n], decode=0), logits(floats, config, IDS[:n], decode=0)
        assert (got - expected).abs().max().item() < 0.5


@pytest.mark.parametrize("qtype", ["F16", "IQ4_NL"])  # Q5_x and K-quants stay codes: test_gguf_kquants.py
def test_other_types_are_dequantized_with_ggml_reference(qtype, vocab, cache, tmp_path):
    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512)
    path = write_gguf(tmp_path / f"{qtype}.gguf", original, vocab, qtype)
    model, config = load_model(resolve_model(str(path), cache))
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert (logits(model, config) - hf_logits(hf_gguf(path))).abs().max().item() < 1e-4


def test_requantize_flag_starts_from_the_dequantized_weights(vocab, cache, tmp_path):
    from py_engine.quant.load import load_quantized

    path = write_gguf(tmp_path / "q41.gguf", hf_model("llama", len(vocab.tokens)), vocab, "Q4_1")
    model, _, report = load_quantized(resolve_model(str(path), cache), "int8")
    q_proj = model.model.layers[0].self_attn.q_proj
    assert report.layers > 0 and q_proj.bits == 8 and q_proj.packed.offsets is None


def test_import_gguf_writes_a_folder_transformers_loads(vocab, tmp_path):
    original = hf_model("llama", len(vocab.tokens))
    path = write_gguf(tmp_path / "m.gguf", original, vocab, "Q8_0")
    out = tmp_path / "hf"
    run = subprocess.run([sys.executable, "-m", "ruvllm_cli", "import-gguf", str(path), "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert {p.name for p in out.iterdir()} >= {"config.json", "generation_config.json", "tokenizer.json",
                                               "tokenizer_config.json", "model.safetensors"}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    expected = hf_logits(hf_gguf(path))
    assert (hf_logits(loaded) - expected).abs().max().item() < 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    chat = [{"role": "user", "content": "To be, or not 12?"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == reference.apply_chat_template(chat, tokenize=False)
    assert tokenizer("To be, or not 12?").input_ids == reference("To be, or not 12?").input_ids


def test_unsupported_architecture_names_what_is(vocab, cache, tmp_path):
    from py_engine.config import ConfigError

    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", len(vocab.tokens)), vocab, "F32", arch="starcoder2")
    with pytest.raises(ConfigError, match=r"m\.gguf.*'starcoder2' is not supported.*llama, qwen2, phi3, gemma"):
        resolve_model(str(path), cache)


def test_wrong_magic_and_truncated_file(vocab, cache, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", len(vocab.tokens)), vocab, "Q4_0")
    data = path.read_bytes()
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(ModelLoadError, match=r"magic\.gguf: not a GGUF file"):
        resolve_model(str(bad), cache)
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:-1000])
    with pytest.raises(ModelLoadError, match=r"short\.gguf: tensor 'output\.weight' .* truncated"):
        resolve_model(str(short), cache)


def test_unknown_tensor_type_names_the_tensor(vocab, cache, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", len(vocab.tokens)), vocab, "F32")
    data = bytearray(path.read_bytes())
    name = b"blk.1.attn_v.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)  # n_dims u32, dims u64 x n, type u32
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "type.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"type\.gguf: tensor 'blk\.1\.attn_v\.weight' has ggml type 99"):
        resolve_model(str(bad), cache)


def test_tensor_shape_disagreeing_with_metadata(vocab, cache, tmp_path):
    def hook(name, data):
        return data[:-16] if name == "blk.0.attn_k.weight" else data

    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", len(vocab.tokens)), vocab, "Q8_0", tensor_hook=hook)
    with pytest.raises(ModelLoadError, match=r"m\.gguf: tensor 'blk\.0\.attn_k\.weight' .* shape \[16, 64\] .*\[32, 64\]"):
        load_model(resolve_model(str(path), cache))
    run = subprocess.run([sys.executable, "-m", "ruvllm_cli", "generate", "--model", str(path), "--cache-dir",
                          cache, "hi"], capture_output=True, text=True)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "blk.0.attn_k.weight" in lines[0]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K"])
def test_dequantizing_in_row_chunks_gives_gguf_s_values(qtype, vocab, tmp_path, monkeypatch):
    """Matrices dequantize a chunk of rows at a time (peak memory): the same floats as gguf whole."""
    from py_engine.importers.gguf import tensors
    from py_engine.importers.gguf.reader import GGUFFile

    path = write_gguf(tmp_path / f"{qtype}.gguf", hf_model("llama", len(vocab.tokens), hidden_size=256,
                                                           intermediate_size=512), vocab, qtype)
    file = GGUFFile(path)
    t = file.tensors["token_embd.weight"]
    whole = gguf.quants.dequantize(t.data, t.qtype).reshape(t.shape)
    monkeypatch.setattr(tensors, "DEQUANT_ROWS", 7)  # several chunks and a short last one
    assert t.shape[0] > 7 and t.shape[0] % 7
    chunked = tensors.dequantize(file, t)
    assert chunked.dtype == whole.dtype and (chunked == whole).all()
