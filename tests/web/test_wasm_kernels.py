"""The page's own wasm kernels (web/kernels, npm/src/wasm_backend.js) against onnxruntime on the same web export.

The kernels run a web export's codes with int8 activations per block of 32, as onnxruntime's MatMulNBits
accuracy_level 4 does on the graph of the same folder: logits are equal to ~1e-6 in most steps, and where an
activation block rounds differently (onnxruntime's x64 kernels quantize in their own order) they stay within the
int8 rounding (~0.1 on these random models with logits up to ~6, as large as onnxruntime's own level 4 vs level
0 difference); greedy tokens are equal wherever onnxruntime's top two are further apart than that. For random
Qwen2 and Llama models, 4 and 8 bits, symmetric blocks and asymmetric ones
(whose minimums the graph and the kernels centre alike), on one thread and on two (the pool's chunks). Run in
Node (the same V8 as Chromium; the page's own run is tests/web/test_web_page.py and test_webgpu.py). Also: the
committed .wasm files are what the sources build to, an export the kernels cannot run says why in its contract,
and a sequence past the model's positions is refused. The kernels read float16 scales in place, widening them
with SIMD128 integer ops: every finite half widens to numpy's float32 value, and a tensor holding an infinity or
NaN is found (the loader widens it at load instead). The verify pass of speculative decoding (several tokens
in one pass, and a rollback) gives each row exactly decode's bits.
"""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from tests.paths import REPO  # noqa: E402
from tests.requires import tool  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

DRIVER = REPO / "tests" / "web" / "js" / "wasm_decode.mjs"
PROMPT = [5, 17, 99, 3, 250, 42, 7, 11]
STEPS = 12
TOL = 0.3  # logits up to ~6; see _check: the same int8 activations as onnxruntime, bit for bit in most rows
CASES = [("qwen2", "int4", True, 1), ("qwen2", "int8", False, 2), ("llama", "int4", False, 2),
         ("llama", "int8", True, 1)]


def _graph(precision: str) -> str:
    return "onnx/model_q4_web.onnx" if precision == "int4" else "onnx/model_quantized_web.onnx"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from export.exporter import export_model
    from export.options import ExportOptions

    root = tmp_path_factory.mktemp("wasm")
    out = {}
    for family, precision, symmetric, _ in CASES:
        folder = root / f"{family}-{precision}-{symmetric}"
        hf = root / family
        if not (hf / "config.json").exists():
            build_tiny_model(hf, family)
        export_model(hf, folder, ExportOptions(precision=precision, target="web", symmetric=symmetric))
        out[(family, precision, symmetric)] = folder
    return out


def _wasm(folder, graph: str, threads: int, ids: list[int], steps: int) -> dict:
    node = tool("node")
    done = subprocess.run([node, str(DRIVER), str(REPO / "npm" / "src"), str(folder), graph, str(threads),
                           json.dumps(ids), str(steps)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _onnxruntime(folder, graph: str, ids: list[int], tokens: list[int]) -> list[np.ndarray]:
    """Logits after the prompt and after each of `tokens`, from onnxruntime on the folder's web graph."""
    from py_engine.backends.onnx import OnnxModel

    backend = OnnxModel(folder, precision="int4" if "q4" in graph else "int8").backend(128)
    rows = [np.asarray(backend.prefill(ids))]
    rows += [np.asarray(backend.decode(t)) for t in tokens]
    return rows


@pytest.mark.parametrize("family, precision, symmetric, threads", CASES)
def test_kernels_equal_onnxruntime(exports, family, precision, symmetric, threads):
    folder = exports[(family, precision, symmetric)]
    got = _wasm(folder, _graph(precision), threads, PROMPT, STEPS)
    want = _onnxruntime(folder, _graph(precision), PROMPT, got["tokens"])
    diffs = [float(np.abs(np.asarray(a) - b).max()) for a, b in zip(got["logits"], want)]
    assert max(diffs) < TOL, diffs
    for row, token, diff in zip(want, got["tokens"], diffs):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > 2 * diff:
            assert token == int(np.argmax(row)), (diffs, got["tokens"])
    if precision == "int4":  # the same arithmetic: some steps agree to float rounding (onnxruntime's x64 8-bit
        assert min(diffs) < 1e-4, diffs  # kernel multiplies another way: u8 x s8 pairs that can saturate)
    assert f"{threads} threads" in got["runtime"]
    # Speculative decoding's verify pass (several rows, after a rollback) gives each row decode's bits.
    assert got["verify_mismatches"] == 0, got["verify_mismatches"]


def test_contract_says_why_the_kernels_cannot_run_a_model(tmp_path):
    """A Gemma 2 (soft-capping, sliding windows) gets no engine entry: the page runs it in onnxruntime-web."""
    from export.exporter import export_model
    from export.options import ExportOptions

    hf = build_tiny_model(tmp_path / "gemma2", "gemma2", head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    export_model(hf, tmp_path / "out", ExportOptions(precision="int4", target="web"))
    entry = json.loads((tmp_path / "out" / "ruvllm_contract.json").read_text())["files"]["onnx/model_q4_web.onnx"]
    assert entry["engine"] == {"unsupported": "model type gemma2"}


def test_past_the_model_positions_is_refused(exports):
    folder = exports[("qwen2", "int4", True)]
    node = tool("node")
    ids = list(range(5, 5 + 129))  # max_position_embeddings is 128
    done = subprocess.run([node, str(DRIVER), str(REPO / "npm" / "src"), str(folder), _graph("int4"), "1",
                           json.dumps(ids), "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "the model takes 128" in done.stderr


def test_float16_scales_widen_as_numpy_does():
    import base64

    done = subprocess.run([tool("node"), str(REPO / "tests" / "web" / "js" / "wasm_halves.mjs"), str(REPO / "npm" / "src")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    bits = np.arange(65536, dtype=np.uint16)
    finite = bits[(bits & 0x7C00) != 0x7C00]
    finite = np.concatenate([finite, finite[:3]])
    want = finite.view(np.float16).astype(np.float32)
    widened = np.frombuffer(base64.b64decode(got["widened"]), dtype=np.float32)
    # bit for bit, signed zeros and subnormal halves included
    assert np.array_equal(widened.view(np.uint32), want.view(np.uint32))
    assert got["finite"] == [1] + [0] * 8


def test_committed_kernels_are_built_from_the_sources():
    pytest.importorskip("ziglang", reason="pip install ziglang==0.17.0 (make test does)")
    from web.kernels.build import stale

    assert stale() == [], "run python -m web.kernels.build and commit npm/src/kernels/"
