"""The Triton weight-only matmul (py_engine/gpu/quant_matmul.py) against dequantize-then-matmul.

Every layout QuantLinear packs (int8 per channel and in groups with zero
points, 4-bit groups of 32-256 and one group a row, 3- and 2-bit codes),
decode (1 and 3 rows: the GEMV and the tl.dot kernel each) and prefill (37 rows), fp32 and fp16 under Triton's
interpreter (conftest.py sets TRITON_INTERPRET=1 without a GPU), bf16 too on a
GPU, split-K forced on. On a GPU, QuantLinear's CUDA forward runs this kernel.
"""
from __future__ import annotations

import os

import pytest
import torch

from py_engine.quant.linear import QuantLinear, reference_forward
from tests.quant.test_quant_kernels import LAYOUTS, make_weight

pytest.importorskip("triton", reason="triton is not installed (make test installs triton==3.9.0)")
from py_engine.gpu.quant_matmul import GEMV_ROWS, pick_kernel, quant_matmul  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
PACKED = [layout for layout in LAYOUTS if layout[1] != 16]  # groups of 16 have no kernel layout


def relative_error(got, want):
    return ((got.float().cpu() - want.float().cpu()).norm() / want.float().cpu().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 37])
@pytest.mark.parametrize("layout", PACKED, ids=lambda x: "b{}-g{}-{}-{}x{}".format(*x))
def test_quant_matmul_equals_dequantize_then_matmul(layout, rows, dtype):
    layer = QuantLinear.from_weight(make_weight(*layout)).to(DEVICE)
    x = torch.randn(rows, layout[4], generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEVICE)
    want = reference_forward(layer, x)  # float32, from the same rounded x
    other = "mma" if pick_kernel(rows, layout[0]) == "gemv" else "gemv"  # the kernel not picked, forced
    runs = [(None, None), (3, None)] + ([(None, other)] if rows <= GEMV_ROWS else [])  # (GEMV: decode rows)
    for split_k, kernel in runs:
        got = quant_matmul(x, layer.packed, split_k=split_k, kernel=kernel)
        assert got.dtype == dtype and got.shape == (rows, layout[3])
        assert relative_error(got, want) < TOLERANCE[dtype], (split_k, kernel)


def test_quant_matmul_refuses_a_wrong_x():
    layer = QuantLinear.from_weight(make_weight(*PACKED[0])).to(DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        quant_matmul(torch.zeros(2, 7, device=DEVICE), layer.packed)


@pytest.mark.skipif(not ON_GPU, reason="GPU: QuantLinear takes this kernel on CUDA only (the CPU has quant.c)")
@pytest.mark.parametrize("layout", [PACKED[1], PACKED[3], PACKED[7]], ids=str)
def test_quant_linear_on_cuda_runs_the_triton_kernel(layout):
    layer = QuantLinear.from_weight(make_weight(*layout), torch.randn(layout[3])).to("cuda")
    x = torch.randn(5, layout[4], device="cuda", dtype=torch.bfloat16)
    got = layer(x)
    assert layer._device_weight[0] == "triton"
    assert relative_error(got, reference_forward(layer, x)) < 1e-2


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("rows,kernel", [(1, "gemv"), (1, "mma"), (37, "mma")])
def test_gguf_blocks_with_one_zero_point(qtype, rows, kernel):
    """GGUF layouts as the loader packs them (importers/gguf: one zero-point byte, read through zero strides;
    Q4_1's float minimum per block as offsets) against gguf's own dequantization of the same blocks."""
    from tests.importers.test_gguf_native_kernels import tensor
    from py_engine.importers.gguf.quantized import gguf_packed

    t, ref = tensor(qtype, n=64, k=128)
    packed = gguf_packed(t)
    assert packed.zero_points.stride() == (0, 0) and (packed.mins is None) == (qtype != "Q4_1")
    packed = packed.to(DEVICE)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    got = quant_matmul(x, packed, kernel=kernel)
    assert relative_error(got, x.cpu() @ ref.T) < 1e-5
