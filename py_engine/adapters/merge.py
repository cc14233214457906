"""Merged LoRA: W' = W + scaling * B A, in a loaded model or written out as a new model folder.

    merge_lora(model, load_lora("adapter/"))                     # in place, float weights only
    write_merged("base-model/", "adapter/", "merged/")           # `ruvllm merge-lora MODEL ADAPTER --out DIR`

The sum is computed in float32 and rounded once to the weight's dtype, as
peft's merge_and_unload does for float weights. A merged LM head that was
tied to the embedding gets its own copy (and the written config says
tie_word_embeddings: false), since the embedding itself is not adapted.
Quantized layers are refused: merge into the float model, then quantize.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from ..models.transformer import CausalLM
from .checkpoint import LoraAdapter, load_lora
from .config import DEFAULT_MAX_RANK, AdapterError
from .layer import LoraLinear
from .manager import LoraManager


def merge_lora(model: CausalLM, adapter: LoraAdapter) -> list[str]:
    """Add each module's delta to its weight in place; return the module names merged."""
    if getattr(model, "lora", None) is not None:
        raise AdapterError("merge into a model without loaded adapters (this one has model.lora)")
    probe = LoraManager(model, max_rank=max(adapter.max_rank, 1))  # reuses add()'s checks and placement
    try:
        places = [(probe._place(adapter, name), m) for name, m in adapter.modules.items()]
    finally:
        object.__setattr__(model, "lora", None)
    tied = model.config.tie_word_embeddings
    for (parent, attr, segment), m in places:
        module = parent._modules[attr]
        linear = module.parts[segment] if hasattr(module, "parts") else module
        if isinstance(module, LoraLinear) or not isinstance(getattr(linear, "weight", None), torch.Tensor) \
                or not linear.weight.is_floating_point():
            raise AdapterError(f"{adapter.path}: cannot merge into {attr} ({type(linear).__name__}): merge into "
                               "the float model, then quantize")
        if attr == "lm_head" and tied:  # the embedding stays; the head becomes its own matrix
            linear.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
        w = linear.weight
        delta = (m.B.to(w.device) @ m.A.to(w.device)) * m.scaling  # [out, in], float32
        w.data.copy_((w.float() + delta).to(w.dtype))
    if any(parent is model and attr == "lm_head" for (parent, attr, _), _ in places) and tied:
        object.__setattr__(model, "merged_untied_head", True)
    return list(adapter.modules)


def write_merged(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path,
                 dtype: str = "auto", max_rank: int = DEFAULT_MAX_RANK) -> Path:
    """A Hugging Face folder holding the base model with the adapter merged in."""
    from safetensors.torch import save_file

    from ..models.loader import load_model
    from ..quant.hf_format import COPIED_FILES

    source, out = Path(model_dir), Path(out_dir)
    if out.exists() and (not out.is_dir() or out.resolve() == source.resolve()):
        raise ValueError(f"--out {out} must be a new or existing folder other than the model's")
    adapter = load_lora(adapter_dir, max_rank)
    model, _ = load_model(source, dtype=dtype, dequantize=True)
    merge_lora(model, adapter)
    raw = json.loads((source / "config.json").read_text(encoding="utf-8"))
    raw.pop("quantization_config", None)
    if getattr(model, "merged_untied_head", False):
        raw["tie_word_embeddings"] = False
    state = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    raw["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"):
        (out / stale).unlink(missing_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "lora": str(adapter_dir)})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out

