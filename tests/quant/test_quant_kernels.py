"""Quantized matmul kernels against dequantize-then-matmul (`reference_forward`).

- every layout the quantizers produce: int8 per channel, 4-bit groups of
  32..256 with and without zero points, a last group cut short (K not a
  multiple of the group), one group a row with K not a multiple of 32, 2 and
  3-bit codes (GPTQ/AWQ) through the 4-bit path, groups of 16 (no kernel:
  the dequantizing fallback); fp32 and bf16 activations, one row (decode)
  and 37 rows (prefill);
- the decode path that rounds x to int8 per 32 values against that same
  product in float (its only extra error), the exact path against the
  reference directly;
- fused parts against the parts one by one, W8A8 against its fake-quantized
  reference, `.qweight` giving back the bytes it was built from;
- CUDA (torch's int8/int4 kernels) where there is a GPU.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.cpu.transforms import FusedLinear  # noqa: E402
from py_engine.quant.kernels import fake_quantize_blocks, fake_quantize_rows  # noqa: E402
from py_engine.quant.linear import QuantLinear, W8A8Linear, reference_forward  # noqa: E402
from py_engine.quant.rtn import QuantizedWeight, quantize_rtn  # noqa: E402
from tests.requires import GPU, kernels_missing  # noqa: E402

KERNELS = cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason=str(kernels_missing()))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{GPU}no CUDA GPU on this machine")

# (bits, group, symmetric, N, K)
LAYOUTS = [
    (8, None, True, 48, 200),   # int8 per channel, K not a multiple of 32
    (8, 64, False, 40, 320),    # 8-bit groups with zero points
    (4, 32, False, 37, 96),
    (4, 64, True, 40, 320),
    (4, 128, False, 50, 200),   # last group of 72
    (4, 256, True, 24, 512),
    (4, None, False, 30, 200),  # one group a row, K % 32 != 0
    (3, 32, False, 33, 160),
    (2, 64, True, 20, 256),
    (4, 16, False, 24, 64),     # no kernel layout: dequantize-then-matmul
]


def make_weight(bits: int, group: int | None, symmetric: bool, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    if bits in (4, 8):
        return quantize_rtn(torch.randn(n, k, generator=g), bits, group, symmetric)
    block = group or k  # 2/3-bit codes as GPTQ/AWQ give them
    blocks = -(-k // block)
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (n, blocks * block), generator=g, dtype=torch.uint8)
    zeros = (torch.full((n, blocks), 1 << (bits - 1), dtype=torch.uint8) if symmetric
             else torch.randint(0, top + 1, (n, blocks), generator=g, dtype=torch.uint8))
    scales = torch.rand(n, blocks, generator=g) * 0.1 + 0.01
    return QuantizedWeight(codes, scales, zeros, bits, block, k, symmetric)


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: summation order only; bf16: one output rounding (2^-8 relative) on top."""
    scale = expected.abs().max().item()
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=2e-3 * scale)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


@needs_kernels
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: f"{c[0]}bit-g{c[1]}-{'sym' if c[2] else 'asym'}-K{c[4]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_kernel_matches_dequantize_then_matmul(layout, dtype, rows):
    bits, group, symmetric, n, k = layout
    q = make_weight(bits, group, symmetric, n, k)
    layer = QuantLinear.from_weight(q, torch.randn(n))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = reference_forward(layer, x)
    layer.int8_activations = False  # exact: fp32 products of the dequantized codes
    assert_matches(layer(x), expected)
    layer.int8_activations = True  # decode: x rounded to int8 per 32 values, else the same product
    got = layer(x)
    if rows < KERNELS.int8_rows_for(bits) and layer.packed is not None:  # integer tiles, 4-bit prefill panels
        xq = fake_quantize_blocks(x, layer.packed.sub_blocks * 32)
        assert_matches(got, F.linear(xq, q.dequantize(), layer.bias))
        assert (got.float() - expected).abs().max() < 0.02 * expected.abs().max()  # int8 rounding of x
    else:  # prefill (or a layout no kernel takes): sgemm on the dequantized rows
        assert_matches(got, expected)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: f"{c[0]}bit-g{c[1]}")
def test_qweight_gives_back_its_bytes(layout):
    q = make_weight(*layout)
    back = QuantLinear.from_weight(q).qweight
    for name in ("codes", "scales", "zero_points"):
        assert torch.equal(getattr(back, name), getattr(q, name)), name
    assert (back.bits, back.block_size, back.in_features, back.symmetric) == (q.bits, q.block_size,
                                                                               q.in_features, q.symmetric)
    assert torch.equal(QuantLinear.from_weight(q).dequantize(), q.dequantize())
    mine = QuantizedWeight(q.codes.clone(), q.scales, q.zero_points, q.bits, q.block_size, q.in_features,
                           q.symmetric)
    consumed = QuantLinear(mine, consume=True)  # packs 8-bit codes in place: the same layer all the same
    if q.bits == 8 and q.codes.shape[1] % 32 == 0:
        assert consumed.packed.codes.data_ptr() == mine.codes.data_ptr()  # no second copy
    for name in ("codes", "scales", "zero_points"):
        assert torch.equal(getattr(consumed.qweight, name), getattr(q, name)), name


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_centred_int8_keeps_the_weights_and_centres_the_codes(bits):
    torch.manual_seed(bits)
    n, k = 6, 64
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8)
    zero = torch.randint(0, 2 ** bits, (n, 2), dtype=torch.uint8)
    q = QuantizedWeight(codes, torch.rand(n, 2) + 0.1, zero, bits, 32, k, False, offsets=torch.randn(n, 2))
    c = q.as_centred_int8()
    assert c.bits == 8 and torch.equal(c.dequantize(), q.dequantize())
    mid = 2 ** (bits - 1)  # the code at the middle of the range becomes 128, MatMulNBits' default zero point
    assert torch.equal(c.codes[codes == mid], torch.full_like(c.codes[codes == mid], 128))
    assert torch.equal(c.offsets, q.offsets)


def test_centred_int8_refuses_codes_wider_than_8_bits():
    q = QuantizedWeight(torch.zeros(1, 32, dtype=torch.uint8), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.uint8),
                        9, 32, 32, False)
    with pytest.raises(ValueError, match="9-bit"):
        q.as_centred_int8()


@pytest.mark.parametrize("layout", [(4, 32, True), (4, 128, False), (8, None, True), (8, 64, False)], ids=str)
def test_rtn_tables_packed_in_chunks_equal_one_pack(layout):
    """transform.rtn_packed (the LM head's path: the table quantized and packed ~4M values at a time) in several
    chunks equals PackedWeight.pack of the whole; symmetric layouts hold one zero-point byte and no mins."""
    from py_engine.quant.kernels import PackedWeight
    from py_engine.quant.transform import rtn_packed

    bits, group, symmetric = layout
    w = torch.randn(70, 96, generator=torch.Generator().manual_seed(4))
    whole = PackedWeight.pack(quantize_rtn(w, bits, group, symmetric))
    chunked = rtn_packed(w, bits, group, symmetric, chunk=96 * 16)  # 16 rows a chunk: five chunks
    for name in ("codes", "scales", "zero_points", "mins"):
        a, b = getattr(chunked, name), getattr(whole, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    assert (chunked.zero, chunked.nbytes) == (whole.zero, whole.nbytes)
    if symmetric:
        assert whole.zero == 1 << (bits - 1) and whole.mins is None
        assert whole.nbytes == whole.codes.numel() + whole.scales.numel() * 4 + 1


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_fused_parts_match_one_by_one(dtype, rows):
    k = 192
    parts = [QuantLinear.from_weight(make_weight(4, 64, False, 40, k, seed=1), torch.randn(40)),
             QuantLinear.from_weight(make_weight(4, 32, True, 24, k, seed=2)),
             QuantLinear.from_weight(make_weight(8, None, True, 24, k, seed=3), torch.randn(24).to(dtype))]
    fused = FusedLinear(parts)
    fused.kernels = KERNELS
    x = torch.randn(1, rows, k).to(dtype)
    with torch.inference_mode():
        got, expected = fused(x), torch.cat([p(x) for p in parts], dim=-1)
    assert got.shape == (1, rows, 88) and fused._quant_plan is not None
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
def test_gated_mlp_hidden_in_one_call(dtype, rows):
    from py_engine.quant.linear import gated_forward

    gate, up = (QuantLinear.from_weight(make_weight(4, 32, False, 72, 96, seed=s)) for s in (4, 5))
    fused = FusedLinear([gate, up])
    fused.kernels = KERNELS
    x = torch.randn(1, rows, 96).to(dtype)
    with torch.inference_mode():
        got, expected = gated_forward(fused, x), F.silu(gate(x)) * up(x)
    assert got.shape == (1, rows, 72) and got.dtype == dtype
    assert_matches(got, expected.float())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
def test_w8a8_matches_its_fake_quantized_reference(dtype, rows):
    linear = torch.nn.Linear(200, 48)
    layer = W8A8Linear.from_float(linear)
    x = torch.randn(rows, 200).to(dtype)
    expected = F.linear(fake_quantize_rows(x), layer.dequantize(), linear.bias.detach())
    assert_matches(layer(x), expected)
    assert_matches(reference_forward(layer, x).to(dtype), expected)
    with pytest.raises(ValueError):
        W8A8Linear(quantize_rtn(linear.weight, 4, 32, False))


@needs_kernels
def test_same_result_on_any_thread_count_and_after_to():
    layer = QuantLinear.from_weight(make_weight(4, 128, False, 300, 256))
    x = torch.randn(2, 256)
    threads = KERNELS.threads
    try:
        KERNELS.set_threads(1)
        one = layer(x)
        KERNELS.set_threads(2)
        two = layer(x)
    finally:
        KERNELS.set_threads(threads)
    assert torch.equal(one, two)
    layer.to(torch.bfloat16)  # scales stay float32; the forward follows x's dtype
    assert layer.packed.scales.dtype == torch.float32
    assert torch.equal(layer(x), one)


@needs_cuda
@pytest.mark.parametrize("layout", [(8, None, True, 64, 256), (4, 128, False, 64, 256), (4, 32, True, 64, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 37])
def test_cuda_kernels_match_dequantize_then_matmul(layout, dtype, rows):
    layer = QuantLinear.from_weight(make_weight(*layout), torch.randn(layout[3])).to("cuda")
    x = torch.randn(rows, layout[4], device="cuda").to(dtype)
    expected = reference_forward(layer, x)
    got = layer(x)
    assert got.dtype == dtype
    assert (got.float() - expected).abs().max() < 1e-2 * expected.abs().max()
