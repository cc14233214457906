"""peft LoRA adapters on the tiny random models of tests/model_cases.py, saved as peft saves them.

Adapters start from peft's init_lora_weights=False (A and B both random, so
the delta is not zero) with B scaled by 0.1, which moves the logits by about
one unit: enough to change the greedy tokens, not so much that the logits leave
the range where float32 parity with transformers is ~1e-6.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
PHI3_ATTENTION = ["qkv_proj", "o_proj"]  # Phi-3 stores q/k/v and gate/up fused
PHI3_MLP = ["gate_up_proj", "down_proj"]
RANKS = (1, 2, 4, 8, 16, 32, 64)


def target_sets(model_type: str) -> dict[str, list[str]]:
    """The target sets a family's adapters are tested with: attention, feed-forward, everything + the head."""
    if model_type == "phi3":
        attn, mlp = PHI3_ATTENTION, PHI3_MLP
    elif model_type == "mixtral":  # transformers 5 keeps the experts as 3-D parameters, which peft adapts with
        attn, mlp = ATTENTION, ["q_proj", "v_proj"]  # target_parameters (refused: test_lora_errors); a subset instead
    else:
        attn, mlp = ATTENTION, MLP
    return {"attention": attn, "mlp": mlp, "all": attn + mlp + ["lm_head"]}


def save_peft_adapter(hf_model, folder: Path, seed: int = 0, b_scale: float = 0.1, **config: Any):
    """A peft LoRA adapter on a copy of hf_model, saved to folder; returns the PeftModel (eval)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(init_lora_weights=False, **config)).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    peft_model.save_pretrained(folder)
    return peft_model
