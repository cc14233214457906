"""Where a CPU server's time goes at c=1 and c=16, step by step, and what c=16 can reach at best.

    .venv/bin/python benchmarks/server_profile.py [--gguf PATH] [--tokens 512,2048] [--gen 64] [--rounds 2]

Runs an in-process LLMEngine (the server's engine, without HTTP: a `ruvllm serve` process spends the same CPU
time on this workload, checked with llama_cpp_bench.py's prompts) on the Qwen2.5-0.5B-shape Q4_0 GGUF of
llama_cpp_bench.py, with the benchmark's workload: 1 and then 16 prompts of 128 random tokens, `--gen`
greedy tokens each, all added at once (the closed loop of a c=16 client). One run per step budget
(`--tokens`: max_num_batched_tokens), alternating, `--rounds` times. Every step is timed (wall, process
CPU = both cores, and the engine thread's own CPU) and split into the forward pass, sampling and the
rest (scheduling, detokenizing); steps are grouped as prefill (prompt chunks only), mixed (chunks +
decode rows) and decode (one token per sequence, by batch rows).

The bound: with Tp the wall time of one 128-token prefill, s1 and s16 the wall times of a 1-row and a
16-row decode step and g tokens per request, perfect batching gives
    c16 / c1 = 16 (Tp + (g - 1) s1) / (16 Tp + (g - 1) s16)   <=   1 + (g - 1) s1 / Tp   (s16 -> 0),
since the 16 prompts' prefill work hardly shrinks with batching (it is GEMM-bound from 128 rows; 512-row
steps are ~5-10% cheaper per token, and decode rows riding along in them save a few steps, so a measured
ratio can sit a little above the first figure); and whatever the prefill costs, c16 / c1 < 16 s1 / s16
(Tp -> 0). The script prints all three from its own measurements. Wall times need a quiet machine; process CPU / threads
is printed beside them. Writes benchmarks/results/server_profile.json with the CPU flags.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from common import HERE  # noqa: E402  (also puts the clone's root on sys.path)

from common import machine  # noqa: E402

GGUF = HERE / ".cache" / "qwen2.5-0.5b-random-seed0-gguf" / "qwen-q4_0.gguf"
PROMPT, VOCAB = 128, 151936


class Clock:
    """Wall, process CPU and this thread's CPU since start()."""

    def start(self) -> "Clock":
        self.wall, self.cpu, self.thread = time.perf_counter(), time.process_time(), time.thread_time()
        return self

    def stop(self) -> tuple[float, float, float]:
        return (time.perf_counter() - self.wall, time.process_time() - self.cpu, time.thread_time() - self.thread)


def instrument(engine) -> dict:
    """Time the engine's forward, sampling and postprocessing of the current step into `phases`."""
    phases: dict[str, float] = {}

    def timed(name: str, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return run

    engine.runner.execute = timed("forward", engine.runner.execute)
    engine._sample = timed("sample", engine._sample)
    engine._postprocess = timed("postprocess", engine._postprocess)
    return phases


def run_batch(engine, phases: dict, n: int, gen: int, label: str, rng: random.Random) -> dict:
    from py_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"{label}-{i}", [rng.randrange(3, VOCAB) for _ in range(PROMPT)], params)
    steps, total = [], Clock().start()
    while engine.has_unfinished_requests():
        rows = None
        schedule = engine.scheduler.schedule

        def spy():  # the step's batch: tokens per sequence
            nonlocal rows
            out = schedule()
            rows = list(out.num_new_tokens)
            return out

        engine.scheduler.schedule = spy
        phases.clear()
        clock = Clock().start()
        engine.step()
        wall, cpu, thread = clock.stop()
        del engine.scheduler.schedule
        prompt_rows = [r for r in rows or [] if r > 1]
        kind = "decode" if not prompt_rows else "prefill" if len(prompt_rows) == len(rows) else "mixed"
        steps.append({"kind": kind, "rows": sum(rows or []), "decode_rows": len(rows or []) - len(prompt_rows),
                      "prompt_tokens": sum(prompt_rows), "wall": wall, "cpu": cpu, "thread": thread, **phases})
    wall, cpu, thread = total.stop()
    return {"n": n, "gen": gen, "wall_s": wall, "cpu_s": cpu, "tok_per_s": n * gen / wall,
            "tok_per_cpu_s": n * gen / cpu, "steps": steps}


def summary(run: dict, threads: int) -> dict:
    """Per kind of step: count, rows, wall and CPU sums, and the forward / sample / rest split."""
    out = {}
    for kind in ("prefill", "mixed", "decode"):
        steps = [s for s in run["steps"] if s["kind"] == kind]
        if not steps:
            continue
        wall = sum(s["wall"] for s in steps)
        out[kind] = {"steps": len(steps), "rows_per_step": statistics.median(s["rows"] for s in steps),
                     "wall_s": wall, "cpu_s": sum(s["cpu"] for s in steps),
                     "engine_thread_cpu_s": sum(s["thread"] for s in steps),
                     "forward_s": sum(s.get("forward", 0) for s in steps),
                     "sample_s": sum(s.get("sample", 0) for s in steps),
                     "postprocess_s": sum(s.get("postprocess", 0) for s in steps),
                     "wall_ms_per_step": wall / len(steps) * 1e3,
                     "cpu_ms_per_step_per_thread": sum(s["cpu"] for s in steps) / len(steps) / threads * 1e3}
        out[kind]["other_s"] = wall - out[kind]["forward_s"] - out[kind]["sample_s"] - out[kind]["postprocess_s"]
    out["between_steps_s"] = run["wall_s"] - sum(s["wall"] for s in run["steps"])
    return out


def bound(c1: dict, c16: dict, gen: int, threads: int) -> dict:
    """The c16/c1 ratio perfect batching allows, from Tp, s1 and s16 (wall, and CPU / threads)."""
    result = {}
    for basis in ("wall", "cpu"):
        scale = 1.0 if basis == "wall" else 1.0 / threads
        first = c1["steps"][0]
        tp = first[basis] * scale
        s1 = statistics.median(s[basis] for s in c1["steps"][1:]) * scale
        s16 = statistics.median(s[basis] for s in c16["steps"] if s["kind"] == "decode" and s["rows"] == 16) * scale
        ratio = 16 * (tp + (gen - 1) * s1) / (16 * tp + (gen - 1) * s16)
        result[basis] = {"prefill_128_s": tp, "step1_ms": s1 * 1e3, "step16_ms": s16 * 1e3,
                         "prefill_tok_per_s": PROMPT / tp, "c16_over_c1_perfect_batching": ratio,
                         "c16_over_c1_if_step16_free": 1 + (gen - 1) * s1 / tp,
                         "c16_over_c1_if_prefill_free": 16 * s1 / s16,
                         "measured_c16_over_c1": c16["tok_per_s" if basis == "wall" else "tok_per_cpu_s"]
                         / c1["tok_per_s" if basis == "wall" else "tok_per_cpu_s"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=GGUF)
    parser.add_argument("--tokens", default="512,2048", help="max_num_batched_tokens settings, alternated")
    parser.add_argument("--gen", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "server_profile.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from native_server.engine.llm_engine import LLMEngine

    kv_bytes = 8192 * 24 * 2 * 2 * 64 * 4  # 8192 fp32 positions, as llama_cpp_bench.py gives serve
    engine = LLMEngine(str(args.gguf), dtype="float32", device="cpu", max_num_seqs=16, kv_cache_memory=kv_bytes,
                       max_model_len=8192, enable_prefix_caching=False)
    phases = instrument(engine)
    rng = random.Random(0)
    run_batch(engine, phases, 2, 4, "warmup", rng)
    info = machine()
    settings = [int(t) for t in args.tokens.split(",")]
    runs: dict[int, list[dict]] = {t: [] for t in settings}
    for rnd in range(args.rounds):
        for tokens in settings:
            engine.scheduler.max_num_batched_tokens = tokens
            c1 = run_batch(engine, phases, 1, args.gen, f"r{rnd}-{tokens}-c1", rng)
            c16 = run_batch(engine, phases, 16, args.gen, f"r{rnd}-{tokens}-c16", rng)
            runs[tokens].append({"c1": c1, "c16": c16})
            print(f"round {rnd}, {tokens} tokens/step: c=1 {c1['tok_per_s']:.1f} tok/s ({c1['tok_per_cpu_s']:.1f} "
                  f"per CPU-s), c=16 {c16['tok_per_s']:.1f} tok/s ({c16['tok_per_cpu_s']:.1f} per CPU-s)", flush=True)
    result = {"machine": info, "gguf": str(args.gguf), "threads": args.threads, "prompt": PROMPT, "gen": args.gen,
              "settings": {}}
    for tokens, pairs in runs.items():
        best = min(pairs, key=lambda p: p["c16"]["cpu_s"])  # the least disturbed round
        summ = {"c1": summary(best["c1"], args.threads), "c16": summary(best["c16"], args.threads)}
        result["settings"][str(tokens)] = {
            "c16_cpu_s": [p["c16"]["cpu_s"] for p in pairs], "c16_wall_s": [p["c16"]["wall_s"] for p in pairs],
            "c1_cpu_s": [p["c1"]["cpu_s"] for p in pairs], "c1_wall_s": [p["c1"]["wall_s"] for p in pairs],
            "summary": summ, "bound": bound(best["c1"], best["c16"], args.gen, args.threads),
            "c16_steps": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}
                          for s in best["c16"]["steps"]]}
        print(f"\n== {tokens} tokens/step (least-CPU round): c=16 CPU {min(result['settings'][str(tokens)]['c16_cpu_s']):.2f} s")
        for kind, row in summ["c16"].items():
            if isinstance(row, dict):
                print(f"  c=16 {kind:7s} {row['steps']:3d} steps, {row['rows_per_step']:6.0f} rows/step, wall "
                      f"{row['wall_s']:6.2f} s (forward {row['forward_s']:.2f}, sample {row['sample_s']:.2f}, "
                      f"postprocess {row['postprocess_s']:.2f}, other {row['other_s']:.2f}), CPU {row['cpu_s']:6.2f} s, "
                      f"{row['wall_ms_per_step']:.1f} ms wall / {row['cpu_ms_per_step_per_thread']:.1f} ms CPU per "
                      f"thread a step")
        for basis, b in result["settings"][str(tokens)]["bound"].items():
            print(f"  bound ({basis}): Tp {b['prefill_128_s']:.3f} s ({b['prefill_tok_per_s']:.0f} tok/s), s1 "
                  f"{b['step1_ms']:.1f} ms, s16 {b['step16_ms']:.1f} ms -> c16/c1 perfect batching "
                  f"{b['c16_over_c1_perfect_batching']:.2f}, with free 16-row steps {b['c16_over_c1_if_step16_free']:.2f}, "
                  f"with free prefill {b['c16_over_c1_if_prefill_free']:.2f}; "
                  f"measured {b['measured_c16_over_c1']:.2f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
