"""ruvllm exports in the JavaScript runtimes: onnxruntime-node and onnxruntime-web's wasm backend, in Node.

Each graph a runtime is told to load (ruvllm_contract.json's `runtimes`) runs
through tests/web/js/ort_decode.mjs (prefill, then greedy decode with the KV cache
fed back) and must give the same 16 greedy tokens as onnxruntime in CPython and,
for fp32, the torch engine, with every logit within 1e-4 (fp32) of CPython's.

The runtimes come from `npm ci --prefix tests/web/js` (the Makefile runs it); without
it, this test installs the same locked packages into .cache/npm-test once, and
skips (saying why) when node or npm is missing or the install fails offline.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from export.exporter import export_model  # noqa: E402
from export.options import ExportOptions  # noqa: E402
from py_engine.backends.torch import TorchBackend  # noqa: E402
from py_engine.models import load_model  # noqa: E402
from tests.export.export_helpers import onnx_decode_logits, session  # noqa: E402
from tests.paths import BUILTIN, REPO  # noqa: E402
from tests.requires import tool  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

JS = REPO / "tests" / "web" / "js"
CACHE = REPO / ".cache" / "npm-test"
PACKAGES = ("onnxruntime-node", "onnxruntime-web")
PROMPT = [5, 17, 99, 3, 250, 42, 7, 11]
GREEDY = 16
TOL = {"fp32": 1e-4, "int4": 1e-4, "int8": 1e-4}
# onnxruntime-web's wasm MatMulNBits multiplies float activations whatever the accuracy level, where CPython's
# quantizes them to int8 per block (level 4): logits of this random model (up to ~6) differ by the rounding
WEB_QUANT_TOL = 1.0


def _installed(modules: Path) -> bool:
    return all((modules / p / "package.json").exists() for p in PACKAGES)


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """tests/web/js/node_modules, else .cache/npm-test/node_modules (installed once from the lock file)."""
    tool("node")
    for modules in (JS / "node_modules", CACHE / "node_modules"):
        if _installed(modules):
            return modules
    tool("npm")
    CACHE.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(JS / name, CACHE / name)
    # the postinstall of onnxruntime-node only fetches GPU providers; the CPU binaries ship in the package
    env = dict(os.environ, ONNXRUNTIME_NODE_INSTALL="skip")
    proc = subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=CACHE, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode or not _installed(CACHE / "node_modules"):
        pytest.skip(f"npm ci into {CACHE} failed (offline?): {proc.stderr.strip()[-300:]}; "
                    "run `npm ci --prefix tests/web/js` once online (make test does)")
    return CACHE / "node_modules"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Qwen2 exported as fp32 (native and plain graphs) and int4 / int8 (native and web graphs)."""
    folder = tmp_path_factory.mktemp("js")
    hf = build_tiny_model(folder / "hf", "qwen2")
    for precision, target, name in (("fp32", "plain", "plain"), ("fp32", "native", "out"),
                                    ("int4", "native", "out"), ("int4", "web", "out"), ("int8", "native", "out"),
                                    ("int8", "web", "out")):
        export_model(hf, folder / name, ExportOptions(precision=precision, target=target))
    return hf, folder


def run_js(modules: Path, runtime: str, model: Path, tmp_path: Path) -> tuple[dict, np.ndarray]:
    logits = tmp_path / f"{runtime}.bin"
    proc = subprocess.run(["node", str(JS / "ort_decode.mjs"), "--runtime", runtime, "--model", str(model),
                           "--threads", "1", "--prompt", ",".join(map(str, PROMPT)), "--steps", str(GREEDY - 1),
                           "--logits", str(logits), "--modules", str(modules)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"], result.get("error")
    return result, np.fromfile(logits, np.float32)


def cpython_logits(model: Path, config, tokens: list[int]) -> np.ndarray:
    """onnxruntime in CPython over the same feed: the prompt, then the greedy tokens one by one."""
    ids = torch.tensor([PROMPT + tokens[:-1]])
    return onnx_decode_logits(session(model), config, ids, len(PROMPT))[0]


def torch_greedy(hf: Path) -> list[int]:
    model, config = load_model(hf, dtype="float32")
    backend = TorchBackend(model, config, max_context=64)
    logits, out = backend.prefill(PROMPT), []
    while len(out) < GREEDY:
        out.append(backend.argmax(logits))
        if len(out) < GREEDY:
            logits = backend.decode(out[-1])
    return out


CASES = [("onnxruntime-node", "node", "fp32", "out"), ("onnxruntime-web", "web", "fp32", "out"),
         ("onnxruntime-web", "web", "fp32", "plain"), ("onnxruntime-node", "node", "int4", "out"),
         ("onnxruntime-web", "web", "int4", "out"), ("onnxruntime-node", "node", "int8", "out"),
         ("onnxruntime-web", "web", "int8", "out")]


@pytest.mark.parametrize("manifest_runtime, runtime, precision, folder", CASES,
                         ids=[f"{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_js_runtime_matches_cpython(node_modules, exported, tmp_path, manifest_runtime, runtime, precision, folder):
    hf, root = exported
    contract = json.loads((root / folder / "ruvllm_contract.json").read_text())
    model = root / folder / contract["runtimes"][manifest_runtime][precision]
    _, config = load_model(hf, dtype="float32")
    result, logits = run_js(node_modules, runtime, model, tmp_path)
    tokens = result["tokens"]
    assert len(tokens) == GREEDY
    ref = cpython_logits(model, config, tokens)
    assert logits.shape == (ref.size,)
    diff = float(np.abs(logits.reshape(ref.shape) - ref).max())
    print(f"\n{runtime} {precision} {model.name}: max abs diff vs CPython {diff:.1e}")
    exact = runtime == "node" or precision == "fp32"
    assert diff < (TOL[precision] if exact else WEB_QUANT_TOL)
    steps = ref[len(PROMPT) - 1:]
    if exact:
        assert list(steps.argmax(-1)) == tokens
    else:  # the same greedy choice wherever CPython's top two are further apart than the difference
        top2 = np.sort(steps, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * diff
        assert all(int(r.argmax()) == t for r, t, c in zip(steps, tokens, clear) if c) and clear.any()
    if precision == "fp32":
        assert tokens == torch_greedy(hf)


@pytest.mark.skipif(not (BUILTIN / "config.json").exists(), reason="the built-in tiny-shakespeare model is not trained yet")
@pytest.mark.parametrize("runtime", ["node", "web"])
def test_builtin_model_greedy_in_js(node_modules, tmp_path_factory, tmp_path, runtime):
    """The trained built-in model: 16 greedy tokens in Node equal torch's, logits within 1e-4 of CPython."""
    out = tmp_path_factory.getbasetemp() / "builtin_js"
    if not (out / "onnx" / "model.onnx").exists():
        export_model(BUILTIN, out, ExportOptions(precision="fp32"))
    model = out / "onnx" / "model.onnx"
    _, config = load_model(BUILTIN, dtype="float32")
    result, logits = run_js(node_modules, runtime, model, tmp_path)
    ref = cpython_logits(model, config, result["tokens"])
    assert float(np.abs(logits.reshape(ref.shape) - ref).max()) < 1e-4
    assert result["tokens"] == torch_greedy(BUILTIN)


def test_manifest_points_each_runtime_at_its_variant(exported):
    _, root = exported
    contract = json.loads((root / "out" / "ruvllm_contract.json").read_text())
    runtimes, files = contract["runtimes"], contract["files"]
    assert runtimes["onnxruntime-web"]["int4"] == runtimes["onnxruntime-web"]["default"] == "onnx/model_q4_web.onnx"
    assert runtimes["onnxruntime-web"]["int8"] == "onnx/model_quantized_web.onnx"
    for runtime in ("onnxruntime", "onnxruntime-node", "onnxruntime-genai"):
        assert runtimes[runtime]["int4"] == "onnx/model_q4.onnx"
    assert {f: e["target"] for f, e in files.items()} == {
        "onnx/model.onnx": "native", "onnx/model_q4.onnx": "native", "onnx/model_q4_web.onnx": "web",
        "onnx/model_quantized.onnx": "native", "onnx/model_quantized_web.onnx": "web"}
    assert files["onnx/model_q4_web.onnx"]["session_options"] == files["onnx/model_q4.onnx"]["session_options"] == {}
    assert files["onnx/model_q4_web.onnx"]["engine"]["layers"][0]["qkv"]["bits"] == 4  # the page's kernels run it
    assert "engine" not in files["onnx/model_q4.onnx"]
    genai = json.loads((root / "out" / "genai_config.json").read_text())
    assert genai["model"]["decoder"]["filename"] == "onnx/model_quantized.onnx"  # never a web graph


def test_web_graphs_too_big_for_wasm_fall_back_to_native():
    """onnxruntime-web gets the web graph while its weights (held as they are) fit the wasm heap."""
    from export.manifest import FOLDED_LIMIT, runtime_files

    def files(folded: int) -> dict:
        return {"onnx/model_q4.onnx": {"precision": "int4", "target": "native", "folded_bytes": None},
                "onnx/model_q4_web.onnx": {"precision": "int4", "target": "web", "folded_bytes": folded}}

    limit = FOLDED_LIMIT["onnxruntime-web"]
    assert runtime_files(files(limit))["onnxruntime-web"]["int4"] == "onnx/model_q4_web.onnx"
    big = runtime_files(files(limit + 1))
    assert big["onnxruntime-web"] == {"default": "onnx/model_q4.onnx", "int4": "onnx/model_q4.onnx"}
    assert big["onnxruntime-node"]["int4"] == "onnx/model_q4.onnx"
