"""Which graph file each runtime should load, written into `ruvllm_contract.json`.

An export folder can hold one graph per (precision, target): `ruvllm export`
writes the int4/int8 weights twice by default, as MatMulNBits kernels over
inline float32 scales (`onnx/model_q4.onnx`, the transformers.js name) and as
the web form (`onnx/model_q4_web.onnx` + `_data`: the same MatMulNBits over
codes, float16 scales where exact, every weight in one data file that the
page's own wasm kernels read too; export.web_weights, export.web_engine).
Measured (benchmarks/web_matmul_options.py): onnxruntime-web's wasm
MatMulNBits is ~5x slower than its float MatMul, and the page's kernels ~3x
faster than that float MatMul, so the browser runs the web file with its own
kernels where the `engine` entry allows, and in onnxruntime-web (WebGPU, or
wasm) otherwise; onnxruntime in CPython and Node takes either file.

The contract file gains two keys (the rest of it is export.contract's):

    "files":    {"onnx/model_q4_web.onnx": {"precision": "int4", "target": "web",
                  "kv_dtype": "float32", "session_options": {}, "bytes": ..., "engine": {...}}, ...}
    "runtimes": {"onnxruntime-web": {"default": "onnx/model_q4_web.onnx",
                  "int4": "onnx/model_q4_web.onnx", "fp32": "onnx/model.onnx"}, ...}

`files` lists every graph in the folder (merged across exports of the same
checkpoint) with the session config entries it needs and its size (graph and
data files); `runtimes` maps each runtime and precision to the file it should
load, and `default` to the precision it should pick when not told (the
smallest download that runs fastest there). Consumers read `runtimes`; the
preference tables below are the measured decision, kept as data.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from py_engine.config import ModelConfig

from .options import FILE_NAMES, ExportOptions

# Targets in order of preference per runtime (first present wins).
TARGET_PREFERENCE: dict[str, tuple[str, ...]] = {
    "onnxruntime-web": ("web", "native", "plain"),
    "onnxruntime-node": ("native", "web", "plain"),
    "onnxruntime": ("native", "web", "plain"),
    "onnxruntime-genai": ("native", "web", "plain"),
}
# Largest weights (bytes) a graph may have for the runtime to be pointed at it: wasm's heap is 4 GiB,
# and the page holds the codes once (plus float32 copies of the scales and the KV cache).
FOLDED_LIMIT: dict[str, int] = {"onnxruntime-web": 3 << 30}
# Precisions in order of preference when the caller does not name one. int2 comes last: only a model quantized
# to 2 bits exports it, and 2 bits cost far more than 4 (GPTQ: +3.2% perplexity on the built-in model, +1013% on
# stories260K; README's Quantization), so a folder that also holds another precision does not hand it out unasked.
PRECISION_PREFERENCE: dict[str, tuple[str, ...]] = {
    "onnxruntime-web": ("int4", "int8", "fp32", "fp16", "int2"),
    "onnxruntime-node": ("int4", "int8", "fp32", "fp16", "int2"),
    "onnxruntime": ("int4", "int8", "fp32", "fp16", "int2"),
    "onnxruntime-genai": ("int4", "int8", "fp32", "fp16", "int2"),
}


def session_options(options: ExportOptions) -> dict[str, str]:
    """Session config entries a file needs (none today; kept so a file can ask for some)."""
    return {}


def folded_bytes(config: ModelConfig, options: ExportOptions, size: int | None = None) -> int | None:
    """Bytes of weights a web graph's runtime holds: its files' size (the codes stay codes); None otherwise."""
    if not (options.quantized and options.target == "web"):
        return None
    return size


def file_entry(options: ExportOptions, config: ModelConfig, kv_dtype: str, config_sha256: str,
               size: int) -> dict[str, Any]:
    return {"precision": options.precision, "target": options.target, "kv_dtype": kv_dtype,
            "block_size": options.block_size if options.quantized else None,
            "symmetric": options.symmetric if options.quantized else None,
            "session_options": session_options(options), "folded_bytes": folded_bytes(config, options, size),
            "config_sha256": config_sha256, "bytes": size}


def merged_files(out_dir: Path, new: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The files already recorded in out_dir (same checkpoint, still on disk) plus `new`."""
    sha = next(iter(new.values()))["config_sha256"]
    old = read_manifest(out_dir).get("files", {})
    kept = {k: v for k, v in old.items() if v.get("config_sha256") == sha and (out_dir / k).exists()}
    return dict(sorted({**kept, **new}.items()))


def fits(runtime: str, entry: dict[str, Any]) -> bool:
    """Whether the runtime can hold the graph once its weights are folded (wasm: a 4 GiB heap)."""
    limit = FOLDED_LIMIT.get(runtime)
    return limit is None or (entry.get("folded_bytes") or 0) <= limit


def runtime_files(files: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Per runtime: precision -> the file to load, and `default` -> the precision's file to pick."""
    out: dict[str, dict[str, str]] = {}
    for runtime, targets in TARGET_PREFERENCE.items():
        choice: dict[str, str] = {}
        for precision in FILE_NAMES:
            candidates = [(targets.index(e["target"]), path) for path, e in files.items()
                          if e["precision"] == precision and e["target"] in targets and fits(runtime, e)]
            if candidates:
                choice[precision] = min(candidates)[1]
        default = next((p for p in PRECISION_PREFERENCE[runtime] if p in choice), None)
        out[runtime] = ({"default": choice[default]} if default else {}) | choice
    return out


def read_manifest(out_dir: Path) -> dict[str, Any]:
    from .contract import CONTRACT_FILE

    path = out_dir / CONTRACT_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
