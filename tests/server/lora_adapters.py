"""Four peft LoRA adapters on the built-in model, for the server's multi-LoRA tests and the benchmark.

Distinct seeds, ranks and targets (attention only, MLP only, everything with the
head, rslora), each moving the logits enough to change greedy tokens.
"""
from __future__ import annotations

from pathlib import Path

from tests.paths import BUILTIN

ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(r=16, lora_alpha=16, use_rslora=True,
                target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "lm_head"]),
    "qv": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
}


def build_adapters(folder: Path, b_scale: float = 0.5, base: Path = BUILTIN) -> dict[str, Path]:
    """Save the four adapters, on the Hugging Face folder `base`, under folder/NAME; returns name -> folder."""
    import torch
    import transformers

    from tests.adapters.lora_cases import save_peft_adapter

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    out = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        out[name] = folder / name
        peft_model = save_peft_adapter(hf, out[name], seed=seed + 10, b_scale=b_scale, **config)
        del peft_model
    return out
