"""Tensor parallelism's pieces without processes: the layout, the slices, and N ranks as threads.

The reference is the unsharded model (itself tested against transformers in tests/models): rank 0's logits
at TP=2 must be its logits, within float summation order, for float, int8, int4 and Q4_1-style weights
(the exact activation path: the int8-rounded one is compared, with margins, in test_tp_processes.py), and
with LoRA adapters cut to match (the adapters themselves are tested against peft in tests/adapters).
"""
from __future__ import annotations

import pytest
import torch

from py_engine.adapters import LoraManager
from py_engine.backends.torch import TorchBackend
from py_engine.cpu.linears import FusedLinear
from py_engine.cpu.transforms import optimize_for_cpu
from py_engine.hub import BUILTIN_MODEL, resolve_model
from py_engine.parallel import TensorParallelError, shard_layout, split_range
from py_engine.parallel.shard import take_cols, take_rows
from py_engine.parallel.transform import apply_tensor_parallel
from py_engine.quant.linear import QuantLinear, set_int8_activations
from py_engine.quant.load import load_quantized
from py_engine.quant.rtn import QuantizedWeight, quantize_rtn
from tests.parallel.thread_group import run_ranks

ADAPTERS = resolve_model(BUILTIN_MODEL).parent.parent / "data" / "adapters" / "tiny-shakespeare"


def test_split_range_is_contiguous_and_even():
    for units in range(1, 12):
        for world in range(1, units + 1):
            ranges = [split_range(units, world, r) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == units
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [hi - lo for lo, hi in ranges]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_layout_uneven_heads_keep_their_groups():
    # SmolLM2-135M: 9 heads over 3 KV heads, 1536 MLP channels; Q4_1 groups of 32 along o_proj's and down's inputs
    a, b = (shard_layout(9, 3, 64, 1536, 2, r, channel_unit=32, o_proj_unit=32) for r in (0, 1))
    assert (a.kv_heads, a.heads, b.kv_heads, b.heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert (a.intermediate, b.intermediate) == ((0, 768), (768, 1536))


@pytest.mark.parametrize("args, words", [
    ((6, 2, 32, 512, 3, 0), "larger than the model's 2 KV heads"),
    ((6, 2, 32, 192, 2, 0, 1, 128), "o_proj's quantization groups of 128 inputs cross the boundary"),
    ((6, 2, 32, 64, 2, 0, 64), "hold only 1 quantization groups of 64"),
    ((6, 2, 32, 64, 0, 0), "tensor_parallel_size must be an integer in [1, 64]"),
])
def test_layout_refuses_what_does_not_split(args, words):
    with pytest.raises(TensorParallelError, match=None) as info:
        shard_layout(*args)
    assert words in str(info.value)


def _sum_of_column_shards(layer, x, cuts):
    bounds = [0, *cuts, x.shape[-1]]
    return sum(take_cols(layer, lo, hi, keep_bias=lo == 0)(x[..., lo:hi]) for lo, hi in zip(bounds, bounds[1:]))


def _q4_1(w: torch.Tensor) -> QuantLinear:
    """GGUF Q4_1's layout: codes 0..15, a scale and a float minimum per block of 32 (w = d q + m)."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = (hi - lo) / 15
    codes = torch.round((blocks - lo[..., None]) / d[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return QuantLinear(QuantizedWeight(codes, d, torch.zeros_like(codes[:, ::32]), 4, 32, k, False, lo))


@pytest.mark.parametrize("kind", ["float", "int8", "int4-g32", "q4_1"])
def test_slices_recompose_the_layer(kind):
    torch.manual_seed(0)
    w, bias, x = torch.randn(48, 192), torch.randn(48), torch.randn(5, 192)
    layer = {"float": lambda: _linear(w, bias), "int8": lambda: QuantLinear(quantize_rtn(w, 8, None, True), bias),
             "int4-g32": lambda: QuantLinear(quantize_rtn(w, 4, 32, False), bias), "q4_1": lambda: _q4_1(w)}[kind]()
    set_int8_activations(layer, False)  # exact: slices must give the same numbers up to summation order
    y = layer(x)
    assert torch.allclose(_sum_of_column_shards(layer, x, [96]), y, atol=1e-4)
    assert torch.allclose(_sum_of_column_shards(layer, x, [64, 160]), y, atol=1e-4)
    rows = take_rows(layer, [(0, 8), (40, 48)])
    assert torch.equal(rows(x), torch.cat([y[:, :8], y[:, 40:]], dim=1))
    fused = FusedLinear([_linear(w, bias), _linear(w[:16], bias[:16])])
    part = take_rows(fused, [(4, 8), (50, 52)])  # rows 4..8 of the first part, 2..4 of the second
    assert [p.out_features for p in part.parts] == [4, 2]
    assert torch.allclose(part(x), torch.cat([fused(x)[:, 4:8], fused(x)[:, 50:52]], dim=1))


def test_a_cut_inside_a_group_is_refused():
    layer = QuantLinear(quantize_rtn(torch.randn(8, 256), 4, 128, False))
    with pytest.raises(TensorParallelError, match="would split a group"):
        take_cols(layer, 0, 96)


def _linear(w, b):
    layer = torch.nn.Linear(w.shape[1], w.shape[0])
    layer.weight.data, layer.bias.data = w.clone(), b.clone()
    return layer


def _load(quantization, lora=None):
    model, config, _ = load_quantized(resolve_model(BUILTIN_MODEL), quantization)
    optimize_for_cpu(model)
    set_int8_activations(model, False)
    return model, config


def _logits(model, config, ids, tokens, lora=None, hidden_only=False):
    sharded = getattr(model, "tensor_parallel", None)
    backend = TorchBackend(model, sharded.local_config if sharded else config, 256, lora, logits=not hidden_only)
    out = [backend.prefill(ids)]
    out += [backend.decode(t) for t in tokens]
    return None if hidden_only else torch.stack(out)


def _add_adapters(model):
    manager = LoraManager(model)
    for name in ("comedies", "tragedies"):
        manager.add(name, ADAPTERS / name)


@pytest.mark.parametrize("quantization, lora", [(None, None), (None, "comedies"), ("int8", None), ("int4", None)])
def test_two_ranks_give_the_unsharded_logits(quantization, lora):
    from py_engine.quant.config import QuantConfig
    quant = QuantConfig.from_options(quantization, group_size=32) if quantization == "int4" else quantization
    torch.manual_seed(0)
    ids, tokens = [0, 57, 203, 11, 480, 9], torch.randint(3, 4096, (12,)).tolist()
    model, config = _load(quant)
    if lora:
        _add_adapters(model)
    reference = _logits(model, config, ids, tokens, lora)

    def rank(r, group):
        m, c = _load(quant)
        apply_tensor_parallel(m, group)
        if lora:
            _add_adapters(m)  # cut to this rank's rows and columns as they load
        return _logits(m, c, ids, tokens, lora, hidden_only=r > 0)

    sharded = run_ranks(2, rank)[0]
    assert (sharded - reference).abs().max() < 2e-5


def test_sharded_model_holds_its_share():
    model, _ = _load(None)
    whole = sum(p.numel() for p in model.model.layers.parameters())
    shards = run_ranks(2, lambda r, g: _share(g))
    norms = 6 * 2 * 192  # input and post-attention norms stay whole on each rank
    assert shards[0] + shards[1] == whole + norms
    info = _tp_info()
    assert (info.local_config.num_attention_heads, info.local_config.num_key_value_heads) == (3, 1)


def _share(group):
    m, _ = _load(None)
    apply_tensor_parallel(m, group)
    return sum(p.numel() for p in m.model.layers.parameters())


def _tp_info():
    m, _ = _load(None)
    return run_ranks(1, lambda r, g: apply_tensor_parallel(m, _World2Rank0(g)))[0]


class _World2Rank0:
    def __init__(self, group):
        self.rank, self.world, self.device = 0, 2, group.device

    def all_reduce(self, t):
        return t


def test_ranks_pin_to_numa_nodes_when_there_are_enough(monkeypatch):
    from py_engine.parallel import launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch._cpu_list("0-3,8-11\n") == [0, 1, 2, 3, 8, 9, 10, 11]
    monkeypatch.setattr(launch, "numa_nodes", lambda: [(0, 1, 2, 3), (4, 5, 6, 7)])
    assert launch.cpu_plan(2) == [((0, 1, 2, 3), 4), ((4, 5, 6, 7), 4)]
    monkeypatch.setattr(launch, "numa_nodes", lambda: [(0, 1, 2, 3)])  # one node: share its cores, no pinning
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert launch.cpu_plan(2) == [(None, 2), (None, 2)]


def test_a_thread_budget_is_shared_out_and_never_pinned(monkeypatch):
    """A Ray actor (a tensor-parallel replica) gets OMP_NUM_THREADS = its reserved CPUs: its ranks share those."""
    from py_engine.parallel import launch

    monkeypatch.setattr(launch, "numa_nodes", lambda: [(0, 1, 2, 3), (4, 5, 6, 7)])
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert launch.cpu_plan(2) == [(None, 2), (None, 2)]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert launch.cpu_plan(2) == [(None, 1), (None, 1)]
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset or not a count: the machine's cores, NUMA pinning
    assert launch.cpu_plan(2) == [((0, 1, 2, 3), 4), ((4, 5, 6, 7), 4)]
