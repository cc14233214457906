"""Every build of the CPU kernels (py_engine.kernels.VARIANTS) against the plain references.

Each variant the CPU has is loaded and run: the fp32/bf16 linear against
F.linear, the quantized kernels (int8/int4 groups, GGUF-style float minimums;
1 row, a batch in integer tiles, a prefill chunk) against dequantize-then-matmul
on x rounded as quant.c documents, and a batch against its rows one by one.
A variant this CPU lacks is still compiled (every machine can build every
variant) and then skips with a "hardware: " reason. Dispatch: the best variant
the flags allow is the one loaded, and RUVLLM_KERNEL_VARIANT picks another.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from py_engine.kernels import (VARIANTS, best_variant, build_variant, cpu_flags, cpu_kernels,  # noqa: E402
                               kernel_variant, variant_fits)
from py_engine.quant.kernels import PackedWeight, QuantPlan, fake_quantize_blocks  # noqa: E402
from py_engine.quant.rtn import QuantizedWeight, quantize_rtn  # noqa: E402
from tests.paths import REPO  # noqa: E402
from tests.requires import HARDWARE, kernels_missing  # noqa: E402

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing()))


@pytest.fixture(params=list(VARIANTS))
def kernels(request):
    name = request.param
    if not variant_fits(name):
        assert build_variant(name) is not None, f"the {name} variant does not compile"
        missing = sorted(set(VARIANTS[name][0]) - cpu_flags())
        pytest.skip(f"{HARDWARE}this CPU lacks {', '.join(missing)} for the {name} kernels (built, not run)")
    loaded = kernel_variant(name)
    if loaded is None:
        pytest.skip(str(kernels_missing()))
    loaded.set_threads(2)
    return loaded


def weights(bits: int, group: int, symmetric: bool, n: int, k: int, offsets: bool = False) -> QuantizedWeight:
    g = torch.Generator().manual_seed(bits * 100 + group)
    q = quantize_rtn(torch.randn(n, k, generator=g), bits, group, symmetric)
    if offsets:  # GGUF Q4_1: w = s * c + m, no zero points
        zeros = torch.zeros_like(q.zero_points)
        q = QuantizedWeight(q.codes, q.scales, zeros, bits, q.block_size, k, symmetric,
                            torch.randn(q.scales.shape, generator=g) * 0.01)
    return q


LAYOUTS = [(4, 32, True, False), (4, 128, False, False), (8, 32, True, False), (8, 64, False, False),
           (4, 32, False, True)]


@needs_kernels
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: f"{c[0]}bit-g{c[1]}{'-q4_1' if c[3] else ''}")
@pytest.mark.parametrize("rows", [1, 7, 20, 40])
def test_quantized_kernels_match_the_reference(kernels, layout, rows):
    bits, group, symmetric, offsets = layout
    n, k = 72, 256
    q = weights(bits, group, symmetric, n, k, offsets)
    packed = PackedWeight.pack(q)
    bias = torch.randn(n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    w = q.dequantize()
    exact = QuantPlan(kernels, [packed], [bias], QuantPlan.EXACT)(x)
    torch.testing.assert_close(exact, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    got = QuantPlan(kernels, [packed], [bias], QuantPlan.INT8_BLOCKS)(x)
    xr = fake_quantize_blocks(x, packed.sub_blocks * 32)  # every count of rows: int8 x (quant.h's canonical sum)
    torch.testing.assert_close(got, F.linear(xr, w, bias), rtol=1e-5, atol=1e-4)
    if rows > 1:  # each row exactly as it comes alone: batches, chunks and speculative steps change no token
        alone = torch.cat([QuantPlan(kernels, [packed], [bias], QuantPlan.INT8_BLOCKS)(x[i:i + 1])
                           for i in range(rows)])
        assert torch.equal(got, alone)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 9, 40])
@pytest.mark.parametrize("k", [200, 384])  # 200: a tail of 8 past whole blocks of 32 (vdpbf16ps' masked loads)
def test_linear_matches_torch(kernels, dtype, rows, k):
    """bf16 x and weights below the sgemm's rows run vdpbf16ps in the avx512-bf16 build; the rest widen."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, k, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    expected = F.linear(x.float(), w.float(), b.float())
    tolerance = dict(rtol=2 ** -7, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    got = kernels.linear(x, w, b)
    torch.testing.assert_close(got.float(), expected, **tolerance)
    if dtype == torch.bfloat16 and kernels.variant == "avx512-bf16" and 1 < rows < 16:  # vdpbf16ps tiles
        assert torch.equal(got, torch.cat([kernels.linear(x[i:i + 1], w, b) for i in range(rows)]))
    parts = kernels.linear_parts(x, [w[:40], w[40:]], [b[:40], None])
    torch.testing.assert_close(parts.float(), F.linear(x.float(), w.float(), torch.cat([b[:40], 0 * b[40:]]).float()),
                               **tolerance)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_linear_matches_torch(kernels, dtype):
    g = torch.Generator().manual_seed(4)
    w_gate, w_up = (torch.randn(72, 200, generator=g).to(dtype) for _ in range(2))
    b_gate, b_up = (torch.randn(72, generator=g).to(dtype) for _ in range(2))
    x = torch.randn(1, 1, 200, generator=g).to(dtype)
    expected = F.silu(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)  # torch's roundings in the dtype
    tolerance = dict(rtol=2 ** -6, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.linear_gated(x, w_gate, w_up, b_gate, b_up).float(), expected.float(),
                               **tolerance)


def test_best_variant_follows_the_flags():
    avx2 = {"avx2", "fma"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c"}
    assert best_variant(set()) is None
    assert best_variant({"avx2"}) is None  # no FMA
    assert best_variant(avx2) == "avx2"
    assert best_variant(avx512 - {"avx512vl"}) == "avx2"
    assert best_variant(avx512 - {"f16c"}) == "avx2"  # the AVX-512 builds convert fp16 KV with F16C
    assert best_variant(avx512) == "avx512"
    assert best_variant(avx512 | {"avx512_vnni"}) == "avx512-vnni"
    assert best_variant(avx512 | {"avx512_bf16"}) == "avx512"  # bf16 builds on vnni
    assert best_variant(avx512 | {"avx512_vnni", "avx512_bf16"}) == "avx512-bf16"
    with pytest.raises(ValueError, match="unknown kernel variant"):
        kernel_variant("sse2")


@needs_kernels
def test_the_best_variant_is_loaded_and_reported():
    assert cpu_kernels().variant == (os.environ.get("RUVLLM_KERNEL_VARIANT") or best_variant())
    env = {**os.environ, "RUVLLM_KERNEL_VARIANT": "avx2"}
    out = subprocess.run([sys.executable, "-m", "ruvllm_cli", "info", "--json"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    report = json.loads(out)["cpu_kernels"]
    assert report["variant"] == "avx2" and report["forced"] == "avx2"
    assert report["available"] == [name for name in VARIANTS if variant_fits(name)]
    assert "avx2" in report["cpu_flags"]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [37, 400])
def test_silu_gate_matches_torch(kernels, dtype, rows):
    """The prefill MLP's hidden layer (rk_gate): F.silu(gate) * up with torch's roundings. N = 100 gives
    164 rows a chunk: 37 rows are one chunk on the calling thread, 400 rows three on the pool (the last short)."""
    y = (torch.randn(rows, 2 * 100, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    gate, up = y.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    tolerance = dict(rtol=2 ** -7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    got = kernels.silu_gate(y)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)


@needs_kernels
@pytest.mark.parametrize("layout", [c for c in LAYOUTS if c[1] == 32 or c[:2] == (4, 128)], ids=lambda c: f"{c[0]}bit-g{c[1]}{'-q4_1' if c[3] else ''}{'-sym' if c[2] else ''}")
def test_batched_tiles_over_row_blocks(kernels, layout):
    """K = 2048: qtile.c's 512-bit tiles take x in blocks of 8 rows (16 KB of int8 x), so 21 rows run
    as blocks of 8, 8 and 5 against each chunk of W; every row still equals itself alone."""
    bits, group, symmetric, offsets = layout
    n, k, rows = 40, 2048, 21
    q = weights(bits, group, symmetric, n, k, offsets)
    packed = PackedWeight.pack(q)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5))
    got = QuantPlan(kernels, [packed], [None], QuantPlan.INT8_BLOCKS)(x)
    xr = fake_quantize_blocks(x, packed.sub_blocks * 32)
    torch.testing.assert_close(got, F.linear(xr, q.dequantize()), rtol=1e-5, atol=2e-4)
    alone = torch.cat([QuantPlan(kernels, [packed], [None], QuantPlan.INT8_BLOCKS)(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(got, alone)


@needs_kernels
@pytest.mark.parametrize("layout", LAYOUTS + [(8, 1040, True, False)],
                         ids=lambda c: f"{c[0]}bit-g{c[1]}{'-q4_1' if c[3] else ''}")
@pytest.mark.parametrize("shape", [(72, 256, 45), (200, 1040, 70)], ids=lambda s: "x".join(map(str, s)))
def test_prefill_panels_match_the_reference(kernels, layout, shape):
    """A prefill chunk: int8 x in qpanel.c's panels on AVX-512 VNNI builds (sgemm on exact x elsewhere).
    N = 72 / 200: a last panel of 8 live rows; K = 1040: 33 sub-blocks (zero-padded past K, a last group
    of 2 sub-blocks at g128; g1040: one group a row, as per-channel int8); 45 / 70 rows: a last block of
    3 / 4 rows of x; two parts (one job over both, as fused qkv) and a bias."""
    bits, group, symmetric, offsets = layout
    n, k, rows = shape
    q, q2 = weights(bits, group, symmetric, n, k, offsets), weights(bits, group, symmetric, 48, k, offsets)
    packed, packed2 = PackedWeight.pack(q), PackedWeight.pack(q2)
    bias = torch.randn(n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6))
    plan = QuantPlan(kernels, [packed, packed2], [bias, None], QuantPlan.INT8_BLOCKS)
    got = plan(x)
    assert kernels.int8_rows_for(bits) > rows  # int8 x for every count of rows, in every build
    xr = fake_quantize_blocks(x, packed.sub_blocks * 32)
    expected = torch.cat([F.linear(xr, q.dequantize(), bias), F.linear(xr, q2.dequantize())], -1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=3e-4)
    # the panels (VNNI builds, 32 rows and more) and the virtual panels (the rest) compute the same bits
    some = [0, 1, rows // 2, rows - 1]
    assert torch.equal(got[some], torch.cat([plan(x[i:i + 1]) for i in some]))
    assert torch.equal(got[:7], plan(x[:7]))
    for few in (2, 3, 5):  # qrow.c's row-wise dots (AVX-512 VNNI builds, 1-31 rows; x rows 4 a pass): the same bits
        assert torch.equal(got[:few], plan(x[:few]))


def _rows(q: QuantizedWeight, lo: int, hi: int) -> QuantizedWeight:
    take = lambda t: None if t is None else t[lo:hi].contiguous()  # noqa: E731
    return QuantizedWeight(take(q.codes), take(q.scales), take(q.zero_points), q.bits, q.block_size,
                           q.in_features, q.symmetric, take(q.offsets))


@needs_kernels
@pytest.mark.parametrize("layout", LAYOUTS + [(8, 96, True, False)],
                         ids=lambda c: f"{c[0]}bit-g{c[1]}{'-q4_1' if c[3] else ''}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [20, 256])
def test_gated_product_equals_the_whole_product_gated(kernels, layout, dtype, rows):
    """silu(gate(x)) * up(x) in one call (a SiLU MLP's hidden layer; 20 rows: a batch in tiles, the product
    whole; one row: tests/quant/test_quant_kernels.py). With both parts in panels (a prefill on
    VNNI builds) quant.c makes the [rows, 2N] product in column blocks of about 512 KiB (gated_blocks): here
    N = 1100 at 256 rows on 2 threads is 6 blocks in fp32 (192 columns: 2 chunks of 96 rows; the last 140: a
    partial panel) and 3 in bf16; g96 is one group a row (per-channel int8).
    Every value equals the whole product gated (QuantPlan without gated, then silu_gate) bit for bit, and
    the reference on x as the kernels round it."""
    bits, group, symmetric, offsets = layout
    n, k = 1100, 96
    both = weights(bits, group, symmetric, 2 * n, k, offsets)
    gate, up = _rows(both, 0, n), _rows(both, n, 2 * n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    plan = QuantPlan(kernels, [PackedWeight.pack(gate), PackedWeight.pack(up)], [bias, None], QuantPlan.INT8_BLOCKS)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = plan(x, gated=True)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert torch.equal(got, kernels.silu_gate(plan(x)))
    xr = fake_quantize_blocks(x.float(), 128)
    expected = F.silu(F.linear(xr, gate.dequantize(), bias)) * F.linear(xr, up.dequantize())
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), expected, rtol=2 ** -6, atol=3e-2)
    else:  # fp32: no further from the float64 result than torch's own fp32 product (x2), which is ~1e-3 off
        xd = xr.double()
        exact = F.silu(F.linear(xd, gate.dequantize().double(), bias.double())) * F.linear(xd, up.dequantize().double())
        yardstick = (expected.double() - exact).abs().max().item()
        assert (got.double() - exact).abs().max().item() <= 2 * yardstick + 1e-6 * exact.abs().max().item()


def per_group_layout(p: PackedWeight) -> PackedWeight:
    """p as PackedWeight held every layout before one zero point became one byte: an [N, ng] zero-point
    tensor, and mins = s * z' in fp32 wherever a z' is not 0 (Q4_0: 8 s). The kernels still take it."""
    zeros = p.zero_points.contiguous()
    z = zeros.float() - (128 if p.bits == 8 else 0)
    mins = p.mins if p.offsets is not None else (p.scales * z).contiguous() if bool(z.any()) else None
    return PackedWeight(p.codes, p.scales, zeros, mins, p.bits, p.block_size, p.in_features, p.symmetric, p.spg,
                        p.offsets)


@needs_kernels
@pytest.mark.parametrize("layout", [c for c in LAYOUTS if c[2]] + [(8, 1040, True, False)],
                         ids=lambda c: f"{c[0]}bit-g{c[1]}")
@pytest.mark.parametrize("rows", [1, 7, 20, 45])
def test_one_zero_point_gives_the_per_group_layouts_outputs_bit_for_bit(kernels, layout, rows):
    """Symmetric layouts hold one zero point and no mins; every path (decode rows, tiles, panels or sgemm, the
    exact path) takes s * z' from the scales and gives the per-group layout's floats exactly (zp * s is the one
    rounding of s * z' the mins held)."""
    bits, group, symmetric, offsets = layout
    k = 256 if group < 1040 else 1040
    q, q2 = weights(bits, group, symmetric, 72, k, offsets), weights(bits, group, symmetric, 40, k, offsets)
    packed, packed2 = PackedWeight.pack(q), PackedWeight.pack(q2)
    assert packed.mins is None and packed.zero == (8 if bits == 4 else 128)
    assert packed.nbytes == packed.codes.numel() + packed.scales.numel() * 4 + 1  # no mins, one zero point byte
    old, old2 = per_group_layout(packed), per_group_layout(packed2)
    assert (old.mins is not None) == (bits == 4) and old.nbytes > packed.nbytes
    bias = torch.randn(72)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    for mode in (QuantPlan.INT8_BLOCKS, QuantPlan.EXACT):
        new = QuantPlan(kernels, [packed, packed2], [bias, None], mode)(x)
        assert torch.equal(new, QuantPlan(kernels, [old, old2], [bias, None], mode)(x)), mode
        expected = torch.cat([F.linear(x, q.dequantize(), bias), F.linear(x, q2.dequantize())], -1)
        if mode == QuantPlan.EXACT:
            torch.testing.assert_close(new, expected, rtol=1e-5, atol=3e-4)


@needs_kernels
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: f"{c[0]}bit-g{c[1]}{'-q4_1' if c[3] else ''}")
def test_amx_rows_give_each_row_its_bits_alone(kernels, layout):
    """16+ rows of x take qamx.c's tile dots where Linux grants AMX (else qrow.c's; kernels.amx(False) forces that):
    40 W rows = 2 blocks of 16 on the tiles + 8 on qrow.c, 19 rows = 16 on the tiles + 3 on qrow.c, K = 160 an odd
    count of sub-blocks where the group allows (else 384). Each row equals itself alone (decode's qrow.c path), with
    and without AMX."""
    bits, group, symmetric, offsets = layout
    k = 160 if 160 % group == 0 else 384
    q = weights(bits, group, symmetric, 40, k, offsets)
    packed = PackedWeight.pack(q)
    plan = QuantPlan(kernels, [packed], [None], QuantPlan.INT8_BLOCKS)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(7))
    alone = torch.cat([plan(x[i:i + 1]) for i in range(len(x))])
    try:
        for on in (True, False):
            kernels.amx(on)
            for rows in (16, 19):
                got = plan(x[:rows])
                assert torch.equal(got, alone[:rows]), f"amx={on}: {rows} rows differ from each row alone"
    finally:
        kernels.amx(True)
    xr = fake_quantize_blocks(x, packed.sub_blocks * 32)
    torch.testing.assert_close(alone, F.linear(xr, q.dequantize()), rtol=1e-5, atol=2e-4)
