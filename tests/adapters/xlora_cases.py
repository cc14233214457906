"""peft X-LoRA models on the tiny random models of tests/model_cases.py, saved as peft saves them.

Three LoRA experts with different targets and ranks (so the LoRA layer count and
the experts' coverage differ, as in real X-LoRA models), then peft's XLoraModel
over them with its classifier's last layer scaled up: peft initialises it small,
which gives near-uniform scalings that could hide a wrong expert order.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.adapters.lora_cases import save_peft_adapter, target_sets

EXPERTS = 3


def save_experts(hf_model, folder: Path, model_type: str, seed: int = 0) -> list[Path]:
    """Three peft LoRA experts of hf_model: attention (r 4), feed-forward (r 2, rslora), both (r 8).
    (Not the LM head: peft's XLoraModel fails to load an expert that adapts it.)"""
    sets = target_sets(model_type)
    configs = [dict(r=4, lora_alpha=8, target_modules=sets["attention"]),
               dict(r=2, lora_alpha=4, use_rslora=True, target_modules=sets["mlp"]),
               dict(r=8, lora_alpha=8, target_modules=sets["attention"] + sets["mlp"])]
    paths = []
    for i, config in enumerate(configs):
        path = folder / f"expert{i}"
        save_peft_adapter(hf_model, path, seed=seed + 10 * i, **config)
        paths.append(path)
    return paths


def xlora_model(base_folder: Path, experts: list[Path], seed: int = 0, **config: Any):
    """peft's XLoraModel (eval) over the experts on a fresh copy of the base model."""
    from peft import XLoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32, attn_implementation="eager")
    hf.config.use_cache = False
    torch.manual_seed(seed)
    xc = XLoraConfig(task_type="CAUSAL_LM", hidden_size=hf.config.hidden_size, xlora_dropout_p=0.0,
                     adapters={str(i): str(p) for i, p in enumerate(experts)}, **config)
    model = get_peft_model(hf, xc).eval()
    with torch.no_grad():
        last = model.base_model.internal_xlora_classifier.layers[-1]
        last.weight.mul_(5.0)
        last.bias.normal_(0.0, 1.0)
    return model


def peft_step(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [1, T, V], scalings [1, T, L, E]) of one peft forward, no cache."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return logits, model.get_latest_scalings()
