"""The Triton matmul over ggml's blocks (py_engine/gpu/ggml_matmul.py: Q5_0, Q5_1, Q2_K ... Q6_K as the file holds
them) against gguf's own dequantization of the same blocks, then a float matmul: decode (1 and 3 rows) and prefill
(37 rows), split-K forced too, fp32 and fp16 under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1
without a GPU), bf16 too on a GPU, where QuantLinear's CUDA forward runs this kernel
(scripts/gpu_check_kquants.py is the same check as a script for a GPU machine)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (make test installs triton==3.9.0)")
pytest.importorskip("gguf")
from py_engine.gpu.ggml_matmul import ggml_matmul  # noqa: E402
from py_engine.importers.gguf.quantized import gguf_blocks  # noqa: E402
from py_engine.quant.ggml import TYPES  # noqa: E402
from py_engine.quant.linear import QuantLinear  # noqa: E402
from tests.importers.test_gguf_kquants import tensor  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def relative_error(got, want):
    return ((got.float().cpu() - want.float().cpu()).norm() / want.float().cpu().norm()).item()


CASES = [(q, rows, torch.float32) for q in TYPES for rows in (1, 37)] + [  # fp16 (and bf16 on a GPU): a few
    (q, 3, dtype) for q in ("Q4_K", "Q6_K", "Q5_1") for dtype in DTYPES[1:]]


@pytest.mark.parametrize("qtype,rows,dtype", CASES, ids=str)
def test_ggml_matmul_equals_gguf_dequantize_then_matmul(qtype, rows, dtype):
    t, ref = tensor(qtype, n=45, k=512)
    weight = gguf_blocks(t).to(DEVICE)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    want = x.float() @ ref.T
    for split_k in (None, 3):
        got = ggml_matmul(x.to(DEVICE), weight, split_k=split_k)
        assert got.dtype == dtype and got.shape == (rows, 45)
        assert relative_error(got, want) < TOLERANCE[dtype], split_k


def test_ggml_matmul_refuses_a_wrong_x():
    weight = gguf_blocks(tensor("Q4_K", n=8, k=256)[0]).to(DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        ggml_matmul(torch.zeros(2, 7, device=DEVICE), weight)


@pytest.mark.skipif(not ON_GPU, reason="GPU: QuantLinear takes this kernel on CUDA only (the CPU has kquant.c)")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0"])
def test_quant_linear_on_cuda_runs_the_triton_kernel(qtype):
    t, ref = tensor(qtype, n=64, k=512)
    layer = QuantLinear(gguf_blocks(t), torch.randn(64)).to("cuda")
    x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    got = layer(x)
    assert layer._device_weight[0] == "triton"
    assert relative_error(got, x.float().cpu() @ ref.T + layer.bias.float().cpu()) < 1e-2
