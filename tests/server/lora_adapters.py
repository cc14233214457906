"""Four peft LoRA adapters on the built-in model, for the server's multi-LoRA tests and the benchmark.

Distinct seeds, ranks and targets (attention only, MLP only, everything with the
head, rslora), each moving the logits enough to change greedy tokens.
"""
from __future__ import annotations

import json
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


def hostile_adapters(lora_dir: Path, good: str, outside: Path) -> dict[str, tuple[str, str]]:
    """Adapter folders under lora_dir made from lora_dir/good that must each be refused, by name:
    name -> (folder, words the 400 must hold). `outside` is a folder beyond lora_dir they link to."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    source = lora_dir / good
    shutil.copytree(source, outside / good, dirs_exist_ok=True)
    cases = {}

    def copy(name: str) -> Path:
        folder = lora_dir / name
        shutil.copytree(source, folder)
        return folder

    linked = copy("linked-config")  # a valid config, but beyond --lora-dir
    (linked / "adapter_config.json").unlink()
    (linked / "adapter_config.json").symlink_to(outside / good / "adapter_config.json")
    cases["linked-config"] = ("linked-config", "links outside")
    passwd = copy("linked-passwd")  # once opened and parsed
    (passwd / "adapter_config.json").unlink()
    (passwd / "adapter_config.json").symlink_to("/etc/passwd")
    cases["linked-passwd"] = ("linked-passwd", "links outside")
    weights = copy("linked-weights")
    (weights / "adapter_model.safetensors").unlink()
    (weights / "adapter_model.safetensors").symlink_to(outside / good / "adapter_model.safetensors")
    cases["linked-weights"] = ("linked-weights", "links outside")
    nan = copy("nan-weights")  # once loaded with 200, then every answer "" with finish_reason "stop"
    tensors = load_file(nan / "adapter_model.safetensors")
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key] = torch.full_like(tensors[key], float("nan"))
    save_file(tensors, nan / "adapter_model.safetensors")
    module = key.removeprefix("base_model.model.").removesuffix(".lora_B.weight")
    cases["nan-weights"] = ("nan-weights", f"non-finite weights (NaN or inf) in {module}")
    ghost = copy("ghost-target")  # once accepted silently
    config = json.loads((ghost / "adapter_config.json").read_text())
    (ghost / "adapter_config.json").write_text(json.dumps({**config, "target_modules": [
        *config["target_modules"], "nonexistent_proj"]}))
    cases["ghost-target"] = ("ghost-target", "'nonexistent_proj' name no module")
    return cases
