"""`ruvllm export` and `ruvllm generate --backend onnx` end to end, plus the contract an export records."""
from __future__ import annotations

import contextlib
import hashlib
import json

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from ruvllm_cli.main import main  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    model = build_tiny_model(folder / "hf", "qwen2")
    assert main(["export", str(model), "--out", str(folder / "out")]) == 0
    assert main(["export", str(model), "--out", str(folder / "out"), "--precision", "int4"]) == 0
    return model, folder / "out"


def test_layout_metadata_and_contract(exported):
    model, out = exported
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "ruvllm_contract.json", "onnx/model.onnx", "onnx/model_q4.onnx"):
        assert (out / name).exists(), name
    graph = onnx.load(str(out / "onnx" / "model.onnx"), load_external_data=False)
    meta = {p.key: p.value for p in graph.metadata_props}
    assert meta["ruvllm.format_version"] == "1"
    assert meta["ruvllm.config_sha256"] == hashlib.sha256((model / "config.json").read_bytes()).hexdigest()
    contract = json.loads((out / "ruvllm_contract.json").read_text())
    runtimes, files = contract.pop("runtimes"), contract.pop("files")
    assert json.loads(meta["ruvllm.contract"]) == contract
    assert files["onnx/model_q4.onnx"]["target"] == "native" and files["onnx/model_q4_web.onnx"]["target"] == "web"
    assert runtimes["onnxruntime-web"]["int4"] == runtimes["onnxruntime-web"]["default"] == "onnx/model_q4_web.onnx"
    assert runtimes["onnxruntime"]["int4"] == runtimes["onnxruntime-node"]["int4"] == "onnx/model_q4.onnx"
    assert runtimes["onnxruntime"]["fp32"] == "onnx/model.onnx"
    inputs = {i.name: i for i in graph.graph.input}
    assert [i["name"] for i in contract["inputs"]] == [i.name for i in graph.graph.input]
    assert [o["name"] for o in contract["outputs"]] == [o.name for o in graph.graph.output]
    dims = inputs["past_key_values.1.value"].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch_size", 2, "past_sequence_length", 16]
    assert contract["inputs"][:3] == [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch_size", "sequence_length"]},
        {"name": "attention_mask", "dtype": "int64", "shape": ["batch_size", "total_sequence_length"]},
        {"name": "position_ids", "dtype": "int64", "shape": ["batch_size", "sequence_length"]}]


def _generate(capsys, *args):
    assert main(["generate", "To be", "--max-tokens", "24", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_onnx_matches_torch(exported, capsys):
    model, out = exported
    torch_out = _generate(capsys, "--model", str(model))
    onnx_out = _generate(capsys, "--model", str(out), "--backend", "onnx")
    assert onnx_out == torch_out
    q4 = _generate(capsys, "--model", str(out), "--backend", "onnx", "--precision", "int4")
    assert len(q4["token_ids"]) == len(torch_out["token_ids"]) or q4["finish_reason"] == "stop"


def test_llm_api_onnx_backend(exported):
    from py_engine import SamplingParams
    from py_engine.backends.torch import LLM

    model, out = exported
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16)
    torch_text = LLM(str(model)).generate("Whether", params).token_ids
    assert LLM(str(out), backend="onnx").generate("Whether", params).token_ids == torch_text


@pytest.mark.parametrize("args, message", [
    (["--precision", "int3"], "invalid choice"),
    (["--block-size", "48"], "invalid choice"),
    (["--target", "plain", "--precision", "int4"], "plain target supports fp32 and fp16"),
])
def test_bad_options_are_refused(exported, tmp_path, capsys, args, message):
    model, _ = exported
    with pytest.raises(SystemExit) if "invalid" in message else contextlib.nullcontext():
        code = main(["export", str(model), "--out", str(tmp_path / "x"), *args])
        assert code == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_unsupported_architecture_is_refused(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    assert main(["export", str(tmp_path / "m"), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "unsupported model_type 'gpt2'" in err
    assert not (tmp_path / "x").exists()


def test_missing_graph_is_explained(exported, capsys):
    _, out = exported
    assert main(["generate", "x", "--model", str(out), "--backend", "onnx", "--precision", "int8"]) == 1
    assert "ruvllm export" in capsys.readouterr().err


def test_onnx_backend_loads_a_web_only_export(exported, tmp_path):
    """A folder with only web graphs (what `ruvllm web build` serves) runs in CPython too: the graph its
    contract names for onnxruntime, its weights in the data file beside it (the codes the page's kernels read)."""
    from py_engine.backends.onnx import OnnxModel

    model, _ = exported
    out = tmp_path / "web"
    assert main(["export", str(model), "--out", str(out), "--precision", "int4", "--target", "web"]) == 0
    assert not (out / "onnx" / "model_q4.onnx").exists()
    for precision in ("auto", "int4"):
        loaded = OnnxModel(out, precision=precision)
        assert loaded.path == out / "onnx" / "model_q4_web.onnx"
        assert (out / "onnx" / "model_q4_web.onnx_data").stat().st_size > (out / "onnx" / "model_q4_web.onnx").stat().st_size
    assert len(loaded.backend(64).prefill([1, 2, 3])) == loaded.config.vocab_size
    with pytest.raises(FileNotFoundError, match="--precision int8"):
        OnnxModel(out, precision="int8")
