"""The onnxruntime backend of the shared generation loop: an exported decoder, one sequence.

    model = OnnxModel("exports/tiny", precision="fp32")
    backend = model.backend(max_context=512)
    logits = backend.prefill([1, 2, 3])    # numpy [V] float32
    logits = backend.decode(42)

This is the only module of py_engine that imports onnxruntime (and it needs
numpy, not torch). The graph follows export.contract: it is fed input_ids,
attention_mask, position_ids and the past cache, and returns logits and the
present cache. With IO binding the present tensors stay onnxruntime values
(on the GPU under the CUDA provider) and are bound back as the next call's
past, so the cache is never copied into numpy between steps.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from py_engine.config import ConfigError, ModelConfig, longrope_recomputes, longrope_switch_length

FORMAT_VERSION = 1  # the newest export.contract.FORMAT_VERSION this reader understands
FILES = {"fp32": "model.onnx", "fp16": "model_fp16.onnx", "int8": "model_quantized.onnx", "int4": "model_q4.onnx",
         "int2": "model_q2.onnx"}
AUTO_ORDER = ("fp32", "int4", "int8", "fp16", "int2")


CONTRACT_FILE = "ruvllm_contract.json"


def contract_entry(export_dir: Path, precision: str) -> tuple[Path, dict[str, str]] | None:
    """The graph the export's contract names for onnxruntime at `precision` ("auto": its default), with the
    session options its entry asks for; None without a contract or such a graph. A web-only export (what
    `ruvllm web build` serves: onnx/model_q4_web.onnx) is found this way."""
    import json

    try:
        contract = json.loads((export_dir / CONTRACT_FILE).read_text(encoding="utf-8"))
        name = contract["runtimes"]["onnxruntime"]["default" if precision == "auto" else precision]
        options = contract["files"][name].get("session_options", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    path = export_dir / name
    if not (path.parent == export_dir / "onnx" and path.is_file() and isinstance(options, dict)):
        return None
    return path, {str(k): str(v) for k, v in options.items()}


def find_onnx_file(export_dir: Path, precision: str = "auto") -> Path:
    """The graph for `precision` in export_dir/onnx ("auto": fp32, else the first present), else the one
    the export's contract names (a web-only export)."""
    onnx_dir = export_dir / "onnx"
    if precision != "auto":
        if precision not in FILES:
            raise ValueError(f"unknown ONNX precision {precision!r}; use auto, {', '.join(FILES)}")
        path = onnx_dir / FILES[precision]
        if not path.exists() and (entry := contract_entry(export_dir, precision)) is not None:
            return entry[0]
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; export it with "
                                    f"`ruvllm export MODEL --out {export_dir} --precision {precision}`")
        return path
    for p in AUTO_ORDER:
        if (onnx_dir / FILES[p]).exists():
            return onnx_dir / FILES[p]
    if (entry := contract_entry(export_dir, "auto")) is not None:
        return entry[0]
    raise FileNotFoundError(f"{export_dir} holds no exported graph (expected onnx/{FILES['fp32']} or a "
                            "quantized one); create it with `ruvllm export`")


def providers(device: str = "auto") -> list[str]:
    """CUDA when asked for or (auto) available, CPU always last."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in available:
            raise ValueError("device 'cuda' was asked for but onnxruntime has no CUDAExecutionProvider here")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "auto" and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device not in ("auto", "cpu"):
        raise ValueError(f"the onnx backend runs on cpu or cuda, not {device!r}")
    return ["CPUExecutionProvider"]


class OnnxModel:
    """An onnxruntime session over an export folder, and its config."""

    def __init__(self, export_dir: str | Path, precision: str = "auto", device: str = "auto",
                 threads: int | None = None) -> None:
        import onnxruntime as ort

        self.export_dir = Path(export_dir)
        self.config = ModelConfig.from_file(self.export_dir)
        self.path = find_onnx_file(self.export_dir, precision)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        entry = contract_entry(self.export_dir, precision)
        if entry is not None and entry[0] == self.path:  # e.g. a web graph's session.disable_quant_qdq
            for key, value in entry[1].items():
                options.add_session_config_entry(key, value)
        self.session = ort.InferenceSession(str(self.path), options, providers=providers(device))
        self._check_format()
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        past = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.past_names = [i.name for i in past]
        self.kv_dtype = np.float16 if past and past[0].type == "tensor(float16)" else np.float32

    def _check_format(self) -> None:
        meta = self.session.get_modelmeta().custom_metadata_map
        version = meta.get("ruvllm.format_version")
        if version is not None and int(version) > FORMAT_VERSION:
            raise ConfigError(f"{self.path} has export format {version}; this ruvllm reads up to "
                              f"{FORMAT_VERSION}: upgrade ruvllm or re-export")

    def backend(self, max_context: int) -> "OnnxBackend":
        return OnnxBackend(self, max_context)


class OnnxBackend:
    """One sequence: prefill, then decode a token at a time, the cache kept in onnxruntime values."""

    def __init__(self, model: OnnxModel, max_context: int) -> None:
        self.model, self.max_context = model, max_context
        self.length = 0
        self.past: dict[str, object] = {}
        self.tokens: list[int] = []
        # LongRoPE switches to its long factors past this length; like transformers and TorchBackend
        # we then recompute the whole cache with them.
        self.switch_length = longrope_switch_length(model.config)

    def _empty_past(self) -> dict[str, object]:
        c = self.model.config
        empty = np.zeros((1, c.num_key_value_heads, 0, c.head_dim), self.model.kv_dtype)
        return {name: empty for name in self.model.past_names}

    def _forward(self, token_ids: Sequence[int]) -> np.ndarray:
        m = self.model
        n = len(token_ids)
        total = self.length + n
        binding = m.session.io_binding()
        binding.bind_cpu_input("input_ids", np.asarray([token_ids], dtype=np.int64))  # [1, n]
        if "attention_mask" in m.input_names:
            binding.bind_cpu_input("attention_mask", np.ones((1, total), dtype=np.int64))  # [1, total]
        if "position_ids" in m.input_names:
            binding.bind_cpu_input("position_ids", np.arange(self.length, total, dtype=np.int64)[None])
        for name, value in self.past.items():
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, value)
        for name in m.output_names:
            binding.bind_output(name, m.device)
        m.session.run_with_iobinding(binding)
        outputs = dict(zip(m.output_names, binding.get_outputs()))
        self.past = {name: outputs[name.replace("past_key_values.", "present.")] for name in m.past_names}
        self.length = total
        return outputs["logits"].numpy()[0, -1]  # [V]

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        self.length, self.past, self.tokens = 0, self._empty_past(), list(token_ids)
        return self._forward(token_ids)

    def decode(self, token_id: int) -> np.ndarray:
        self.tokens.append(token_id)
        if longrope_recomputes(self.switch_length, len(self.tokens)):
            return self.prefill(self.tokens)
        return self._forward([token_id])

    @staticmethod
    def argmax(logits: np.ndarray) -> int:
        return int(np.argmax(logits))  # the first index of the max, like the reference sampler
