"""Ring 1: the torch decoder for the Llama family, its KV caches and loader.

    model, config = load_model("path/to/hf-model", dtype="auto", device="cpu")
    kv = DenseKVCache.allocate(config, batch=1, max_len=256, dtype=torch.float32)
    logits = model(input_ids, positions, kv, last_only=True)  # [B, 1, V]
"""
from .attention import AttentionSpec, NoCache, attention
from .kv_cache import DenseKVCache, KVCache
from .loader import ModelLoadError, load_model
from .rope import RotaryEmbedding, inv_frequencies, longrope_switch_length
from .transformer import CausalLM

__all__ = [
    "AttentionSpec", "CausalLM", "DenseKVCache", "KVCache", "ModelLoadError", "NoCache", "RotaryEmbedding",
    "attention", "inv_frequencies", "load_model", "longrope_switch_length",
]
