"""The decoder: embeddings, a stack of blocks, a final norm and the LM head.

One implementation for the Llama family (Llama, Mistral, Mixtral, Qwen2,
Qwen3, Phi-3, Gemma, Gemma 2), configured by `ModelConfig`. The forward is

    logits = model(input_ids [B, T], positions [B, T], kv=None) -> [B, T, V]

where `kv` is a KV cache (see kv_cache.py) or None to attend within the call.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from .attention import NoCache
from .kv_cache import KVCache
from .layers import MLP, Attention, RMSNorm, SparseMoE
from .rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    Gemma 2 also normalises each sublayer's output ("sandwich" norms); its
    names follow transformers: post_attention_layernorm is then the norm after
    attention, and pre_feedforward_layernorm the one before the MLP.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps, gemma = config.rms_norm_eps, config.is_gemma
        self.self_attn = Attention(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        self.moe = bool(config.num_local_experts)
        if self.moe:  # Mixtral's name for the feed-forward
            self.block_sparse_moe = SparseMoE(config)
        else:
            self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, kv: KVCache) -> Tensor:
        ffn = self.block_sparse_moe if self.moe else self.mlp
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, positions, kv))
            return x + self.post_feedforward_layernorm(ffn(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, kv)
        return x + ffn(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Token embeddings -> blocks -> final norm: hidden states [B, T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embedding_multiplier = config.embedding_multiplier
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.is_gemma)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: Tensor, positions: Tensor, kv: KVCache | None = None) -> Tensor:
        x = self.embed_tokens(input_ids)  # [B, T, hidden]
        if self.embedding_multiplier != 1.0:  # Gemma: sqrt(hidden), rounded to the activation dtype
            x = x * torch.tensor(self.embedding_multiplier, dtype=x.dtype)
        cos, sin = self.rotary_emb(positions, x.dtype)  # [B, T, rotary_dim]
        kv = NoCache() if kv is None else kv
        for layer in self.layers:
            x = layer(x, cos, sin, positions, kv)
        return self.norm(x)


class CausalLM(nn.Module):
    """The decoder plus the LM head (tied to the embeddings when the config says so)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head; call again after replacing it. A head that is
        not a Linear (a quantized one, py_engine.quant) keeps its own weight."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, kv: KVCache | None = None,
                last_only: bool = False, logit_indices: Tensor | None = None) -> Tensor:
        """Logits [B, T, V] in float32; [B, 1, V] for the last position with last_only.

        logit_indices [N] picks the positions to compute logits for ([B, N, V]):
        the server runs many sequences as one flattened row and needs only the
        last scheduled token of each.
        """
        hidden = self.model(input_ids, positions, kv)  # [B, T, hidden]
        if last_only:  # generation needs one row: skip the [T, V] matmul for the prompt
            hidden = hidden[:, -1:]  # [B, 1, hidden]
        elif logit_indices is not None:
            hidden = hidden[:, logit_indices]  # [B, N, hidden]
        logits = self.lm_head(hidden)  # [B, T, V]
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
