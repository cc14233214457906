"""Tensor parallelism on a CUDA machine: one self-contained check, run from the repository root.

    python scripts/gpu_check_tp.py            # ~1-3 min; prints PASS / FAIL / SKIP per check, exits 1 on a FAIL
    python scripts/gpu_check_tp.py --device cpu   # the same comparisons on CPU over gloo (a dry run of this script)

With 2+ GPUs: TP=2 over NCCL (rank r on cuda:r), the default on CUDA, against TP=1 on cuda:0.
With 1 GPU: NCCL needs a GPU per rank (two ranks on one device are refused by NCCL), so it checks
  - NCCL itself: a one-rank NCCL process group's all_reduce and broadcast on cuda:0 (the library loads,
    the communicator forms from the project's FileStore rendezvous, collectives run);
  - the sharded model's CUDA path: two ranks sharing cuda:0 over gloo (RUVLLM_TP_ONE_DEVICE=1,
    RUVLLM_TP_BACKEND=gloo), each with its half of the heads, its Triton paged-attention share, and the
    quantized matmul over its slice of codes and scales;
  and prints "SKIP GPU: NCCL across ranks needs 2 CUDA devices, found 1".
Comparisons (reference: TP=1 on the same device, itself checked against transformers in tests/gpu):
  fp32 logits within 1e-4 (cuBLAS picks kernels by shape: a half-width matmul may sum in another order) and
  greedy tokens equal or near-ties (top-2 margin < 0.5, margins printed); bf16 and the Q4_1 GGUF (SmolLM2) by
  greedy tokens with near-ties; the server engine's greedy tokens for 3 prompts, TP=2 against TP=1.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NEAR_TIE = 0.5
RESULTS: list[tuple[str, str, str]] = []


def report(status: str, name: str, detail: str = "") -> None:
    RESULTS.append((status, name, detail))
    print(f"{status:4s} {name}{': ' + detail if detail else ''}", flush=True)


def check(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.monotonic()
            try:
                detail = fn(*args, **kwargs)
                report("PASS", name, f"{detail or ''} ({time.monotonic() - start:.1f} s)".strip())
            except Exception as exc:  # noqa: BLE001 - every check reports, the next one runs
                traceback.print_exc()
                report("FAIL", name, f"{type(exc).__name__}: {exc}")
        return run
    return wrap


@check("NCCL one-rank process group on cuda:0 (all_reduce, broadcast)")
def nccl_one_rank() -> str:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    folder = tempfile.mkdtemp(prefix="ruvllm-nccl-check-")
    store = dist.FileStore(os.path.join(folder, "store"), 1)  # the project's rendezvous (parallel/comm.py)
    group = dist.ProcessGroupNCCL(dist.PrefixStore("compute/", store), 0, 1, dist.ProcessGroupNCCL.Options())
    try:
        t = torch.arange(1024, dtype=torch.float32, device="cuda:0")
        expect = t.clone()
        group.allreduce([t]).wait()
        group.broadcast([t], 0).wait()
        torch.cuda.synchronize()
        assert torch.equal(t, expect), "a one-rank all_reduce changed the tensor"
    finally:
        if hasattr(group, "shutdown"):
            group.shutdown()
    version = torch.cuda.nccl.version()
    return f"NCCL {'.'.join(map(str, version)) if isinstance(version, tuple) else version}"


def _logits(llm, ids, tokens):
    import torch

    backend = llm._new_backend()
    out = [backend.prefill(ids)] + [backend.decode(t) for t in tokens[:-1]]
    return torch.stack(out).float().cpu()


def compare(model: str, device: str, dtype: str, tolerance: float | None) -> str:
    """TP=2 against TP=1: logits over a 32-token greedy continuation (teacher-forced), argmax agreement."""
    from py_engine import LLM, SamplingParams

    one = LLM(model, device=device, dtype=dtype)
    two = LLM(model, device=device, dtype=dtype, tensor_parallel_size=2)
    try:
        ids = one.encode("The history of the printing press")
        tokens = one.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)).token_ids
        ref, got = _logits(one, ids, tokens), _logits(two, ids, tokens)
        top2 = ref.topk(2, dim=-1).values
        margins = top2[:, 0] - top2[:, 1]
        differ = ref.argmax(-1) != got.argmax(-1)
        gap = float((ref - got).abs().max())
        detail = f"max |dlogit| {gap:.2e}, {int(differ.sum())}/{len(tokens)} argmax differ at margins " \
                 f"{[round(float(m), 3) for m in margins[differ]]}"
        if tolerance is not None and gap >= tolerance:
            raise AssertionError(f"{detail}; want < {tolerance}")
        if not bool((margins[differ] < NEAR_TIE).all()):
            raise AssertionError(f"{detail}; a differing token is not a near-tie (< {NEAR_TIE})")
        return detail
    finally:
        two.close()


def engine_greedy(device: str) -> str:
    from native_server.engine import LLMEngine
    from py_engine.sampling_params import SamplingParams

    prompts = ["ROMEO:", "JULIET: O Romeo, Romeo", "First Citizen:\nBefore we proceed any further"]

    def run(engine) -> dict:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", engine.tokenizer.encode(p), SamplingParams(temperature=0, max_tokens=24))
        out: dict = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(t for d in o.outputs for t in d.token_ids)
        return out

    options = dict(device=device, dtype="float32", kv_cache_memory=256 << 20)  # two ranks may share one GPU
    one = LLMEngine("tiny-shakespeare", **options)
    two = LLMEngine("tiny-shakespeare", tensor_parallel_size=2, **options)
    try:
        a, b = run(one), run(two)
        assert a == b, f"TP=2 {b} != TP=1 {a}"
    finally:
        two.close()
    return f"{sum(map(len, a.values()))} tokens equal"


def model_checks(device: str, how: str) -> None:
    cases = [("tiny-shakespeare", "float32", 1e-4), ("tiny-shakespeare", "bfloat16", None),
             ("smollm2-135m-instruct", "float32", None)]  # SmolLM2: its Q4_1 GGUF codes and scales sliced
    if device == "cpu":
        cases = [(m, "float32", 1e-5 if m == "tiny-shakespeare" else None) for m in dict.fromkeys(c[0] for c in cases)]
    for model, dtype, tolerance in cases:
        check(f"TP=2 {how} vs TP=1, {model} {dtype}")(compare)(model, device, dtype, tolerance)
    check(f"engine TP=2 {how} vs TP=1, greedy tokens")(engine_greedy)(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs "
          f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}", flush=True)
    if args.device == "cpu":
        model_checks("cpu", "over gloo (CPU)")
    elif not torch.cuda.is_available():
        report("SKIP", "everything", "GPU: no CUDA device (use --device cpu for a dry run)")
    else:
        for name in ("RUVLLM_TP_ONE_DEVICE", "RUVLLM_TP_BACKEND"):
            os.environ.pop(name, None)
        if torch.cuda.device_count() >= 2:
            model_checks("cuda", "over NCCL (cuda:0, cuda:1)")
        else:
            nccl_one_rank()
            report("SKIP", "TP=2 over NCCL", "GPU: NCCL across ranks needs 2 CUDA devices, found 1")
            os.environ.update(RUVLLM_TP_ONE_DEVICE="1", RUVLLM_TP_BACKEND="gloo")  # inherited by the spawned rank
            model_checks("cuda", "over gloo, both ranks on cuda:0")
    failed = [r for r in RESULTS if r[0] == "FAIL"]
    print(f"\n{len(RESULTS) - len(failed)} passed or skipped, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
