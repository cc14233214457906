"""The C paged decode (CpuPagedAttention, py_engine/kernels/paged.c) against the torch oracle.

Same inputs through both: random scattered block tables, GQA, sliding
windows and softcapping, block sizes 4/16/32, fp32 and bf16 caches, hot-only
and hot + cold (int8/int4) tables, decode rows mixed with a prompt chunk.
The oracle is TorchPagedAttention (hot) and cold_attention.attend (cold
blocks dequantized in torch), each run on the same metadata.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from native_server.engine.attention import cold as cold_attention
from native_server.engine.kv_cache import ColdPool
from native_server.engine.attention import PagedMetadata, TorchPagedAttention, backend_for, decode_kv_positions
from py_engine.kernels import cpu_kernels
from py_engine.models import AttentionSpec
from py_engine.models.kv_quant import KVQuantConfig
from tests.requires import kernels_missing

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason=str(kernels_missing()))
SPECS = {"full": AttentionSpec(0.25), "window": AttentionSpec(0.2, sliding_window=23),
         "window-softcap": AttentionSpec(0.3, sliding_window=40, softcap=2.0)}
# dtype -> (atol, rtol): fp32 differs only in summation order (~3e-7 seen); bf16: about one ulp of the output
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (8e-3, 8e-3)}


def metadata(shapes, tables, block_size, cold_counts=None) -> PagedMetadata:
    """shapes: (context already cached, new tokens) per sequence; tables: block ids per sequence."""
    news = [n for _, n in shapes]
    query_start = [0]
    for n in news:
        query_start.append(query_start[-1] + n)
    lens = [c + n for c, n in shapes]
    positions = torch.cat([torch.arange(c, c + n) for c, n in shapes])
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    decode = [i for i, n in enumerate(news) if n == 1]
    return PagedMetadata(
        slot_mapping=torch.zeros(len(positions), dtype=torch.long), positions=positions, query_start=query_start,
        context_lens=lens, block_tables=table, decode_seqs=torch.tensor(decode, dtype=torch.long),
        decode_tokens=torch.tensor([query_start[i] for i in decode], dtype=torch.long),
        decode_kv_positions=decode_kv_positions(torch.tensor(lens)[decode], block_size),
        prefill_seqs=[i for i, n in enumerate(news) if n > 1], cold_blocks=cold_counts)


def random_step(block_size, dtype, heads=8, kv_heads=2, head_dim=16, bits=None, seed=0):
    """A batch of decode rows (and one prompt chunk) over a random paged cache, with cold blocks if bits."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    shapes = [(rng.randrange(0, 90), 1) for _ in range(6)] + [(0, 1), (17, 5), (block_size * 3 - 1, 1)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    hot_ids, cold_ids = list(range(num_blocks)), list(range(num_blocks))
    rng.shuffle(hot_ids)
    rng.shuffle(cold_ids)
    tables, counts = [], []
    cold = None
    if bits:
        config = SimpleNamespace(num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=2)
        cold = ColdPool(config, num_blocks, KVQuantConfig("int8" if bits == 8 else "int4", block_size, block_size),
                        "cpu")
    for c, n in shapes:
        blocks = -(-(c + n) // block_size)
        # decode rows: any whole blocks before the query's own may be cold; the prompt chunk stays hot
        n_cold = rng.randrange(0, (c + n - 1) // block_size + 1) if bits and n == 1 else 0
        ids = [cold_ids.pop() for _ in range(n_cold)] + [hot_ids.pop() for _ in range(blocks - n_cold)]
        tables.append(ids)
        counts.append(n_cold)
    if cold is not None:
        for layer in range(2):
            ids = torch.tensor(range(num_blocks))
            k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * 2 + 0.5
            v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
            cold.store(layer, ids, k.to(dtype), v.to(dtype))
    meta = metadata(shapes, tables, block_size, counts if bits else None)
    q = torch.randn(heads, len(meta.positions), head_dim, generator=gen).to(dtype).transpose(0, 1)  # [N, H, D], strided
    return q, key_cache, value_cache, meta, cold


@pytest.fixture
def c_calls(monkeypatch):
    """Each call of paged.c's rk_paged_decode (through kernels.paged.paged_decode): the backend falls back to
    the torch oracle for what the kernel refuses, so a test that only compared results could compare torch
    with torch."""
    import native_server.engine.attention.cpu as module

    calls, original = [], module.paged_decode

    def counted(*args, **kwargs):
        calls.append(args[0])  # the kernels library it ran on
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "paged_decode", counted)
    return calls


def check(got, want, dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_auto_picks_the_c_backend_on_the_cpu():
    assert backend_for("cpu").name == "cpu"
    assert backend_for("cpu", "torch").name == "torch"


def test_the_c_backend_asked_for_by_name_where_it_cannot_run_is_a_clear_error(monkeypatch):
    """`--attention-backend cpu` on another device, or where the kernels do not load, says so (auto falls
    back to torch instead); the serve command takes the name."""
    import argparse

    from native_server.serve import add_serve_parser

    with pytest.raises(ValueError, match="--attention-backend cpu cannot run here.*meta"):
        backend_for("meta", "cpu")
    monkeypatch.setattr("py_engine.kernels.cpu_kernels", lambda: None)
    with pytest.raises(ValueError, match="--attention-backend cpu cannot run here.*do not load on cpu"):
        backend_for("cpu", "cpu")
    assert backend_for("cpu").name == "torch"
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert parser.parse_args(["serve", "--attention-backend", "cpu"]).attention_backend == "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
def test_hot_blocks_equal_the_torch_backend(dtype, block_size, spec, c_calls):
    q, key_cache, value_cache, meta, _ = random_step(block_size, dtype, seed=block_size)
    backend = backend_for("cpu")
    want = TorchPagedAttention().attend(q, key_cache, value_cache, meta, SPECS[spec])
    got = backend.attend(q, key_cache, value_cache, backend.prepare(meta), SPECS[spec])
    check(got, want, dtype)
    assert len(c_calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
def test_cold_blocks_equal_torch_dequantization(dtype, bits, block_size, spec, c_calls):
    q, key_cache, value_cache, meta, cold = random_step(block_size, dtype, bits=bits, seed=bits + block_size)
    assert any(meta.cold_blocks)
    quant = KVQuantConfig("int8" if bits == 8 else "int4", block_size, block_size)
    backend = backend_for("cpu")
    for layer in range(2):
        want = cold_attention.attend(q, key_cache, value_cache, cold, layer, meta, SPECS[spec], quant)
        got = backend.attend_cold(q, key_cache, value_cache, cold, layer, backend.prepare(meta), SPECS[spec], quant)
        check(got, want, dtype)
    assert len(c_calls) == 2


def test_wider_heads_and_a_single_kv_head(c_calls):
    """head_dim 64 (Qwen2.5-0.5B's), 14 heads over 2 KV heads, and multi-query (1 KV head)."""
    for heads, kv_heads in [(14, 2), (4, 1)]:
        q, key_cache, value_cache, meta, cold = random_step(16, torch.float32, heads, kv_heads, 64, bits=4, seed=3)
        quant = KVQuantConfig("int4", 16, 16)
        backend = backend_for("cpu")
        want = cold_attention.attend(q, key_cache, value_cache, cold, 0, meta, SPECS["full"], quant)
        got = backend.attend_cold(q, key_cache, value_cache, cold, 0, backend.prepare(meta), SPECS["full"], quant)
        check(got, want, torch.float32)
    assert len(c_calls) == 2


def test_shapes_the_kernel_refuses_take_the_torch_path(c_calls):
    """head_dim 12 is not a multiple of 8: the backend answers through torch, with the same result."""
    q, key_cache, value_cache, meta, _ = random_step(4, torch.float32, head_dim=12)
    backend = backend_for("cpu")
    want = TorchPagedAttention().attend(q, key_cache, value_cache, meta, SPECS["window"])
    got = backend.attend(q, key_cache, value_cache, backend.prepare(meta), SPECS["window"])
    torch.testing.assert_close(got, want)
    assert not c_calls and "head_dim 12" in next(iter(backend._refusals.values()))


def test_a_value_cache_laid_out_unlike_the_key_cache_is_refused_before_the_kernel_reads_it():
    """paged.c reads keys and values with one element type and one set of strides: a value cache of another
    dtype would be read with the wrong element size (past its end for fp16 values beside fp32 keys)."""
    from py_engine.kernels.paged import paged_decode

    q, key_cache, value_cache, meta, _ = random_step(16, torch.float32)
    args = backend_for("cpu").prepare(meta).kernel_inputs
    for bad in (value_cache.half(), value_cache[:-1].clone(), value_cache.transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(ValueError, match="value cache"):
            paged_decode(KERNELS, args, q, key_cache, bad, 0.25, None, None)
    paged_decode(KERNELS, args, q, key_cache, value_cache, 0.25, None, None)  # the same call, laid out alike


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("auto", "float32"), ("int4", "float32"), ("int4", "bfloat16"),
                                                   ("fp16", "float32"), ("bf16", "float32")])
def test_a_single_stream_runs_as_one_c_call_and_equals_the_dense_engine(model_dir, kv_cache_dtype, dtype):
    """One sequence decoding alone takes the one-call stack (rk_decode_step) over the paged cache, hot and cold
    blocks; its greedy tokens equal the per-module path's (stack off: the same kernels call by call) and, in
    fp32, the dense LLM's (same KV settings; with fp16 or bf16 KV, which the dense cache does not store, its fp32
    one: on this model the rounding flips no token) and the torch backend's."""
    from native_server.engine.llm_engine import LLMEngine
    from py_engine.backends.torch import LLM
    from py_engine.cpu.stack import StackPlan
    from py_engine.sampling_params import SamplingParams

    kv = dict(kv_cache_dtype=kv_cache_dtype, kv_hot_tokens=16)
    prompt = list(range(5, 35))
    params = SamplingParams.greedy(max_tokens=60)  # 90 positions: blocks turn cold from position 31 (int4)

    def tokens(backend: str, stack: bool = True) -> tuple[list[int], int]:
        eng = LLMEngine(str(model_dir), device="cpu", dtype=dtype, attention_backend=backend, **kv)
        calls = []
        original = StackPlan.__call__

        def counted(plan, *args):
            calls.append(plan.kv.n_cold if hasattr(plan.kv, "n_cold") else None)
            return original(plan, *args)

        eng.model.model.stack_enabled = stack
        StackPlan.__call__ = counted
        try:
            eng.add_request("r", prompt, params)
            out = []
            while eng.has_unfinished_requests():
                for o in eng.step():
                    out += o.outputs[0].token_ids
        finally:
            StackPlan.__call__ = original
        return out, calls

    got, calls = tokens("cpu")
    assert len(calls) >= 55  # every decode step after the first
    assert all(c is not None for c in calls)  # on a paged view, not a dense cache
    if kv_cache_dtype == "int4":
        assert max(calls) >= 3  # steps that read cold blocks
    assert got == tokens("cpu", stack=False)[0]
    if dtype == "float32":  # bf16 roundings differ in order between the dense and paged kernels and torch's
        dense_kv = kv if kv_cache_dtype not in ("fp16", "bf16") else {}
        dense = LLM(str(model_dir), device="cpu", dtype=dtype, **dense_kv).generate(prompt, params)
        assert got == dense.token_ids == tokens("torch")[0]


@pytest.mark.parametrize("variant", ["avx2", "avx512", "avx512-vnni", "avx512-bf16"])
def test_every_kernel_variant_equals_the_oracle(variant, c_calls):
    """Each instruction-set build of the kernels (py_engine.kernels.VARIANTS) runs the same paged decode."""
    from native_server.engine.attention.cpu import CpuPagedAttention
    from py_engine.kernels import kernel_variant, variant_fits

    if not variant_fits(variant):
        pytest.skip(f"hardware: this CPU lacks the {variant} instructions")
    kernels = kernel_variant(variant)
    assert kernels is not None, f"the {variant} variant did not build"
    backend = CpuPagedAttention(kernels)
    for dtype, bits in [(torch.float32, 4), (torch.bfloat16, 8)]:
        q, key_cache, value_cache, meta, cold = random_step(16, dtype, bits=bits, seed=7)
        quant = KVQuantConfig("int8" if bits == 8 else "int4", 16, 16)
        want = cold_attention.attend(q, key_cache, value_cache, cold, 1, meta, SPECS["window"], quant)
        got = backend.attend_cold(q, key_cache, value_cache, cold, 1, backend.prepare(meta), SPECS["window"], quant)
        check(got, want, dtype)
    assert [k is kernels for k in c_calls] == [True, True]  # this variant's library ran both


# A 16-bit cache beside fp32 / bf16 queries (--kv-cache-dtype fp16 / bf16). Against the oracle fed the same
# 16-bit blocks: fp32 queries differ only in summation order; bf16 ones by about one ulp of the output (the
# oracle widens the blocks to bf16, the kernel to fp32). Against the fp32 blocks the cache was rounded from:
# fp16 keeps 11 significant bits (relative error <= 2^-11 per value), which on these unit-variance
# inputs moved outputs by < 2e-3 (seen: ~6e-4); bf16 keeps 8 (2^-8: < 1.5e-2, seen ~5e-3).
ROUNDED = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2)}


@pytest.mark.parametrize("q_dtype,kv_dtype", [(torch.float32, torch.float16), (torch.bfloat16, torch.float16),
                                              (torch.float32, torch.bfloat16)], ids=["fp32-fp16", "bf16-fp16",
                                                                                     "fp32-bf16"])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
def test_16_bit_blocks_equal_the_torch_backend_on_the_same_blocks(q_dtype, kv_dtype, block_size, spec, c_calls):
    q, key_cache, value_cache, meta, _ = random_step(block_size, torch.float32, seed=block_size + 1)
    keys, values = key_cache.to(kv_dtype), value_cache.to(kv_dtype)
    backend = backend_for("cpu")
    got = backend.attend(q.to(q_dtype), keys, values, backend.prepare(meta), SPECS[spec])
    assert got.dtype == q_dtype and len(c_calls) == 1
    want = TorchPagedAttention().attend(q.to(q_dtype), keys, values, meta, SPECS[spec])
    check(got, want, q_dtype)
    if q_dtype == torch.float32:  # what rounding the cache to 16 bits costs
        exact = TorchPagedAttention().attend(q, key_cache, value_cache, meta, SPECS[spec])
        torch.testing.assert_close(got, exact, atol=ROUNDED[kv_dtype][0], rtol=ROUNDED[kv_dtype][1])


def one_token_rows(kv_dtype, values: torch.Tensor, head_dim=64):
    """Each row of `values` [rows, head_dim] alone in its own block as a one-token context: attention's output is
    that value row read back widened (softmax weight 1), through the kernel's fp16 / bf16 loads."""
    rows = values.shape[0]
    value_cache = torch.zeros(rows, 4, 1, head_dim, dtype=kv_dtype)
    value_cache[:, 0, 0] = values
    key_cache = torch.zeros_like(value_cache)
    meta = metadata([(0, 1)] * rows, [[i] for i in range(rows)], 4)
    return torch.zeros(rows, 1, head_dim), key_cache, value_cache, meta


def every_half() -> torch.Tensor:
    """All 65,536 fp16 bit patterns but NaNs (normals, subnormals, zeros, infinities) as [1024, 64] fp16."""
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    halves = bits.view(torch.float16)
    return halves.masked_fill(halves.isnan(), 1.0).view(1024, 64)


@pytest.mark.parametrize("variant", ["avx2", "avx512", "avx512-vnni", "avx512-bf16"])
def test_every_kernel_variant_reads_and_writes_fp16_as_torch(variant, c_calls):
    """Each build widens every fp16 bit pattern as torch does (avx2: integer AVX2, the AVX-512 builds: F16C),
    rounds fp32 to fp16 as torch's .to(float16) (ties, subnormals, overflow; step.c's cache write,
    rk_paged_attend_one), and runs the paged decode over an fp16 cache."""
    import ctypes

    from native_server.engine.attention.cpu import CpuPagedAttention
    from py_engine.kernels import kernel_variant, variant_fits
    from py_engine.kernels.paged import PagedDecode

    if not variant_fits(variant):
        pytest.skip(f"hardware: this CPU lacks the {variant} instructions")
    kernels = kernel_variant(variant)
    assert kernels is not None, f"the {variant} variant did not build"
    backend = CpuPagedAttention(kernels)
    halves = every_half()
    q, key_cache, value_cache, meta = one_token_rows(torch.float16, halves)
    got = backend.attend(q, key_cache, value_cache, backend.prepare(meta), SPECS["full"])
    assert torch.equal(got[:, 0], halves.float())  # inf and -inf included
    # the write: fp32 values -> the cache through rk_paged_attend_one (rot 0: no rotation), against torch's rounding
    gen = torch.Generator().manual_seed(5)
    tricky = torch.tensor([65504.0, 65519.99, 65520.0, 1e6, -70000.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001,
                           3 * 2.0**-26, 6.1e-5, 1 + 2.0**-11, 1 + 3 * 2.0**-11, -0.0, float("inf"), 1e-9, 0.1])
    ties = torch.cat([(torch.arange(1024.0) + 0.5) * 2.0**-24, 1 + (2 * torch.arange(512.0) + 1) * 2.0**-11])
    spread = torch.randn(4096 - 16 - 1536, generator=gen) * torch.logspace(-9, 5, 4096 - 16 - 1536)
    x = torch.cat([tricky, ties, -ties[::3], spread])[:4096]  # subnormal and normal ties: to even
    lib = kernels.lib
    lib.rk_paged_attend_one.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
    heads, kv_heads, head_dim = 2, 2, 64
    written = torch.empty(0)
    for start in range(0, len(x), 2 * kv_heads * head_dim):
        kv = x[start:start + 2 * kv_heads * head_dim]  # the keys, then the values of the new token
        qkv = torch.cat([torch.zeros(heads * head_dim), kv])
        keys, values = (torch.zeros(1, 1, kv_heads, head_dim, dtype=torch.float16) for _ in range(2))
        table, row = torch.zeros(1, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
        length = torch.ones(1, dtype=torch.int64)
        p = PagedDecode(keys=keys.data_ptr(), values=values.data_ptr(), tables=table.data_ptr(), seqs=row.data_ptr(),
                        tokens=row.data_ptr(), lens=length.data_ptr(), table_stride=1, rows=1, H=heads, KV=kv_heads,
                        D=head_dim, bs=1, scale=1.0, kv=2)
        out, qbuf, scratch = torch.empty(heads * head_dim), torch.empty(heads * head_dim), torch.empty(head_dim)
        p.out = out.data_ptr()
        assert lib.rk_paged_attend_one(qkv.data_ptr(), None, None, 0, 0, qbuf.data_ptr(), scratch.data_ptr(),
                                       ctypes.byref(p)) == 0
        written = torch.cat([written, keys.flatten().float(), values.flatten().float()])
        if keys.isfinite().all():  # (0 * inf scores are NaN) one key: attention gives back its value
            torch.testing.assert_close(out.view(heads, head_dim), values.float().view(kv_heads, head_dim))
    assert torch.equal(written, x.to(torch.float16).float())
    q, key_cache, value_cache, meta, _ = random_step(16, torch.float32, seed=8)
    keys, values = key_cache.to(torch.float16), value_cache.to(torch.float16)
    want = TorchPagedAttention().attend(q, keys, values, meta, SPECS["window-softcap"])
    check(backend.attend(q, keys, values, backend.prepare(meta), SPECS["window-softcap"]), want, torch.float32)
    assert [k is kernels for k in c_calls] == [True, True]  # this variant's library ran both
