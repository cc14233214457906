"""The CPU server's paged decode: attention per layer, torch vs C, and whole decode steps in process.

    .venv/bin/python benchmarks/paged_decode_speed.py [--gguf PATH] [--rounds 3] [--threads 2]

1. One layer's paged attention for decode rows (Qwen2.5-0.5B's heads: 14 over 2 KV heads, head_dim 64,
   16-token blocks): TorchPagedAttention / cold_attention (gather, dequantize, SDPA) against
   CpuPagedAttention (py_engine/kernels/paged.c), 1 and 16 rows, 160- to 4096-token contexts,
   full-precision (fp32) and fp16 blocks (--kv-cache-dtype fp16: half the bytes read) and int8/int4 cold
   blocks (all but the last 128 tokens cold). `--skip-steps --contexts 1024,4096 --kv auto,fp16` runs
   just the fp32 / fp16 pairs (with --skip-steps).
2. Decode steps of an in-process LLMEngine on the Qwen2.5-0.5B-shape Q4_0 GGUF (benchmarks/.cache, made by
   llama_cpp_bench.py): 1 and 16 sequences (prompt 128) with `--attention-backend torch` (before) and `cpu`
   (after: C attention, and a single stream as one rk_decode_step call), against the dense `LLM` on the
   same file at one sequence (the engine a single server stream should be within 10% of).
Settings alternate within each round; times are medians of CPU time (process_time: the machine is shared,
and a descheduled process's wall time says nothing about the code) and of wall time. Attention runs as in
an engine step (kernel_step: torch on one thread, the kernels' pool on --threads; CPU time counts a
pool worker's spinning too). Writes
benchmarks/results/paged_decode_speed.json with the CPU flags.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from common import HERE  # noqa: E402  (also puts the clone's root on sys.path)

from common import machine  # noqa: E402
from native_server.engine.attention import cold as cold_attention  # noqa: E402
from native_server.engine.kv_cache import ColdPool  # noqa: E402
from native_server.engine.attention import TorchPagedAttention, backend_for  # noqa: E402
from py_engine.cpu.transforms import kernel_step  # noqa: E402
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.models import AttentionSpec  # noqa: E402
from py_engine.models.kv_quant import KVQuantConfig  # noqa: E402
from tests.server.test_server_cpu_attention import metadata  # noqa: E402

GGUF = HERE / ".cache" / "qwen2.5-0.5b-random-seed0-gguf" / "qwen-q4_0.gguf"
H, KV, D, BS, HOT = 14, 2, 64, 16, 128


def timed(fn, repeat: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per call."""
    fn()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.process_time() - c0) / repeat * 1e3, (time.perf_counter() - t0) / repeat * 1e3


def attention_case(rows: int, context: int, kv: str):
    """(torch call, C call) of one layer's decode attention."""
    nb = -(-context // BS)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(rows)]
    keys = torch.randn(rows * nb, BS, KV, D)
    values = torch.randn_like(keys)
    spec, quant, cold, counts = AttentionSpec(D ** -0.5), None, None, None
    if kv == "fp16":  # the whole cache in 16 bits, fp32 queries
        keys, values = keys.half(), values.half()
    elif kv != "auto":
        quant = KVQuantConfig(kv, HOT, BS)
        config = SimpleNamespace(num_key_value_heads=KV, head_dim=D, num_hidden_layers=1)
        cold = ColdPool(config, rows * nb, quant, "cpu")
        cold.store(0, torch.arange(rows * nb), keys, values)
        counts = [quant.cold_edge(context - 1) // BS] * rows
    meta = metadata([(context - 1, 1)] * rows, tables, BS, counts)
    q = torch.randn(rows, H, D)
    oracle, fast = TorchPagedAttention(), backend_for("cpu")
    if cold is None:
        return (lambda: oracle.attend(q, keys, values, meta, spec),
                lambda: fast.attend(q, keys, values, fast.prepare(meta), spec))
    return (lambda: cold_attention.attend(q, keys, values, cold, 0, meta, spec, quant),
            lambda: fast.attend_cold(q, keys, values, cold, 0, fast.prepare(meta), spec, quant))


CASES = [(1, 160, "auto"), (16, 160, "auto"), (1, 1024, "auto"), (16, 1024, "auto"), (1, 1024, "fp16"),
         (16, 1024, "fp16"), (16, 1024, "int8"), (1, 1024, "int4"), (16, 1024, "int4"), (16, 4096, "auto"),
         (16, 4096, "fp16")]


def attention_table(rounds: int, cases: list[tuple[int, int, str]] = CASES) -> list[dict]:
    rows = []
    for n, context, kv in cases:
        torch_fn, c_fn = attention_case(n, context, kv)
        samples = {"torch": [], "c": []}
        for _ in range(rounds):
            for name, fn in (("torch", torch_fn), ("c", c_fn)):
                samples[name].append(timed(fn, 10))
        t, c = (statistics.median(s[0] for s in samples[k]) for k in ("torch", "c"))
        rows.append({"rows": n, "context": context, "kv": kv, "torch_cpu_ms": round(t, 3), "c_cpu_ms": round(c, 3),
                     "speedup": round(t / c, 2)})
        print(f"  rows {n:2d}  context {context:4d}  kv {kv:4s}  torch {t:7.3f} ms  C {c:7.3f} ms  x{t / c:.1f}",
              flush=True)
    return rows


def engine_steps(engine, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Prefill the prompts, then (CPU ms, wall ms) per decode step over `steps` steps."""
    from py_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", ids, params)
    while any(s.num_computed_tokens < len(p) for s, p in zip(engine.scheduler.running, prompts)) or \
            engine.scheduler.waiting:
        engine.step()
    engine.step()  # the first decode step lays out the one-call plan
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    cpu, wall = (time.process_time() - c0) / steps * 1e3, (time.perf_counter() - t0) / steps * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return cpu, wall


def dense_steps(llm, prompt: list[int], steps: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per decode token of the dense LLM: generate steps + 1 tokens minus generate 1."""
    from py_engine.sampling_params import SamplingParams

    def run(n: int) -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.process_time() - c0, time.perf_counter() - t0

    run(2)
    one, many = run(1), run(steps + 1)
    return (many[0] - one[0]) / steps * 1e3, (many[1] - one[1]) / steps * 1e3


def step_table(gguf: Path, rounds: int, steps: int) -> list[dict]:
    from native_server.engine.llm_engine import LLMEngine
    from py_engine.backends.torch import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(128)] for _ in range(16)]
    kv_bytes = 8192 * 24 * 2 * KV * D * 4  # 8192 fp32 positions (llama_cpp_bench.py now gives serve fp16 ones)
    engines = {b: LLMEngine(str(gguf), dtype="float32", device="cpu", attention_backend=b, max_num_seqs=16,
                            kv_cache_memory=kv_bytes, max_model_len=8192) for b in ("torch", "cpu")}
    dense = LLM(str(gguf), dtype="float32", device="cpu")
    samples: dict[str, list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for n in (1, 16):
            for b, engine in engines.items():
                samples.setdefault(f"server {b} c={n}", []).append(engine_steps(engine, prompts[:n], steps))
        samples.setdefault("dense LLM c=1", []).append(dense_steps(dense, prompts[0], steps))
    rows = []
    for name, s in samples.items():
        n = int(name.rsplit("=", 1)[1])
        cpu, wall = statistics.median(x[0] for x in s), statistics.median(x[1] for x in s)
        rows.append({"setting": name, "cpu_ms_per_step": round(cpu, 1), "wall_ms_per_step": round(wall, 1),
                     "tok_per_cpu_s": round(n * 1e3 / cpu, 2)})
        print(f"  {name:22s} {cpu:7.1f} ms CPU/step  {wall:7.1f} ms wall/step  {n * 1e3 / cpu:6.2f} tok/CPU-s",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=GGUF)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per setting and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-steps", action="store_true", help="only the attention table")
    parser.add_argument("--contexts", help="attention cases of these contexts only, e.g. 1024,4096")
    parser.add_argument("--kv", help="attention cases of these KV settings only, e.g. auto,fp16")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "paged_decode_speed.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = machine()
    print("one layer's decode attention (CPU time per call):", flush=True)
    with kernel_step(cpu_kernels()):  # as the engine runs a step: torch on one thread, the kernels' pool on all
        cases = [c for c in CASES if (not args.contexts or str(c[1]) in args.contexts.split(","))
                 and (not args.kv or c[2] in args.kv.split(","))]
        attention = attention_table(args.rounds, cases)
    result = {"machine": info, "threads": args.threads, "attention": attention}
    if not args.skip_steps:
        print(f"decode steps on {args.gguf.name}:", flush=True)
        result["steps"] = step_table(args.gguf, args.rounds, args.steps)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
