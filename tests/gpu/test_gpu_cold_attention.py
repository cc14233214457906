"""The Triton paged-attention kernel reading int8/int4 cold blocks against the torch path, attention/cold.py.

Each case is one ragged step over a two-tier cache: every sequence's table
starts with the cold-pool blocks its first query reads cold (what the
scheduler demotes), scattered in a kv_cache.ColdPool filled by its own
quantizer, then hot blocks. The step mixes decode rows with cold blocks,
hot-only rows, a prompt chunk whose queries read exactly the pool's blocks
cold and ones whose later queries read blocks of the chunk itself cold (the
kernel quantizes those on the fly). The backend's attend_cold must give
cold_attention.attend's output on the same inputs: fp32 under Triton's
interpreter (conftest.py sets TRITON_INTERPRET=1 without a GPU; kept small,
it runs each program in Python), fp16 and bf16 too on a GPU.
"""
from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

from native_server.engine.attention import cold as cold_attention
from native_server.engine.kv_cache import ColdPool
from native_server.engine.model_runner import prepare_inputs
from native_server.engine.scheduler import SchedulerOutput
from native_server.engine.sequence import Sequence
from py_engine.models import AttentionSpec
from py_engine.models.kv_quant import KVQuantConfig, dequantize, quantize
from py_engine.sampling_params import SamplingParams

triton = pytest.importorskip("triton", reason="triton is not installed (make test installs triton==3.9.0)")
import triton.language as tl  # noqa: E402

from native_server.engine.attention.triton import TritonPagedAttention  # noqa: E402
from py_engine.gpu.combine import max_combine  # noqa: E402
from py_engine.gpu.paged_attention import ColdBlocks, _fake_quantize, paged_attention  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
HOT = 32  # hot tokens

# (block_size, head_dim, kv heads, query heads per kv head, kv dtype, sliding window)
CASES = [(16, 64, 2, 4, "int4", None), (32, 64, 1, 8, "int8", None), (8, 32, 2, 2, "int4", 48),
         (16, 32, 1, 1, "int8", None)]
# (context already cached, new tokens): decodes past the hot window, a hot-only decode, a prompt quantizing
# its own blocks on the fly, a fresh prompt, a chunk whose first queries read only the pool's blocks cold and
# whose later ones read blocks of its own cold too
RAGGED = [(150, 1), (10, 1), (90, 1), (0, 70), (3, 5), (64, 40)]


def case_id(case):
    bs, d, kv, g, bits, w = case
    return f"bs{bs}-d{d}-kv{kv}-g{g}-{bits}" + (f"-w{w}" if w else "")


def two_tier_step(shapes, quant: KVQuantConfig, kv_heads: int, head_dim: int, dtype, hot_only=False, seed=0):
    """Hot caches, a filled ColdPool (one layer), the step's metadata (cold_blocks set) and a generator."""
    gen = torch.Generator().manual_seed(seed)
    bs, rng = quant.block_size, random.Random(seed)
    counts = [0 if hot_only else quant.cold_edge(context) // bs for context, _ in shapes]  # the first query's
    blocks = [-(-(c + n) // bs) for c, n in shapes]
    hot_ids = list(range(sum(blocks) - sum(counts) + 3))
    cold_ids = list(range(sum(counts) + 2))
    rng.shuffle(hot_ids)
    rng.shuffle(cold_ids)
    key_cache = torch.randn(len(hot_ids), bs, kv_heads, head_dim, generator=gen).to(dtype)  # garbage in unused slots
    value_cache = torch.randn(len(hot_ids), bs, kv_heads, head_dim, generator=gen).to(dtype)
    pool = ColdPool(SimpleNamespace(num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=1),
                    len(cold_ids), quant, "cpu")
    keys = torch.randn(len(cold_ids), bs, kv_heads, head_dim, generator=gen) * 2 + 0.5  # channel outliers:
    keys[..., 3] *= 8
    pool.store(0, torch.arange(len(cold_ids)), keys, torch.randn(len(cold_ids), bs, kv_heads, head_dim, generator=gen))
    tables, seqs = [], []
    for i, ((context, new), n, cold) in enumerate(zip(shapes, blocks, counts)):
        tables.append([cold_ids.pop() for _ in range(cold)] + [hot_ids.pop() for _ in range(n - cold)])
        seq = Sequence(i, str(i), 0, [0] * (context + new), SamplingParams())
        seq.num_computed_tokens = context
        seqs.append(seq)
    out = SchedulerOutput(seqs=seqs, num_new_tokens=[n for _, n in shapes])
    meta = prepare_inputs(out, tables, bs, torch.device(DEVICE), counts).meta
    for name in ("key_codes", "value_codes", "key_scales", "key_zeros", "value_scales", "value_zeros"):
        setattr(pool, name, [getattr(pool, name)[0].to(DEVICE)])
    return key_cache.to(DEVICE), value_cache.to(DEVICE), pool, meta, gen


def both(q, key_cache, value_cache, pool, meta, spec, quant):
    """(Triton's attend_cold, cold_attention.attend in float32) on the same inputs."""
    backend = TritonPagedAttention()
    got = backend.attend_cold(q, key_cache, value_cache, pool, 0, backend.prepare(meta), spec, quant)
    want = cold_attention.attend(q.float(), key_cache.float(), value_cache.float(), pool, 0, meta, spec, quant)
    return got, want


def assert_close(got, want, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


def run_case(case, dtype):
    block_size, head_dim, kv_heads, groups, bits, window = case
    quant = KVQuantConfig(bits, HOT, block_size)
    key_cache, value_cache, pool, meta, gen = two_tier_step(RAGGED, quant, kv_heads, head_dim, dtype)
    assert any(meta.cold_blocks) and not all(meta.cold_blocks)
    n = len(meta.slot_mapping)
    q = torch.randn(kv_heads * groups, n, head_dim, generator=gen).to(dtype).to(DEVICE).transpose(0, 1)  # [N, H, D]
    spec = AttentionSpec(head_dim ** -0.5, sliding_window=window)
    got, want = both(q, key_cache, value_cache, pool, meta, spec, quant)
    assert got.dtype == dtype and got.shape == q.shape
    step = meta.kernel_inputs
    assert step.fake and not step.torch_chunks and len(step.prefill) == 3  # every chunk in the kernel
    assert_close(got, want, dtype)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cold_and_hot_blocks_in_one_ragged_step_give_the_torch_paths_output(case):
    run_case(case, torch.float32)


def test_hot_only_steps_are_the_plain_kernels_bit_for_bit_and_split_kv_reads_cold_blocks():
    """No cold block: attend_cold == attend exactly. Then split-KV decode over cold blocks == one split."""
    quant = KVQuantConfig("int4", HOT, 16)
    shapes = [(130, 1), (40, 1), (9, 1)]
    key_cache, value_cache, pool, meta, gen = two_tier_step(shapes, quant, 2, 64, torch.float32, hot_only=True)
    q = torch.randn(3, 4, 64, generator=gen).to(DEVICE)
    spec = AttentionSpec(0.125)
    backend = TritonPagedAttention()
    got = backend.attend_cold(q, key_cache, value_cache, pool, 0, backend.prepare(meta), spec, quant)
    assert torch.equal(got, TritonPagedAttention().attend(q, key_cache, value_cache, meta, spec))

    key_cache, value_cache, pool, meta, gen = two_tier_step(shapes, quant, 2, 64, torch.float32, seed=1)
    assert meta.cold_blocks == [6, 0, 0]
    step = TritonPagedAttention().prepare(meta).kernel_inputs
    cold = ColdBlocks(step.cold_counts, *(getattr(pool, n)[0] for n in (
        "key_codes", "key_scales", "key_zeros", "value_codes", "value_scales", "value_zeros")), bits=4)
    outs = []
    for splits in (1, 4):
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        paged_attention(out, q, key_cache, value_cache, meta.block_tables, step.decode_blocks, 0.125, None, None,
                        decode=True, splits=splits, cold=cold)
        outs.append(out)
    want = cold_attention.attend(q, key_cache, value_cache, pool, 0, meta, spec, quant)
    assert_close(outs[0], want, torch.float32)
    assert_close(outs[1], want, torch.float32)


def test_cold_blocks_that_do_not_fit_the_cache_are_refused():
    cache = torch.zeros(2, 16, 1, 64, device=DEVICE)
    codes = torch.zeros(2, 16, 1, 32, dtype=torch.uint8, device=DEVICE)
    scales, per_token = torch.zeros(2, 1, 1, 64, device=DEVICE), torch.zeros(2, 16, 1, 1, device=DEVICE)
    blocks = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(1, 4, 64, device=DEVICE)
    counts = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    cold = ColdBlocks(counts, codes, scales, scales, codes, per_token, per_token, bits=8)  # int8 needs 64 a token
    with pytest.raises(ValueError, match="cold key_codes"):
        paged_attention(q, q, cache, cache, blocks, blocks, 1.0, None, None, decode=True, cold=cold)
    cold = ColdBlocks(counts, codes, scales, scales, codes, per_token, per_token, bits=2)
    with pytest.raises(ValueError, match="not readable"):
        paged_attention(q, q, cache, cache, blocks, blocks, 1.0, None, None, decode=True, cold=cold)
    cache, codes = torch.zeros(2, 64, 1, 64, device=DEVICE), torch.zeros(2, 64, 1, 32, dtype=torch.uint8, device=DEVICE)
    per_token = torch.zeros(2, 64, 1, 1, device=DEVICE)
    cold = ColdBlocks(counts, codes, scales, scales, codes, per_token, per_token, bits=4, hot_tokens=64)
    with pytest.raises(ValueError, match="64-token blocks divide"):
        paged_attention(q, q, cache, cache, blocks, blocks, 1.0, None, None, decode=False, cold=cold)


def test_prompt_chunks_with_blocks_over_a_key_tile_keep_the_torch_path():
    """64-token blocks: a prompt whose later queries read its own blocks cold goes to cold_attention."""
    quant = KVQuantConfig("int8", 64, 64)
    key_cache, value_cache, pool, meta, gen = two_tier_step([(0, 140), (200, 1)], quant, 1, 16, torch.float32)
    q = torch.randn(141, 2, 16, generator=gen).to(DEVICE)
    got, want = both(q, key_cache, value_cache, pool, meta, AttentionSpec(0.25), quant)
    assert meta.kernel_inputs.torch_chunks == [0] and meta.cold_blocks == [0, 2]
    assert_close(got, want, torch.float32)


@pytest.mark.skipif(not ON_GPU, reason="GPU: the compiled cold-block kernel in fp16/bf16 needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_compiled_kernel_on_cuda_gives_the_torch_paths_output(case, dtype):
    run_case(case, dtype)


@triton.jit
def _fake_rows(x_ptr, out_ptr, N: tl.constexpr, LEVELS: tl.constexpr):
    """Each row of x [N, N] quantized over its N values by the kernel's _fake_quantize."""
    at = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    x = tl.load(x_ptr + at)
    lo = tl.broadcast_to(-tl.reduce(-x, 1, max_combine, keep_dims=True), x.shape)
    hi = tl.broadcast_to(tl.reduce(x, 1, max_combine, keep_dims=True), x.shape)
    tl.store(out_ptr + at, _fake_quantize(x, lo, hi, LEVELS))


@pytest.mark.parametrize("bits", [4, 8])
def test_on_the_fly_quantization_rounds_as_torch_does_ties_included(bits):
    """Rows whose (x - min) / scale land on k + 0.5 (round half to even), constant rows, random rows."""
    levels, gen = 2**bits - 1, torch.Generator().manual_seed(bits)
    x = torch.randn(16, 16, generator=gen) * 3
    x[0, :2] = torch.tensor([0.0, levels])  # scale 1, and 14 ties: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, ...
    x[0, 2:] = torch.arange(14.0) + 0.5
    x[1] = 2.0  # constant: scale 1, dequantizes to itself
    x = x.to(DEVICE)
    got = torch.empty_like(x)
    _fake_rows[(1,)](x, got, N=16, LEVELS=levels)
    codes, scale, zero = quantize(x, -1, bits)
    assert torch.equal(got, dequantize(codes, scale, zero, torch.float32))
