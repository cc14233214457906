"""ONNX export of already-quantized models: MatMulNBits over the model's own codes, scales and zero points.

A tiny Llama quantized by AWQ (in memory, and written as an AWQ gemm checkpoint then loaded: the
int8 LM head stays float there) and the built-in model with symmetric int4 groups and its int8
per-channel head are exported; onnxruntime (fp32, accuracy_level 0) must give the logits of the torch
model's dequantize-then-matmul reference over a prefill and decode steps (1e-4) and the same greedy
tokens. The plain --precision path is covered, byte for byte, by test_export_quant.py.
"""
from __future__ import annotations

import json
from copy import deepcopy as copy_module
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from export_helpers import onnx_decode_logits, session  # noqa: E402
from model_cases import FAMILIES, save_hf_model  # noqa: E402

from export.exporter import export_model  # noqa: E402
from export.options import ExportError, ExportOptions  # noqa: E402
from py_engine.cli import main  # noqa: E402
from py_engine.models import DenseKVCache, load_model  # noqa: E402
from py_engine.quant.config import QuantConfig  # noqa: E402
from py_engine.quant.hf_format import save_quantized  # noqa: E402
from py_engine.quant.linear import QuantLinear  # noqa: E402
from py_engine.quant.load import load_quantized  # noqa: E402
from py_engine.quant.transform import quantize_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BUILTIN = REPO / "py_engine" / "data" / "tiny-shakespeare"
PREFILL, STEPS = 12, 16

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@torch.no_grad()
def torch_greedy(model, config, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ids [1, PREFILL + STEPS] from a fixed prompt (or the `forced` ones), and the logits [1, T, V]."""
    ids = torch.tensor([[0] + list(range(100, 100 + PREFILL - 1))])
    kv = DenseKVCache.allocate(config, 1, PREFILL + STEPS, dtype=torch.float32)
    logits = [model(ids, torch.arange(PREFILL)[None], kv)]
    for t in range(PREFILL, PREFILL + STEPS):
        nxt = logits[-1][:, -1:].argmax(-1) if forced is None else forced[:, t:t + 1]
        ids = torch.cat([ids, nxt], dim=1)
        logits.append(model(ids[:, t:t + 1], torch.arange(t, t + 1)[None], kv))
    return ids, torch.cat(logits, dim=1)


def dequantized_copy(model):
    """The model with each QuantLinear replaced by an nn.Linear holding its dequantized weight: QuantLinear's
    own reference (dequantize-then-matmul). Its CPU decode kernel rounds x to int8 per 32 values (Q8_0-style,
    what MatMulNBits' accuracy_level 4 does), so exact parity is checked against this reference."""
    copy = copy_module(model)
    for name, m in list(copy.named_modules()):
        if isinstance(m, QuantLinear):
            linear = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            linear.weight.data = m.dequantize().float()
            if m.bias is not None:
                linear.bias.data = m.bias.data.float()
            parent, _, leaf = name.rpartition(".")
            setattr(copy.get_submodule(parent) if parent else copy, leaf, linear)
    return copy


def check_export(model, config, model_dir: Path, out: Path, options: ExportOptions, pass_model: bool):
    result = export_model(model_dir, out, options, model=model if pass_model else None)
    ids, want = torch_greedy(dequantized_copy(model), config)
    got = onnx_decode_logits(session(result.model_path), config, ids[:, :-1], PREFILL)
    diff = np.abs(got - want[:, :-1].numpy()).max()
    kernel_ids, _ = torch_greedy(model, config)
    _, kernel_logits = torch_greedy(model, config, forced=ids)
    kernel_diff = np.abs(got - kernel_logits[:, :-1].numpy()).max()
    print(f"\n{options.quantization} {options.target}: max |logit diff| onnxruntime vs torch reference {diff:.1e}, "
          f"vs torch's int8-activation decode kernels {kernel_diff:.1e} (their greedy ids "
          f"{'equal' if torch.equal(kernel_ids, ids) else 'differ'})")
    assert diff < 1e-4
    assert np.array_equal(got[0, PREFILL - 1:].argmax(-1), ids[0, PREFILL:].numpy())  # same greedy tokens
    return result


class ByteTokenizer:
    """Calibration ids for the 256-token tiny model: the text's bytes."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def awq_model(tmp_path_factory):
    """A tiny random Llama (biases included) quantized by AWQ's search, 4-bit groups of 32."""
    folder = tmp_path_factory.mktemp("tiny")
    save_hf_model(FAMILIES["llama3-rope"], folder)
    (folder / "calibration.txt").write_text((BUILTIN / "calibration.txt").read_text(encoding="utf-8")[:20000])
    model, config = load_model(folder)
    qconfig = QuantConfig.from_options("awq", group_size=32, calibration_samples=8, calibration_seq_len=64)
    quantize_model(model, qconfig, model_dir=folder, tokenizer=ByteTokenizer(), progress=False)
    return folder, model, config, qconfig


def test_awq_model_exports_its_own_weights(awq_model, tmp_path):
    folder, model, config, qconfig = awq_model
    options = ExportOptions(precision="int4", accuracy_level=0, quantization="awq")
    check_export(model, config, folder, tmp_path, options, pass_model=True)


@pytest.mark.parametrize("target", ["native", "web"])
def test_awq_checkpoint_exports_its_own_weights(awq_model, tmp_path, target):
    folder, model, config, qconfig = awq_model
    checkpoint = save_quantized(model, config, qconfig, tmp_path / "ckpt", folder)
    assert json.loads((checkpoint / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    loaded, config = load_model(checkpoint)
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == 2 * 7
    options = ExportOptions(precision="int4", accuracy_level=0, target=target, quantization="awq checkpoint")
    check_export(loaded, config, checkpoint, tmp_path / "onnx", options, pass_model=False)


def test_in_memory_quantized_model_exports_its_head_as_int8(tmp_path):
    """GPTQ-style symmetric 4-bit groups in memory, the LM head int8 per channel (K 192 re-cut into blocks)."""
    model, config, _ = load_quantized(BUILTIN, QuantConfig.from_options("int4", group_size=32, symmetric=True),
                                      dtype="float32")
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8
    options = ExportOptions(precision="int4", accuracy_level=0, quantization="int4")
    result = check_export(model, config, BUILTIN, tmp_path, options, pass_model=True)
    import onnx
    graph = onnx.load(str(result.model_path), load_external_data=False).graph
    bits = sorted({a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"})
    assert bits == [4, 8]


@pytest.mark.parametrize("argv, message", [
    (["--quantization", "gptq", "--bits", "3"], "3-bit; the ONNX export packs 4- and 8-bit"),
    (["--quantization", "smoothquant"], "smoothquant quantizes activations too"),
    (["--quantization", "int4", "--precision", "int8"], "--precision int8 contradicts the 4-bit int4 weights"),
    (["--quantization", "awq", "--block-size", "64"], "--block-size and --symmetric/--asymmetric set RTN"),
])
def test_export_quantization_conflicts_fail_before_loading(tmp_path, capsys, argv, message):
    assert main(["export", "tiny-shakespeare", "--out", str(tmp_path / "x"), *argv]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_prequantized_checkpoint_cannot_be_quantized_again(awq_model, tmp_path, capsys):
    folder, model, config, qconfig = awq_model
    checkpoint = save_quantized(model, config, qconfig, tmp_path / "ckpt", folder)
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "x"), "--quantization", "int4"]) == 1
    assert "is already quantized (awq 4-bit" in capsys.readouterr().err


def test_options_refuse_float_precision_for_quantized_weights():
    with pytest.raises(ExportError, match="exports as int4 or int8, not fp16"):
        ExportOptions(precision="fp16", quantization="awq")
