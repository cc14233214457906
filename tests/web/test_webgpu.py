"""The WebGPU path in headless Chromium: onnxruntime-web's WebGPU execution provider on a web export.

Chromium's SwiftShader adapter (a software GPU: `--enable-unsafe-webgpu` on a 127.0.0.1 page) runs the same
graph as CPython (MatMulNBits and GroupQueryAttention, the KV cache kept on the GPU between steps). The demo
page, asked for `?device=webgpu`, must say it runs there, and its greedy tokens must be onnxruntime-in-CPython's
on the same folder, or part from them only at a near-tie (CPython's top two within NEAR_TIE, the page taking
the runner-up; margins printed): WebGPU multiplies float activations where CPython's level-4 MatMulNBits rounds
them to int8. The same page asked for `device=wasm` runs the package's own kernels. Tiny random models only:
SwiftShader takes ~30 s a token on SmolLM2 (benchmarks/web_bench.py --webgpu N runs that).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")
pytest.importorskip("playwright")

from tests.paths import REPO  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402
from tests.web.web_harness import CHROMIUM, browser, static_server  # noqa: E402

PROMPT = "To be, or not"
GREEDY = 8
NEAR_TIE = 0.3  # these random models' logits reach ~6
MODELS = {"qwen2-int4": ("qwen2", "int4", True), "llama-int8": ("llama", "int8", False)}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is missing: apt-get install -y chromium (make test does, as root)")
    if not (REPO / "npm" / "node_modules" / "onnxruntime-web").is_dir():
        pytest.skip("npm/node_modules lacks onnxruntime-web: run `npm ci --prefix npm` (make test does)")
    from export.exporter import export_model
    from export.options import ExportOptions
    from web.build import build_dist

    root = tmp_path_factory.mktemp("webgpu")
    exports = {}
    for name, (family, precision, symmetric) in MODELS.items():
        hf = build_tiny_model(root / family, family)
        exports[name] = root / name
        export_model(hf, exports[name], ExportOptions(precision=precision, target="web", symmetric=symmetric))
    dist = build_dist(root / "dist", exports, builtin=False)
    with static_server(dist) as base, browser(root / "profile", webgpu=True) as (context, _):
        yield base, context, exports


def _reference(export: Path, precision: str) -> tuple[list[int], list[float], list[int]]:
    """CPython's greedy tokens, its top-two margins and runner-ups along them."""
    from py_engine import LLM, SamplingParams
    from py_engine.backends.onnx import OnnxModel

    llm = LLM(str(export), backend="onnx", dtype=precision)
    tokens = llm.generate(PROMPT, SamplingParams.greedy(max_tokens=GREEDY, ignore_eos=True)).token_ids
    backend = OnnxModel(export, precision=precision).backend(64)
    row, margins, second = np.asarray(backend.prefill(llm.encode(PROMPT))), [], []
    for token in tokens:
        top = np.argsort(row)[-2:]
        margins.append(float(row[top[1]] - row[top[0]]))
        second.append(int(top[0]))
        row = np.asarray(backend.decode(token))
    return tokens, margins, second


def _greedy_in_page(context, base: str, name: str, precision: str, device: str) -> tuple[list[int], str, str]:
    page = context.new_page()
    page.goto(f"{base}?model=models/{name}/&precision={precision}&device={device}")
    page.wait_for_function("['ready', 'error'].includes(document.body.dataset.status)", timeout=300_000)
    assert page.evaluate("document.body.dataset.status") == "ready", page.inner_text("#error")
    got = page.evaluate("""async ([prompt, n]) => {
        const r = await window.ruvllmDemo.engine.completions.create(
          {prompt, max_tokens: n, temperature: 0, ignore_eos: true, return_token_ids: true});
        return r.choices[0].token_ids; }""", [PROMPT, GREEDY])
    shown, ran = page.inner_text("#device"), page.evaluate("document.body.dataset.device")
    page.close()
    return got, shown, ran


def _check(got: list[int], tokens: list[int], margins: list[float], second: list[int], where: str) -> None:
    i = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
    if i is not None:
        print(f"{where}: parts from CPython at step {i} (CPython's top two {margins[i]:.3f} apart)")
        assert margins[i] < NEAR_TIE and got[i] == second[i], (where, i, margins[i], got, tokens)
    assert len(got) == len(tokens)


@pytest.mark.parametrize("name", list(MODELS))
def test_webgpu_greedy_tokens_equal_cpython(site, name):
    base, context, exports = site
    precision = MODELS[name][1]
    tokens, margins, second = _reference(exports[name], precision)
    got, shown, ran = _greedy_in_page(context, base, name, precision, "webgpu")
    assert ran == "webgpu" and "WebGPU" in shown, shown
    _check(got, tokens, margins, second, f"{name} on WebGPU")
    wasm, shown, ran = _greedy_in_page(context, base, name, precision, "wasm")
    assert ran == "wasm" and shown.startswith("ruvllm-wasm"), shown
    _check(wasm, tokens, margins, second, f"{name} on the wasm kernels")
