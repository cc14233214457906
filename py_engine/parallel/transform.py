"""`apply_tensor_parallel`: one rank's shard of a loaded model, as a transform of the unchanged model code.

    model, config = load_model(path)              # every rank loads the whole model (mapped, not copied)
    optimize_for_cpu(model)                       # fused q/k/v and gate/up, the CPU kernels
    apply_tensor_parallel(model, group)           # keeps this rank's heads and channels; adds two all-reduces

Per decoder layer (gpt-fast's layout, layout.py): q/k/v keep the rows of
this rank's KV heads and their query heads, gate/up (each expert's w1/w3)
the rows of its MLP channels; o_proj and down_proj (w2) keep the matching
input columns, so each rank's attention and MLP output is a partial sum,
and a forward hook on the attention and MLP modules all-reduces it: two
collectives per layer. Attention modules get the local head counts, which
is all their forward reads, and the KV cache a rank allocates from
`local_config` holds its KV heads only. The embedding, norms and LM head
stay whole on every rank (replicated): a rank computes the hidden state in
full, and only rank 0 needs logits.

The CPU's one-call decode step (py_engine/cpu/stack.py) runs no hooks, so
it is turned off on a sharded model; the per-module kernels stay. LoRA
adapters are sharded to match when loaded (`shard_adapter`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..models.layers import MLP, Attention, SparseMoE
from ..models.transformer import CausalLM
from ..quant.linear import QuantLinear
from .layout import ShardLayout, TensorParallelError, lcm, shard_layout
from .shard import take_cols, take_rows


@dataclass(frozen=True)
class TensorParallelInfo:
    """What a sharded model records about itself (model.tensor_parallel)."""

    layout: ShardLayout
    full_config: ModelConfig
    local_config: ModelConfig  # the model's config with this rank's head counts: size KV caches from it

    def shard_adapter(self, adapter: Any) -> Any:
        """A LoRA adapter cut like the model (LoraManager.add calls this on a sharded model)."""
        return shard_adapter(adapter, self)


def apply_tensor_parallel(model: CausalLM, group: Any) -> TensorParallelInfo:
    """Shard model in place for group.rank of group.world (group: comm.TensorParallelGroup, or any object
    with rank, world and all_reduce(tensor)); TensorParallelError before anything changes if it cannot be."""
    if getattr(model, "tensor_parallel", None) is not None:
        raise TensorParallelError("this model is already sharded")
    if getattr(model, "lora", None) is not None:
        raise TensorParallelError("shard the model before loading LoRA adapters (they are sharded as they load)")
    config = model.config
    layout = model_layout(model, group.world, group.rank)
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _shard_attention(module, layout)
        elif isinstance(module, MLP):
            _shard_mlp(module, layout)
        elif isinstance(module, SparseMoE):
            for expert in module.experts:
                lo, hi = layout.intermediate
                expert.w1, expert.w3 = take_rows(expert.w1, [(lo, hi)]), take_rows(expert.w3, [(lo, hi)])
                expert.w2 = take_cols(expert.w2, lo, hi, keep_bias=layout.rank == 0)
        else:
            continue
        if layout.world > 1:
            module.register_forward_hook(_all_reduce_hook(group))
    model.model.stack_enabled = False  # the one-call CPU decode step would skip the hooks
    local = replace(config, num_attention_heads=layout.num_heads, num_key_value_heads=layout.num_kv_heads)
    info = TensorParallelInfo(layout, config, local)
    object.__setattr__(model, "tensor_parallel", info)  # not a submodule
    return info


def model_layout(model: CausalLM, world: int, rank: int) -> ShardLayout:
    """The layout of rank, with the splits aligned to the row-parallel layers' quantization groups."""
    config = model.config
    inner = config.intermediate_size
    downs = [m.down_proj for m in model.modules() if isinstance(m, MLP)]
    downs += [e.w2 for m in model.modules() if isinstance(m, SparseMoE) for e in m.experts]
    outs = [m.o_proj for m in model.modules() if isinstance(m, Attention)]
    return shard_layout(config.num_attention_heads, config.num_key_value_heads, config.head_dim, inner, world,
                        rank, channel_unit=_input_unit(downs), o_proj_unit=_input_unit(outs))


def _input_unit(modules: list[nn.Module]) -> int:
    """Inputs per quantization group along K (1 for float layers; 32 for per-channel codes: a sub-block)."""
    units = [1]
    for m in modules:
        for part in getattr(m, "parts", [m]):
            if isinstance(part, QuantLinear):
                q = part.packed if part.packed is not None else part._raw
                units.append(32 if q.scales.shape[1] == 1 else q.block_size)
    return lcm(*units)


def _shard_attention(attn: Attention, layout: ShardLayout) -> None:
    q_dim, kv_dim = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    (q0, q1), (k0, k1) = layout.q_rows(), layout.kv_rows()
    if attn.fused:
        attn.qkv_proj = take_rows(attn.qkv_proj, [(q0, q1), (q_dim + k0, q_dim + k1),
                                                  (q_dim + kv_dim + k0, q_dim + kv_dim + k1)])
    else:
        attn.q_proj = take_rows(attn.q_proj, [(q0, q1)])
        attn.k_proj = take_rows(attn.k_proj, [(k0, k1)])
        attn.v_proj = take_rows(attn.v_proj, [(k0, k1)])
    attn.o_proj = take_cols(attn.o_proj, q0, q1, keep_bias=layout.rank == 0)
    attn.n_heads, attn.n_kv_heads = layout.num_heads, layout.num_kv_heads


def _shard_mlp(mlp: MLP, layout: ShardLayout) -> None:
    lo, hi = layout.intermediate
    if mlp.fused:
        inner = _gate_up_rows(mlp.gate_up_proj) // 2
        mlp.gate_up_proj = take_rows(mlp.gate_up_proj, [(lo, hi), (inner + lo, inner + hi)])
    else:
        mlp.gate_proj, mlp.up_proj = take_rows(mlp.gate_proj, [(lo, hi)]), take_rows(mlp.up_proj, [(lo, hi)])
    mlp.down_proj = take_cols(mlp.down_proj, lo, hi, keep_bias=layout.rank == 0)


def _gate_up_rows(module: nn.Module) -> int:
    parts = getattr(module, "parts", None)
    return sum(int(p.out_features) for p in parts) if parts is not None else int(module.out_features)


def _all_reduce_hook(group: Any):
    def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(output)  # [B, T, hidden]: the partial sums of every rank, summed
    return hook


# --- LoRA adapters -----------------------------------------------------------------------------------------
_ROWS = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "qkv_proj": "qkv", "gate_proj": "mlp", "up_proj": "mlp",
         "gate_up_proj": "gate_up", "w1": "mlp", "w3": "mlp"}  # column-parallel: B keeps this rank's rows
_COLS = {"o_proj": "q", "down_proj": "mlp", "w2": "mlp"}  # row-parallel: A keeps this rank's input columns


def shard_adapter(adapter: Any, info: TensorParallelInfo) -> Any:
    """A LoraAdapter (py_engine.adapters) cut like the model: B's rows of column-parallel projections, A's
    columns of row-parallel ones (the all-reduce then sums B (A_r x_r) over ranks: B (A x)); the rest whole."""
    layout, config = info.layout, info.full_config
    q_dim, kv_dim = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    inner = config.intermediate_size
    (q0, q1), (k0, k1), (i0, i1) = layout.q_rows(), layout.kv_rows(), layout.intermediate
    rows = {"q": [(q0, q1)], "kv": [(k0, k1)], "mlp": [(i0, i1)],
            "qkv": [(q0, q1), (q_dim + k0, q_dim + k1), (q_dim + kv_dim + k0, q_dim + kv_dim + k1)],
            "gate_up": [(i0, i1), (inner + i0, inner + i1)]}
    cols = {"q": (q0, q1), "mlp": (i0, i1)}
    modules = {}
    for name, m in adapter.modules.items():
        leaf = name.rpartition(".")[2]
        if leaf in _ROWS:
            index = torch.cat([torch.arange(lo, hi) for lo, hi in rows[_ROWS[leaf]]])
            m = replace(m, B=m.B[index].contiguous())
        elif leaf in _COLS:
            lo, hi = cols[_COLS[leaf]]
            m = replace(m, A=m.A[:, lo:hi].contiguous())
        modules[name] = m
    return replace(adapter, modules=modules)
