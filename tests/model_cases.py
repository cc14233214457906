"""Tiny model configs and transformers references for the model parity tests.

Each case is a config.json dict scaled down to hidden 64, 2-4 layers, a
256-token vocabulary and an 8-token sliding window, so 33-token prompts run
past the window (and past Phi-3's original_max_position_embeddings of 16).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from py_engine.models import CausalLM, DenseKVCache, longrope_switch_length

VOCAB = 256
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.1,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama3-rope": {**TINY, "model_type": "llama", "attention_bias": True, "mlp_bias": True,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "llama-dynamic": {**TINY, "model_type": "llama", "max_position_embeddings": 16,
                      "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "llama-yarn": {**TINY, "model_type": "llama", "num_key_value_heads": 1,
                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    "mistral": {**TINY, "model_type": "mistral", "sliding_window": 8, "num_hidden_layers": 3},
    "qwen2": {**TINY, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
              "max_window_layers": 1, "num_hidden_layers": 3},
    "qwen3": {**TINY, "model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True},
    "phi3-longrope": {**TINY, "model_type": "phi3", "num_key_value_heads": 4, "partial_rotary_factor": 0.5,
                      "max_position_embeddings": 64, "original_max_position_embeddings": 16, "sliding_window": 12,
                      "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.5],
                                       "long_factor": [1.0, 2.0, 4.0, 8.0]}},
    "gemma": {**TINY, "model_type": "gemma", "head_dim": 16, "num_key_value_heads": 1},
    "gemma2": {**TINY, "model_type": "gemma2", "head_dim": 16, "num_hidden_layers": 4, "sliding_window": 8,
               "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    "mixtral": {**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 8},
}

# Real configs under ../shared/fixtures/configs that ruvllm supports.
SHARED_CONFIGS = ("gemma-2-2b-it", "llama-3.2-1b", "llama-3.2-3b-instruct", "mistral-7b-instruct-v0.3",
                  "mixtral-8x7b-instruct-v0.1", "phi-3-mini-4k-instruct", "qwen2.5-0.5b-instruct", "qwen3-0.6b",
                  "qwen3-8b", "smollm-360m-instruct", "smollm2-135m", "smollm2-360m", "tinyllama-1.1b-chat-v1.0")


def scale_down(real: dict[str, Any]) -> dict[str, Any]:
    """A real config.json with its sizes replaced by tiny ones, everything else kept."""
    cfg = {k: v for k, v in real.items() if k not in ("auto_map", "_name_or_path", "quantization_config")}
    grouped = real.get("num_key_value_heads", real["num_attention_heads"]) < real["num_attention_heads"]
    cfg.update(TINY, num_key_value_heads=2 if grouped else 4)
    if real.get("head_dim") is not None or real["model_type"] in ("gemma", "gemma2"):
        cfg["head_dim"] = 16
    if real.get("sliding_window") is not None:
        cfg["sliding_window"] = 8
    if real.get("max_window_layers") is not None:
        cfg["max_window_layers"] = 1
    if real.get("layer_types") is not None:
        cfg["layer_types"] = real["layer_types"][:TINY["num_hidden_layers"]]
    if real.get("num_local_experts"):
        cfg["num_local_experts"] = 4
    return cfg


def save_hf_model(cfg: dict[str, Any], folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                  **save_kwargs: Any):
    """A seeded random transformers model for cfg, saved to folder; returns it (eval, eager attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = copy.deepcopy(cfg)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # transformers starts norms at 1 (or 0 for Gemma) and biases at 0: perturb them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(dtype).eval()
    model.save_pretrained(folder, **save_kwargs)
    return model


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed + length))


def positions(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop)[None]


def decode_logits(model: CausalLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Prefill `prefill` tokens into a dense cache, then feed the rest one by one: [1, T, V]."""
    kv = DenseKVCache.allocate(model.config, 1, ids.shape[1], dtype=model.lm_head.weight.dtype)
    out = [model(ids[:, :prefill], positions(0, prefill), kv)]
    for t in range(prefill, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], positions(t, t + 1), kv))
    return torch.cat(out, dim=1)


def hf_decode_logits(hf_model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """The same with transformers' own cache."""
    out = hf_model(ids[:, :prefill], use_cache=True)
    past, logits = out.past_key_values, [out.logits]
    for t in range(prefill, ids.shape[1]):
        out = hf_model(ids[:, t:t + 1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, dim=1).float()


def greedy(model: CausalLM, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding with a dense cache, re-prefilling once where LongRoPE
    switches to its long factors, as transformers' generate() does for Phi-3."""
    config, ids = model.config, list(ids)
    switch = longrope_switch_length(config)
    kv = DenseKVCache.allocate(config, 1, len(ids) + new_tokens, dtype=model.lm_head.weight.dtype)
    logits = model(torch.tensor([ids]), positions(0, len(ids)), kv, last_only=True)
    for step in range(new_tokens):
        ids.append(int(logits[0, -1].argmax()))
        if step == new_tokens - 1:
            break
        n = len(ids)
        if switch is not None and n == switch + 1:  # the cache holds short-factor keys: recompute it
            kv = DenseKVCache.allocate(config, 1, len(ids) + new_tokens, dtype=model.lm_head.weight.dtype)
            logits = model(torch.tensor([ids]), positions(0, n), kv, last_only=True)
        else:
            logits = model(torch.tensor([ids[-1:]]), positions(n - 1, n), kv, last_only=True)
    return ids


def write_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
