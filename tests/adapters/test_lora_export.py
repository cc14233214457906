"""`ruvllm export MODEL --lora PATH` merges the adapter before writing: the ONNX graph's logits equal the torch
model running the adapter unmerged (which equals peft: test_lora_peft.py), fp32 and int8 (merged, then quantized).
Gemma's tied LM head, adapted, gets its own matrix in the graph."""
from __future__ import annotations

import numpy as np
import pytest

from tests.adapters.lora_cases import save_peft_adapter, target_sets
from tests.model_cases import FAMILIES, decode_logits, prompt, save_hf_model

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")
from tests.export.export_helpers import onnx_decode_logits, session  # noqa: E402
from py_engine.adapters import LoraManager  # noqa: E402
from py_engine.models import load_model  # noqa: E402
from ruvllm_cli.main import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.mark.parametrize("family", ["llama3-rope", "gemma"])
def test_export_with_lora_equals_torch_with_the_adapter(family, tmp_path):
    hf = save_hf_model(FAMILIES[family], tmp_path / "hf")
    targets = target_sets(FAMILIES[family]["model_type"])["all"]  # lm_head too: tied in Gemma
    save_peft_adapter(hf, tmp_path / "adapter", seed=4, r=8, lora_alpha=16, target_modules=targets)
    model, config = load_model(tmp_path / "hf")
    manager = LoraManager(model)
    manager.add("x", tmp_path / "adapter")
    ids = prompt(20)
    with torch.no_grad(), manager.using("x"):
        expected = decode_logits(model, ids, 8).numpy()
    with torch.no_grad():
        base = decode_logits(model, ids, 8).numpy()
    for precision, tol in (("fp32", 1e-4), ("int8", 0.1)):
        out = tmp_path / precision
        args = ["--quantization", "int8"] if precision == "int8" else []
        assert main(["export", str(tmp_path / "hf"), "--out", str(out), "--lora", str(tmp_path / "adapter"),
                     "--target", "native", *args]) == 0
        got = onnx_decode_logits(session(out / "onnx" / ("model.onnx" if precision == "fp32" else
                                                          "model_quantized.onnx")), config, ids, 8)
        diff = float(np.abs(got - expected).max())
        assert diff < tol, f"{family} {precision}: {diff:.3g}"
        assert np.abs(got - base).mean() > 4 * np.abs(got - expected).mean(), "the graph runs the adapter, not the base"
