"""QuantEmbedding: a quantized model's token rows gathered from integer codes (py_engine.quant.embedding).

- tied: the rows are the LM head's own dequantized rows (`head.dequantize()[ids]`, the weights the head
  multiplies with), bit for bit, in the model's dtype; int8 and 4-bit heads;
- untied: the embedding gets its own codes, onnxruntime-MLAS RTN as the head (rtn.quantize_rtn is the
  reference), and each value stays within half a step of the float table;
- no float [vocab, hidden] tensor is left anywhere in the model; lm_head_bits=None keeps the float table;
- the logits stay within the int8 tolerance of the same quantized model with its float table (the
  behaviour before), and the built-in model's greedy text is unchanged;
- a quantized checkpoint written by save_quantized holds the rows the model gathered.
"""
from __future__ import annotations

import pytest

from tests.model_cases import positions, prompt
from tests.tiny_models import build_tiny_model

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from py_engine import LLM, SamplingParams  # noqa: E402
from py_engine.cpu.transforms import optimize_for_cpu  # noqa: E402
from py_engine.hub import builtin_path  # noqa: E402
from py_engine.models import DenseKVCache, load_model  # noqa: E402
from py_engine.quant.config import QuantConfig  # noqa: E402
from py_engine.quant.embedding import QuantEmbedding  # noqa: E402
from py_engine.quant.linear import QuantLinear, set_int8_activations  # noqa: E402
from py_engine.quant.rtn import quantize_rtn  # noqa: E402
from py_engine.quant.transform import quantize_model  # noqa: E402

OPTIONS = {"int8": dict(), "int4": dict(group_size=32), "int4+head4": dict(group_size=32, lm_head_bits=4)}


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tied"), "llama")


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("untied"), "qwen2", tie_word_embeddings=False)


def quantized(path, method: str = "int8", dtype: str = "float32", **options):
    model, _ = load_model(path, dtype=dtype)
    report = quantize_model(model, QuantConfig.from_options(method.split("+")[0], **options), progress=False)
    return model, report


def float_tables(model: nn.Module) -> list[str]:
    """Names of float tensors shaped like the embedding table."""
    shape = (model.config.vocab_size, model.config.hidden_size)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return [name for name, t in tensors if tuple(t.shape) == shape and t.is_floating_point()]


IDS = torch.tensor([[0, 5, 17, 5], [3, 250, 1, 99]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", list(OPTIONS))
def test_tied_rows_are_the_heads_dequantized_rows(tied, method, dtype):
    model, report = quantized(tied, method, dtype, **OPTIONS[method])
    embedding, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embedding, QuantEmbedding) and embedding.tied and embedding.rows is head
    assert head.bits == (4 if "head4" in method else 8) and report.layers == 2 * 7 + 1
    ids = IDS.clamp(max=model.config.vocab_size - 1)
    rows = embedding(ids)
    assert rows.shape == (2, 4, model.config.hidden_size) and rows.dtype == getattr(torch, dtype)
    assert torch.equal(rows, head.dequantize()[ids].to(rows.dtype))
    assert float_tables(model) == [] and embedding.nbytes == 0
    with pytest.raises(IndexError):
        embedding(torch.tensor([[model.config.vocab_size]]))


def test_untied_embedding_gets_its_own_codes(untied):
    float_table = load_model(untied, dtype="float32")[0].model.embed_tokens.weight.detach()
    model, report = quantized(untied, "int8")
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding) and not embedding.tied and embedding.table is not model.lm_head
    assert report.layers == 2 * 7 + 2 and isinstance(embedding.table, QuantLinear) and embedding.table.bits == 8
    ids = IDS.clamp(max=model.config.vocab_size - 1)
    reference = quantize_rtn(float_table, 8, None, True)  # int8 per channel, symmetric: the head's scheme
    assert torch.equal(embedding(ids), reference.dequantize()[ids])
    step = reference.scales.abs()[ids]  # [2, 4, 1]
    assert ((embedding(ids) - float_table[ids]).abs() <= step / 2 + 1e-7).all()
    assert float_tables(model) == [] and embedding.nbytes == embedding.table.nbytes


def test_float_head_keeps_the_float_embedding(tied):
    model, _ = quantized(tied, "int8", lm_head_bits=None)
    assert type(model.model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight


def with_float_embedding(model: nn.Module, path) -> nn.Module:
    """The quantized model as it was before QuantEmbedding: the checkpoint's float table for the rows."""
    model.model.embed_tokens = load_model(path, dtype="float32")[0].model.embed_tokens
    return model


def logits(model: nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        ids = prompt(20)
        kv = DenseKVCache.allocate(model.config, 1, 20, dtype=torch.float32)
        out = [model(ids[:, :16], positions(0, 16), kv)]
        out += [model(ids[:, t:t + 1], positions(t, t + 1), kv) for t in range(16, 20)]
        return torch.cat(out, dim=1)


@pytest.mark.parametrize("method, bound", [("int8", 0.01), ("int4", 0.01), ("int4+head4", 0.05)])
def test_logits_stay_within_tolerance_of_the_float_embedding(method, bound):
    """On the built-in (trained) model the rows' rounding moves the logits by less than the quantized weights
    do, and by less than 1% of the largest logit with the default int8 head (5% with a 4-bit one; measured
    0.3% and 4.5%; int8 activations in decode move them ~0.5%)."""
    path = builtin_path()
    model, _ = quantized(path, method, **OPTIONS[method])
    optimize_for_cpu(model)
    set_int8_activations(model, False)
    now = logits(model)
    before = logits(with_float_embedding(model, path))
    reference = logits(load_model(path, dtype="float32")[0])
    moved = (now - before).abs().max()
    assert 0 < moved < bound * reference.abs().max() and moved < (before - reference).abs().max()


def test_builtin_model_greedy_text_is_unchanged():
    params = SamplingParams(max_tokens=32, temperature=0.0)
    texts = []
    for float_rows in (False, True):
        llm = LLM(str(builtin_path()), dtype="float32", optimize=False)
        quantize_model(llm.model, QuantConfig.from_options("int8"), progress=False)
        if float_rows:
            with_float_embedding(llm.model, builtin_path())
        else:
            assert isinstance(llm.model.model.embed_tokens, QuantEmbedding)
        optimize_for_cpu(llm.model)
        texts.append(llm.generate("ROMEO:", params).token_ids)
    assert texts[0] == texts[1]


def test_saved_checkpoint_holds_the_gathered_rows(tied, tmp_path):
    from py_engine.quant.hf_format import save_quantized

    model, config = load_model(tied, dtype="float32")
    qconfig = QuantConfig.from_options("int4", group_size=32)
    quantize_model(model, qconfig, progress=False)
    ids = IDS.clamp(max=config.vocab_size - 1)
    rows = model.model.embed_tokens(ids)
    out = save_quantized(model, config, qconfig, tmp_path / "q", tied)
    reloaded, _ = load_model(out, dtype="float32")
    assert torch.equal(reloaded.model.embed_tokens(ids), rows)
