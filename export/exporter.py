"""`export_model`: a Hugging Face model folder in, an ONNX export folder out.

    out/
      config.json  generation_config.json  tokenizer.json  tokenizer_config.json
      ruvllm_contract.json   the I/O contract (export.contract) for web/ and npm/, with the graphs
                             of the folder and which one each runtime loads (export.manifest)
      genai_config.json      onnxruntime-genai's description of its graph
      onnx/model.onnx | model_fp16.onnx | model_quantized.onnx (int8) | model_q4.onnx (int4) | model_q2.onnx (int2)
      onnx/model_quantized_web.onnx | model_q4_web.onnx | model_q2_web.onnx   the web target's int8 / int4 / int2
      onnx/<name>_data[_N]   external weights when the graph is large

Everything is checked (config supported, options valid, output writable)
before a weight is read.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx

from py_engine.config import ModelConfig
from py_engine.models import CausalLM
from py_engine.quant.config import QuantConfig
from py_engine.quant.load import load_quantized, quantized_layers

from . import contract as C
from . import manifest
from .compact import compact_names
from .decoder import build_decoder
from .genai_config import write_genai_config
from .graph import TensorStore
from .web_engine import engine_entry
from .options import ExportError, ExportOptions, check_supported
from .quantized import ggml_notes

COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")
log = logging.getLogger("ruvllm.export")
INLINE_LIMIT = 1 << 30  # graphs whose weights exceed 1 GiB keep them in external data files
WEB_ALIGN = 64  # tensor offsets in a web data file (SIMD loads; no 4 KiB pages, every byte is downloaded)


@dataclass(frozen=True)
class ExportResult:
    model_path: Path
    files: tuple[Path, ...]  # the .onnx file and its external data files
    seconds: float

    @property
    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def export_model(model_dir: str | Path, out_dir: str | Path, options: ExportOptions = ExportOptions(),
                 progress: Callable[[int, int], None] | None = None, quantization: QuantConfig | None = None,
                 model: CausalLM | None = None) -> ExportResult:
    """Export the model in model_dir to out_dir/onnx/<options.file_name>, plus the shared files.

    `quantization` quantizes the float model first (options.quantization names the method); a
    pre-quantized checkpoint exports its own weights. `model` skips loading (an already-quantized
    model of model_dir, so that several targets share one quantization run).
    """
    start = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = ModelConfig.from_file(model_dir)
    check_supported(config, options)
    onnx_dir = out_dir / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    if model is None:
        model, config, _ = load_quantized(model_dir, quantization, dtype="float32", device="cpu")
    if options.prequantized and not quantized_layers(model):
        raise ExportError(f"options ask for the model's quantized weights ({options.quantization}) but the "
                          "model has no quantized layers")
    path = onnx_dir / options.file_name
    bytes_per_weight = {"fp32": 4, "fp16": 2, "int8": 1.1, "int4": 0.6, "int2": 0.35}[options.precision]
    web = options.target == "web" and options.quantized
    external = web or config.num_parameters() * bytes_per_weight > INLINE_LIMIT
    _remove_stale(onnx_dir, options.file_name)
    if web:  # every weight in the data file, which the page's kernels read too (export.web_engine)
        store = TensorStore(onnx_dir, options.file_name, inline_bytes=0, align=WEB_ALIGN)
    else:
        store = TensorStore(onnx_dir, options.file_name) if external else TensorStore()
    metadata = _metadata(model_dir, config, options)
    notes = ggml_notes(model)  # a GGUF's block types: exact, or re-quantized with the error stated
    if notes:
        metadata["ruvllm.ggml_weights"] = json.dumps(notes)
        for note in notes:
            if "max_abs_error" in note:
                log.warning("%s: %d %s tensors %s: weights within %.3g of the file's (relative RMS %.2g%%)",
                            path.name, note["tensors"], note["type"], note["form"], note["max_abs_error"],
                            100 * note["relative_rms_error"])
    records: dict[str, dict] = {}
    try:
        proto = build_decoder(model, config, options, metadata, store, progress, records)
    finally:
        store.close()
    engine = engine_entry(proto.graph, records, config) if web else None
    if options.target == "web":  # what a page downloads: short intermediate names (export/compact.py)
        compact_names(proto.graph)
    onnx.save_model(proto, path)
    files = (path,) + tuple(onnx_dir / f for f in store.files)
    _copy_shared_files(model_dir, out_dir, config, options, sum(f.stat().st_size for f in files), engine)
    return ExportResult(path, files, time.perf_counter() - start)


def _metadata(model_dir: Path, config: ModelConfig, options: ExportOptions) -> dict[str, str]:
    io = C.IOContract.for_config(config, "float16" if options.precision == "fp16" else "float32")
    meta = {C.META_FORMAT: str(C.FORMAT_VERSION),
            C.META_CONFIG_HASH: C.config_hash((model_dir / "config.json").read_bytes()),
            C.META_PRECISION: options.precision, C.META_VARIANT: options.target,
            "ruvllm.block_size": str(options.block_size), "ruvllm.symmetric": str(options.symmetric).lower(),
            C.META_CONTRACT: C.contract_json(io).replace("\n", "")}
    if options.prequantized:  # blocks and zero points are each layer's own, as the quantizer left them
        meta.update({"ruvllm.block_size": "per-layer", "ruvllm.symmetric": "per-layer",
                     "ruvllm.quantization": options.quantization})
    return meta


def _remove_stale(onnx_dir: Path, file_name: str) -> None:
    """Old external data of the same graph would otherwise linger next to a smaller re-export."""
    for old in onnx_dir.glob(f"{file_name}_data*"):
        old.unlink()


def _copy_shared_files(model_dir: Path, out_dir: Path, config: ModelConfig, options: ExportOptions,
                       size: int, engine: dict | None = None) -> None:
    for name in COPIED_FILES:
        if (model_dir / name).exists():
            shutil.copyfile(model_dir / name, out_dir / name)
    kv_dtype = "float16" if options.precision == "fp16" else "float32"
    sha = C.config_hash((model_dir / "config.json").read_bytes())
    entry = manifest.file_entry(options, config, kv_dtype, sha, size)
    if engine is not None:
        entry["engine"] = engine
    files = manifest.merged_files(out_dir, {f"onnx/{options.file_name}": entry})
    runtimes = manifest.runtime_files(files)
    # The top-level inputs/outputs describe float32 caches whenever such a graph is here; an fp16
    # graph's entry in `files` says float16.
    any_fp32 = any(e["kv_dtype"] == "float32" for e in files.values())
    io = C.IOContract.for_config(config, "float32" if any_fp32 else "float16")
    text = json.dumps(io.to_dict() | {"files": files, "runtimes": runtimes}, indent=1)
    (out_dir / C.CONTRACT_FILE).write_text(text + "\n", encoding="utf-8")
    write_genai_config(out_dir, config, options, runtimes["onnxruntime-genai"][options.precision])


def read_metadata(path: str | Path) -> dict[str, str]:
    """An exported graph's metadata_props (e.g. ruvllm.ggml_weights), without loading its weights."""
    model = onnx.load(str(path), load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}
