"""ONNX export of already-quantized models: MatMulNBits over the model's own codes, scales and zero points.

A tiny Llama quantized by AWQ (in memory, and written as an AWQ gemm checkpoint then loaded: the
int8 LM head stays float there), the same Llama quantized by GPTQ at 2 bits (MatMulNBits bits=2, or
2-bit DequantizeLinear on the web target), the built-in model with symmetric int4 groups and its int8
per-channel head, and the built-in model written as a 2-bit GPTQ checkpoint by `ruvllm quantize` are
exported; onnxruntime (fp32, accuracy_level 0) must give the logits of the torch model's
dequantize-then-matmul reference over a prefill and decode steps (1e-4) and the same greedy tokens.
3-bit weights have no export (onnxruntime's kernel refuses them). The plain --precision path is covered,
byte for byte, and the 2-bit packing against the spec, by test_export_quant.py.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from copy import deepcopy as copy_module
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from tests.export.export_helpers import onnx_decode_logits, session  # noqa: E402
from tests.model_cases import FAMILIES, save_hf_model  # noqa: E402
from tests.paths import BUILTIN, REPO  # noqa: E402

from export.exporter import export_model  # noqa: E402
from export.options import ExportError, ExportOptions  # noqa: E402
from ruvllm_cli.main import main  # noqa: E402
from py_engine.models import DenseKVCache, load_model  # noqa: E402
from py_engine.quant.config import QuantConfig  # noqa: E402
from py_engine.quant.hf_format import save_quantized  # noqa: E402
from py_engine.quant.linear import QuantLinear  # noqa: E402
from py_engine.quant.load import load_quantized  # noqa: E402
from py_engine.quant.transform import quantize_model  # noqa: E402

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
    check_logits(model, config, [result.model_path], f"{options.quantization} {options.precision} {options.target}")
    return result


def check_logits(model, config, paths: list[Path], label: str) -> None:
    """Each exported graph in onnxruntime vs the model's dequantize-then-matmul reference (1e-4), same greedy ids."""
    ids, want = torch_greedy(dequantized_copy(model), config)
    kernel_ids, _ = torch_greedy(model, config)
    _, kernel_logits = torch_greedy(model, config, forced=ids)
    for path in paths:
        got = onnx_decode_logits(session(path), config, ids[:, :-1], PREFILL)
        diff = np.abs(got - want[:, :-1].numpy()).max()
        kernel_diff = np.abs(got - kernel_logits[:, :-1].numpy()).max()
        print(f"\n{label} {path.name}: max |logit diff| onnxruntime vs torch reference {diff:.1e} (logits up to "
              f"{np.abs(got).max():.1f}), vs torch's int8-activation decode kernels {kernel_diff:.1e} (their greedy "
              f"ids {'equal' if torch.equal(kernel_ids, ids) else 'differ'})")
        assert diff < 1e-4
        assert np.array_equal(got[0, PREFILL - 1:].argmax(-1), ids[0, PREFILL:].numpy())  # same greedy tokens


class ByteTokenizer:
    """Calibration ids for the 256-token tiny model: the text's bytes."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (biases included) with a calibration text."""
    folder = tmp_path_factory.mktemp("tiny")
    save_hf_model(FAMILIES["llama3-rope"], folder)
    (folder / "calibration.txt").write_text((BUILTIN / "calibration.txt").read_text(encoding="utf-8")[:20000])
    return folder


def quantized_tiny(folder: Path, qconfig: QuantConfig):
    model, config = load_model(folder)
    quantize_model(model, qconfig, model_dir=folder, tokenizer=ByteTokenizer(), progress=False)
    return model, config


@pytest.fixture(scope="module")
def awq_model(tiny_dir):
    """The tiny Llama quantized by AWQ's search, 4-bit groups of 32."""
    qconfig = QuantConfig.from_options("awq", group_size=32, calibration_samples=8, calibration_seq_len=64)
    model, config = quantized_tiny(tiny_dir, qconfig)
    return tiny_dir, model, config, qconfig


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


def graph_of(path: Path):
    import onnx
    return onnx.load(str(path), load_external_data=False)


def matmul_nbits_bits(model) -> list[int]:
    return sorted(a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits")


@pytest.mark.parametrize("group, symmetric, target", [
    (32, True, "native"), (32, False, "native"), (128, False, "native"), (32, False, "web"), (128, True, "web")])
def test_2bit_gptq_model_exports_its_own_weights(tiny_dir, tmp_path, group, symmetric, target):
    """GPTQ 2-bit groups (q/k/v and gate/up fused, zero points packed four a byte when asymmetric), the LM head
    int8 per channel: MatMulNBits bits=2 on both targets (the web one over its data file, asymmetric groups as
    centred minimums: export.web_weights), opset 21."""
    qconfig = QuantConfig.from_options("gptq", bits=2, group_size=group, symmetric=symmetric, calibration_samples=8,
                                       calibration_seq_len=64)
    model, config = quantized_tiny(tiny_dir, qconfig)
    options = ExportOptions(precision="int2", accuracy_level=0, target=target, quantization="gptq")
    result = check_export(model, config, tiny_dir, tmp_path, options, pass_model=True)
    assert result.model_path.name == ("model_q2.onnx" if target == "native" else "model_q2_web.onnx")
    proto = graph_of(result.model_path)
    opset = {o.domain: o.version for o in proto.opset_import}[""]
    # per layer: qkv, o, gate_up, down; then the head
    assert matmul_nbits_bits(proto) == [2] * 4 * config.num_hidden_layers + [8] and opset == 21


def test_2bit_gptq_checkpoint_from_the_cli_exports(tmp_path):
    """`ruvllm quantize --method gptq --bits 2` then `ruvllm export` of the checkpoint: both targets, picked by
    the manifest (int2 is the only precision in the folder), against the loaded checkpoint's reference."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "onnx"
    assert main(["quantize", "tiny-shakespeare", "--method", "gptq", "--bits", "2", "--group-size", "32",
                 "--calibration-samples", "4", "--out", str(ckpt)]) == 0
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["bits"] == 2
    assert main(["export", str(ckpt), "--out", str(out), "--accuracy-level", "0"]) == 0
    runtimes = json.loads((out / "ruvllm_contract.json").read_text())["runtimes"]
    assert runtimes["onnxruntime"]["default"] == runtimes["onnxruntime"]["int2"] == "onnx/model_q2.onnx"
    assert runtimes["onnxruntime-web"]["default"] == "onnx/model_q2_web.onnx"
    assert matmul_nbits_bits(graph_of(out / "onnx" / "model_q2.onnx")) == [2] * 4 * 6 + [8]
    loaded, config = load_model(ckpt)
    check_logits(loaded, config, [out / "onnx" / "model_q2.onnx", out / "onnx" / "model_q2_web.onnx"],
                 "gptq 2-bit checkpoint")
    if shutil.which("node"):  # the npm runtime takes `precision: 'int2'` by name, from the same manifest
        repo = REPO
        for runtime, file in (("onnxruntime-node", "onnx/model_q2.onnx"), ("onnxruntime-web", "onnx/model_q2_web.onnx")):
            done = subprocess.run(["node", str(repo / "tests" / "web" / "js" / "pick_graph.mjs"), str(repo / "npm" / "src"),
                                   str(out), runtime, "auto", "int2", "int4"], capture_output=True, text=True,
                                  timeout=60)
            assert done.returncode == 0, done.stderr
            picked = json.loads(done.stdout.strip().splitlines()[-1])
            assert picked["auto"] == picked["int2"] == file, picked
            assert picked["int4"].startswith("ModelNotFoundError") and "no int4 graph" in picked["int4"], picked


def test_3bit_model_is_refused_naming_the_layer(tiny_dir, tmp_path):
    qconfig = QuantConfig.from_options("gptq", bits=3, group_size=32, calibration_samples=2, calibration_seq_len=64)
    model, _ = quantized_tiny(tiny_dir, qconfig)
    with pytest.raises(ExportError, match=r"model\.layers\.0\.self_attn/qkv_proj is 3-bit; the ONNX export "
                                          r"packs 2-, 4- and 8-bit weights for MatMulNBits"):
        export_model(tiny_dir, tmp_path, ExportOptions(precision="int4", quantization="gptq"), model=model)


@pytest.mark.parametrize("argv, message", [
    (["--quantization", "gptq", "--bits", "3"], "gptq is 3-bit; the ONNX export packs 2-, 4- and 8-bit weights"),
    (["--precision", "int2"], "int2 exports a model already quantized to 2 bits"),
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
    with pytest.raises(ExportError, match="exports as int2, int4 or int8, not fp16"):
        ExportOptions(precision="fp16", quantization="awq")
