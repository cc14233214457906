"""The Triton paged-attention kernels (py_engine/gpu) against the torch oracle, TorchPagedAttention.

Without a CUDA GPU they run under Triton's interpreter (TRITON_INTERPRET=1, set
by conftest.py), which runs each program in Python: shapes are small and each
case puts decodes and prompt chunks in one ragged batch, so one case covers
both launches. On a GPU the same tests run compiled, bf16 too. The oracle runs
in float32 on the same (rounded) inputs; tolerances are the issue's: 1e-5 for
fp32, 2e-3 for fp16 and 1e-2 for bf16.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from native_server.engine.model_runner import prepare_inputs
from native_server.engine.attention import TorchPagedAttention
from native_server.engine.scheduler import SchedulerOutput
from native_server.engine.sequence import Sequence
from py_engine.models import AttentionSpec
from py_engine.sampling_params import SamplingParams

pytest.importorskip("triton", reason="triton is not installed (make test installs triton==3.9.0)")
from native_server.engine.attention.triton import TritonPagedAttention  # noqa: E402
from py_engine.gpu.kv_store import store_kv  # noqa: E402
from py_engine.gpu.paged_attention import paged_attention  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (block_size, head_dim, kv_heads, query heads per kv head, sliding window, softcap)
CASES = [(16, 64, 2, 1, None, None), (16, 128, 1, 4, None, None), (32, 64, 1, 8, 24, None),
         (32, 128, 2, 4, 40, 30.0), (16, 64, 1, 8, None, 20.0), (32, 64, 2, 1, 16, None)]
# (context already cached, new tokens): a first chunk, decodes, a later chunk, a fresh one-token prompt
RAGGED = [(0, 20), (37, 1), (70, 1), (5, 9), (0, 1), (100, 1), (33, 40)]


def case_id(case):
    bs, d, kv, g, w, cap = case
    return f"bs{bs}-d{d}-kv{kv}-g{g}" + (f"-w{w}" if w else "") + (f"-cap{cap:g}" if cap else "")


def scattered_batch(shapes, block_size, kv_heads, head_dim, dtype, seed=0):
    """Caches with every sequence's context written at scattered blocks, the step's metadata, and the
    generator that draws the step's new q, k and v: (key_cache, value_cache, meta, generator)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 3
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)  # garbage
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)  # elsewhere
    tables, seqs = [], []
    for i, (context, new) in enumerate(shapes):
        total = context + new
        tables.append([ids.pop() for _ in range(-(-total // block_size))])
        seq = Sequence(i, str(i), 0, [0] * total, SamplingParams())
        seq.num_computed_tokens = context
        seqs.append(seq)
        for p in range(context):  # an earlier step wrote these
            slot = tables[-1][p // block_size]
            key_cache[slot, p % block_size] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
            value_cache[slot, p % block_size] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
    out = SchedulerOutput(seqs=seqs, num_new_tokens=[n for _, n in shapes])
    inputs = prepare_inputs(out, tables, block_size, torch.device(DEVICE))
    return key_cache.to(DEVICE), value_cache.to(DEVICE), inputs.meta, gen


def oracle(q, key_cache, value_cache, meta, spec):
    """TorchPagedAttention in float32 on the same inputs."""
    return TorchPagedAttention().attend(q.float(), key_cache.float(), value_cache.float(), meta, spec)


def assert_close(got, want, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_store_then_attend_equals_the_oracle_on_a_ragged_batch(case, dtype):
    block_size, head_dim, kv_heads, groups, window, softcap = case
    key_cache, value_cache, meta, gen = scattered_batch(RAGGED, block_size, kv_heads, head_dim, dtype)
    n, heads = len(meta.slot_mapping), kv_heads * groups
    k = torch.randn(kv_heads, n, head_dim, generator=gen).to(dtype).to(DEVICE).transpose(0, 1)  # [N, KV, D] view
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q = torch.randn(heads, n, head_dim, generator=gen).to(dtype).to(DEVICE).transpose(0, 1)  # [N, H, D] view
    want_cache = key_cache.clone(), value_cache.clone()
    TorchPagedAttention().write(*want_cache, k, v, meta.slot_mapping)
    backend = TritonPagedAttention()
    backend.write(key_cache, value_cache, k, v, meta.slot_mapping)
    assert torch.equal(key_cache, want_cache[0]) and torch.equal(value_cache, want_cache[1])

    spec = AttentionSpec(head_dim ** -0.5, sliding_window=window, softcap=softcap)
    got = backend.attend(q, key_cache, value_cache, backend.prepare(meta), spec)
    assert got.dtype == dtype and got.shape == q.shape
    assert_close(got, oracle(q, key_cache, value_cache, meta, spec), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("splits", [2, 4, 8])
def test_split_kv_decode_equals_one_split_and_the_oracle(splits, dtype):
    """Long contexts over several key tiles, cut in `splits` shares merged by the second kernel; a
    windowed context that leaves some shares empty; a context shorter than one tile."""
    shapes = [(300, 1), (150, 1), (20, 1)]
    key_cache, value_cache, meta, gen = scattered_batch(shapes, 16, 2, 64, dtype, seed=1)
    q = torch.randn(3, 8, 64, generator=gen).to(dtype).to(DEVICE)  # GQA 4
    blocks = TritonPagedAttention().prepare(meta).kernel_inputs.decode_blocks
    for window in (None, 100):
        spec = AttentionSpec(0.125, sliding_window=window)
        outs = []
        for s in (1, splits):
            out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
            paged_attention(out, q, key_cache, value_cache, meta.block_tables, blocks, 0.125, window, None,
                            decode=True, splits=s)
            outs.append(out)
        assert_close(outs[1], oracle(q, key_cache, value_cache, meta, spec), dtype)
        assert_close(outs[1], outs[0], dtype)


def test_padding_rows_write_nothing_and_attend_to_nothing():
    """A CUDA-graph batch is padded with slot -1 (no write) and blocks of 0 tokens (zeros out)."""
    key_cache = torch.randn(4, 16, 1, 64).to(DEVICE)
    before = key_cache.clone()
    k = torch.randn(3, 1, 64).to(DEVICE)
    store_kv(key_cache, key_cache, k, k, torch.tensor([-1, 5, -1], device=DEVICE))
    assert torch.equal(key_cache.view(-1, 64)[5], k[1, 0])
    key_cache.view(-1, 64)[5] = before.view(-1, 64)[5]
    assert torch.equal(key_cache, before)
    q = torch.randn(2, 4, 64).to(DEVICE)
    blocks = torch.tensor([[0, 0, 9, 1], [1, 1, -1, 0]], dtype=torch.int32, device=DEVICE)
    tables = torch.tensor([[2], [3]], device=DEVICE)
    for splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        paged_attention(out, q, key_cache, key_cache, tables, blocks, 0.125, None, None, decode=True, splits=splits)
        assert torch.isfinite(out[0]).all() and torch.equal(out[1], torch.zeros_like(out[1]))


def test_the_kernels_refuse_what_they_cannot_read():
    cache = torch.zeros(2, 16, 1, 64, device=DEVICE)
    q = torch.zeros(1, 4, 64, device=DEVICE, dtype=torch.float16)
    blocks = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cache holds"):
        paged_attention(q, q, cache, cache, blocks, blocks, 1.0, None, None, decode=True)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(q.float(), q.float(), cache, cache, blocks, blocks, 1.0, None, None, decode=True, splits=3)
    with pytest.raises(ValueError, match="do not fit"):
        store_kv(cache, cache, torch.zeros(1, 2, 64, device=DEVICE), torch.zeros(1, 2, 64, device=DEVICE),
                 torch.zeros(1, dtype=torch.long, device=DEVICE))
