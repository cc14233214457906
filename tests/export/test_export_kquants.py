"""A GGUF of K-quants, Q5_0 and Q5_1 (a model loaded from the file: its blocks as GGMLWeight) exported to ONNX, native
and web: MatMulNBits over each tensor's export form (GGMLWeight.export_form), in onnxruntime against the torch
model's dequantize-then-matmul (test_quant_export.check_logits: 1e-4 and the same greedy ids).

- exact forms: Q4_K (its own 4-bit codes, scales and minimums), Q5_0 / Q5_1 / Q5_K (5-bit codes as 8-bit ones),
  Q3_K (8-bit codes over the block's scale); a fused q/k/v of Q4_K beside Q5_0 (8-bit codes, the zero points folded
  into minimums) and 8-bit codes with minimums on the native target (the web form's minimums term);
- re-quantized: Q6_K and Q2_K (8 bits in blocks of 32), against the model with those weights, their error
  stated in the graph's metadata and a logged line;
- a tied Q6_K table: the head and the embedding read one set of codes.
"""
from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from export.exporter import export_model, read_metadata  # noqa: E402
from export.options import ExportOptions  # noqa: E402
from py_engine.hub import resolve_model  # noqa: E402
from py_engine.models import load_model  # noqa: E402
from py_engine.quant.ggml import GGMLWeight  # noqa: E402
from py_engine.quant.linear import QuantLinear  # noqa: E402
from tests.export.test_quant_export import check_logits  # noqa: E402
from tests.importers.gguf_builder import byte_level_vocab, hf_model, write_gguf  # noqa: E402
from tests.tiny_models import train_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

EXACT = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q5_1", "attn_output": "Q3_K", "ffn_gate": "Q5_K",
         "ffn_up": "Q4_K", "ffn_down": "Q5_0", "token_embd": "Q4_K", "output": "Q5_K"}
REQUANTIZED = {"attn_q": "Q6_K", "attn_k": "Q2_K", "attn_v": "Q6_K", "attn_output": "Q6_K", "ffn_gate": "Q2_K",
               "ffn_up": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(folder)
    return byte_level_vocab(folder / "tokenizer.json", "gpt-2")


def gguf_model(vocab, folder, kinds: dict[str, str], tied: bool = False):
    """A tiny Llama written with a type per tensor kind, loaded as ruvllm loads the file."""
    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512,
                        tie_word_embeddings=tied, initializer_range=0.05)
    path = write_gguf(folder / "m.gguf", original, vocab,
                      lambda name, data: kinds.get(name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0], "F32"))
    model_dir = resolve_model(str(path), str(folder / "cache"))
    model, config = load_model(model_dir)
    assert all(isinstance(m.packed, GGMLWeight) for m in model.modules() if isinstance(m, QuantLinear))
    return model_dir, model, config


def export_forms(model):
    """The model with every GGUF-block layer holding the weights its export multiplies (GGMLWeight.export_form)."""
    import copy

    from export.quantized import export_form

    twin = copy.deepcopy(model)
    for name, m in list(twin.named_modules()):
        if isinstance(m, QuantLinear) and isinstance(m.packed, GGMLWeight):
            parent, _, leaf = name.rpartition(".")
            setattr(twin.get_submodule(parent) if parent else twin, leaf, QuantLinear(export_form(m.packed)[0], m.bias))
    embedding = twin.model.embed_tokens
    if getattr(embedding, "tied", False):  # its rows are the head's: the new head's
        object.__setattr__(embedding, "_head", twin.lm_head)
    return twin


@pytest.mark.parametrize("target", ["native", "web"])
def test_exact_forms_export_the_files_weights(vocab, tmp_path, target):
    model_dir, model, config = gguf_model(vocab, tmp_path, EXACT)
    options = ExportOptions(precision="int4", accuracy_level=0, target=target)
    result = export_model(model_dir, tmp_path / "onnx", options, model=model)
    check_logits(model, config, [result.model_path], f"gguf exact forms {target}")
    notes = json.loads(read_metadata(result.model_path)["ruvllm.ggml_weights"])
    assert {n["type"]: n["form"] for n in notes} == {"Q4_K": "4-bit, exact", "Q5_0": "8-bit, exact",
                                                     "Q5_1": "8-bit, exact", "Q5_K": "8-bit, exact",
                                                     "Q3_K": "8-bit, exact"}


@pytest.mark.parametrize("target", ["native", "web"])
def test_requantized_forms_state_their_error(vocab, tmp_path, target, caplog):
    model_dir, model, config = gguf_model(vocab, tmp_path, REQUANTIZED, tied=True)
    assert model.model.embed_tokens.tied and isinstance(model.lm_head.packed, GGMLWeight)
    options = ExportOptions(precision="int4", accuracy_level=0, target=target)
    with caplog.at_level(logging.WARNING, logger="ruvllm.export"):
        result = export_model(model_dir, tmp_path / "onnx", options, model=model)
    check_logits(export_forms(model), config, [result.model_path], f"gguf re-quantized forms {target}")
    notes = {n["type"]: n for n in json.loads(read_metadata(result.model_path)["ruvllm.ggml_weights"])}
    assert set(notes) == {"Q6_K", "Q2_K"} and notes["Q6_K"]["tensors"] == 2 * 5 + 1  # the tied table once
    for note in notes.values():
        assert note["form"] == "re-quantized to 8-bit blocks of 32 (RTN)"
        assert 0 < note["relative_rms_error"] < 0.01 and note["max_abs_error"] > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "ruvllm.export"]
    assert len(lines) == 2 and all("re-quantized to 8-bit blocks of 32" in line and "relative RMS" in line
                                   for line in lines)
