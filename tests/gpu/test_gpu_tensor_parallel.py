"""Tensor parallelism on CUDA: the check to run where a GPU is lent (here every case skips with "GPU: ...").

    python -m pytest tests/gpu/test_gpu_tensor_parallel.py -q -s      # ~1-2 min on one H100

One GPU (what the lead's machine has): two ranks share cuda:0 over gloo (RUVLLM_TP_ONE_DEVICE=1,
RUVLLM_TP_BACKEND=gloo): the sharded model's CUDA path (Triton paged attention and the Triton quantized
matmul over sliced codes and scales, each rank's share of the paged cache) against TP=1 on the same GPU.
NCCL itself needs two GPUs (NCCL refuses two ranks on one device): those cases skip with one GPU.
References: TP=1 on the same device (itself tested against the CPU engine and transformers in tests/gpu and
tests/server). Tolerances: fp32 1e-4 (cuBLAS picks kernels by shape, so a half-width matmul may sum in
another order), bf16 by greedy tokens with near-ties (top-2 margin < 0.5) allowed, margins printed.
"""
from __future__ import annotations

import pytest
import torch

from py_engine import LLM, SamplingParams

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
one_gpu = pytest.mark.skipif(GPUS < 1, reason="GPU: no CUDA device (the tensor-parallel CUDA path needs one)")
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"GPU: NCCL tensor parallelism needs 2 CUDA devices, found {GPUS}")
NEAR_TIE = 0.5


def _logits(llm, ids, tokens):
    backend = llm._new_backend()
    out = [backend.prefill(ids)]
    out += [backend.decode(t) for t in tokens[:-1]]
    return torch.stack(out).float().cpu()


def _compare(model, dtype, tolerance, **tp):
    one = LLM(model, device="cuda", dtype=dtype)
    two = LLM(model, device="cuda", dtype=dtype, tensor_parallel_size=2, **tp)
    try:
        ids = one.encode("The history of the printing press")
        tokens = one.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)).token_ids
        ref, got = _logits(one, ids, tokens), _logits(two, ids, tokens)
        top2 = ref.topk(2, dim=-1).values
        margins = top2[:, 0] - top2[:, 1]
        differ = ref.argmax(-1) != got.argmax(-1)
        print(f"{model} {dtype}: max |dlogit| {float((ref - got).abs().max()):.2e}, {int(differ.sum())} argmax "
              f"differ at margins {[round(float(m), 3) for m in margins[differ]]}")
        if tolerance is not None:
            assert (ref - got).abs().max() < tolerance
        assert bool((margins[differ] < NEAR_TIE).all())
    finally:
        two.close()


def _engine_greedy():
    from native_server.engine import LLMEngine
    from py_engine.sampling_params import SamplingParams as Params

    prompts = ["ROMEO:", "JULIET: O Romeo, Romeo", "First Citizen:\nBefore we proceed any further"]

    def run(engine):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", engine.tokenizer.encode(p), Params(temperature=0, max_tokens=24))
        out: dict = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(t for d in o.outputs for t in d.token_ids)
        return out

    options = dict(device="cuda", dtype="float32", kv_cache_memory=256 << 20)  # two ranks may share one GPU
    one = LLMEngine("tiny-shakespeare", **options)
    two = LLMEngine("tiny-shakespeare", tensor_parallel_size=2, **options)
    try:
        assert run(two) == run(one)
    finally:
        two.close()


@pytest.fixture
def shared_gpu(monkeypatch):
    monkeypatch.setenv("RUVLLM_TP_ONE_DEVICE", "1")  # inherited by the spawned rank
    monkeypatch.setenv("RUVLLM_TP_BACKEND", "gloo")


@one_gpu
@pytest.mark.parametrize("model, dtype, tolerance", [("tiny-shakespeare", "float32", 1e-4),
                                                     ("tiny-shakespeare", "bfloat16", None),
                                                     ("smollm2-135m-instruct", "float32", None)])
def test_two_ranks_on_one_gpu_over_gloo(shared_gpu, model, dtype, tolerance):
    _compare(model, dtype, tolerance)


@one_gpu
def test_engine_two_ranks_on_one_gpu_over_gloo(shared_gpu):
    _engine_greedy()


@two_gpus
@pytest.mark.parametrize("model, dtype, tolerance", [("tiny-shakespeare", "float32", 1e-4),
                                                     ("smollm2-135m-instruct", "bfloat16", None)])
def test_nccl_two_gpus(model, dtype, tolerance):
    _compare(model, dtype, tolerance)


@two_gpus
def test_engine_nccl_two_gpus():
    _engine_greedy()
