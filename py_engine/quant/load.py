"""Load a model and quantize it in situ: the one path `generate`, `chat`, `serve`, `benchmark`, `eval`,
`export`, `LLM(..., quantization=...)` and the server's engine share.

    model, config, report = load_quantized("tiny-shakespeare-dir", "int4", device="cpu")

Quantization runs after `load_model` (float weights in the requested dtype) and before any device
transform (`optimize_for_cpu`), through `py_engine.quant.transform.quantize_model`. A checkpoint that
is already quantized (GPTQ/AWQ `quantization_config`) loads as it is; asking to quantize it again is
an error rather than a silent second rounding.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torch import nn

from .config import QuantConfig, QuantConfigError
from .linear import QuantLinear


def as_quant_config(quantization: str | QuantConfig | None, **options: Any) -> QuantConfig:
    """A QuantConfig from a method name (with from_options' keyword options) or a QuantConfig as it is."""
    if isinstance(quantization, QuantConfig):
        if options:
            return quantization.with_(**options)
        quantization.validate()
        return quantization
    if quantization is not None and not isinstance(quantization, str):
        raise QuantConfigError(f"quantization must be a method name or a QuantConfig, not {type(quantization).__name__}")
    return QuantConfig.from_options(quantization, **options)


def quantized_layers(model: nn.Module) -> int:
    """How many layers hold quantized weights (QuantLinear, or any module carrying a `qweight`)."""
    return sum(1 for m in model.modules() if isinstance(m, QuantLinear) or hasattr(m, "qweight"))


def load_quantized(path: str | Path, quantization: str | QuantConfig | None = None, *, dtype: str = "auto",
                   device: Any = "cpu", progress: bool | None = None,
                   lora: str | Path | None = None) -> tuple[Any, Any, Any]:
    """(model, config, QuantReport or None): load_model, then quantize_model when a method is asked for.

    lora: a peft LoRA adapter folder merged into the float weights first (py_engine.adapters.merge), so a
    quantized result holds the adapted weights (`ruvllm export --lora`)."""
    from py_engine.models import load_model

    qconfig = as_quant_config(quantization)
    # a GGUF's Q4_0/Q4_1/Q8_0 weights load as codes, or dequantized when they are to be quantized anew (or merged)
    model, config = load_model(path, dtype=dtype, device=device, dequantize=qconfig.enabled or lora is not None,
                               huge_pages=not qconfig.enabled)  # float weights decode streams as they are
    if lora is not None:
        from py_engine.adapters import load_lora, merge_lora

        merge_lora(model, load_lora(lora))
    if not qconfig.enabled:
        return model, config, None
    if quantized_layers(model):
        from .hf_format import read_quantization
        q = read_quantization(path)
        what = f"{q.method} {q.default.bits}-bit" if q is not None else "quantized"
        raise QuantConfigError(f"{path} is already quantized ({what}, from its config.json); load it without "
                               f"--quantization {qconfig.method}")
    from .transform import quantize_model  # noqa: PLC0415 (torch-heavy, only when asked)

    tokenizer = None
    if qconfig.needs_calibration:
        from py_engine.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_pretrained(path)
    report = quantize_model(model, qconfig, model_dir=path, tokenizer=tokenizer,
                            progress=sys.stderr.isatty() if progress is None else progress)
    return model, config, report
