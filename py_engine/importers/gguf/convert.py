"""`ruvllm import-gguf`: a GGUF file as a Hugging Face folder with float weights.

    import_gguf("model.gguf", "out/")  # config.json, generation_config.json, tokenizer files, model.safetensors

Every tensor is dequantized with gguf's reference and q/k un-permuted (checkpoint.py), so
transformers, ruvllm and every tool reading safetensors load the folder; to run the
file's Q4_0 / Q4_1 / Q8_0 codes as they are, pass the .gguf itself as a MODEL.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from py_engine.config import ModelConfig
from py_engine.models.skeleton import skeleton
from py_engine.models.transformer import CausalLM

from .checkpoint import GGUFCheckpoint
from .folder import write_metadata
from .reader import open_gguf


def import_gguf(path: str | Path, out_dir: str | Path, dtype: str = "auto", progress: bool = False) -> Path:
    """Write a Hugging Face folder with float weights (`dtype` auto: the config's, float32 unless all BF16)."""
    gguf = open_gguf(path)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    config = write_metadata(gguf, out)
    with skeleton():
        model = CausalLM(ModelConfig.from_dict(config))
    checkpoint = GGUFCheckpoint(gguf, config, model, dequantize=True)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        config["torch_dtype"] if dtype == "auto" else dtype]
    if dtype != "auto":
        config["torch_dtype"] = dtype
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    names = list(dict(model.named_parameters()))
    tensors = {}
    for i, name in enumerate(names):
        tensors[name] = checkpoint.get(name).to(torch_dtype).contiguous()
        if progress:
            print(f"\rconverting tensors: {i + 1}/{len(names)}", end="\n" if i + 1 == len(names) else "",
                  flush=True)
    unused = sorted(n for n in checkpoint.where if n not in checkpoint.names)
    if unused:
        raise ValueError(f"{gguf.path}: tensors the {config['model_type']} model has no place for: "
                         f"{', '.join(unused[:5])}")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf.path.name})
    return out
