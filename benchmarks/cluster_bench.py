"""Past one process: replicas on Ray Serve and tensor parallelism, measured on this machine.

    python benchmarks/cluster_bench.py [--model tiny-shakespeare] [--rounds 2] [--parts replicas,routing,tp]

replicas  output tok/s of streamed completions at 16 and 64 concurrent: one `ruvllm serve` with 2 threads
          against `ruvllm serve --replicas 1` and `--replicas 2` (1 thread each; a local Ray with 2 CPUs).
          Rounds alternate the order of the three servers.
routing   the prefix-cache hit rate (prompt tokens found cached / looked up, summed over replicas) of a
          multi-turn chat workload (conversations whose every turn resends the whole history) through 2
          replicas with the affinity router against random routing (`--routing random`).
tp        single-sequence decode tok/s of LLM(model) with 2 threads against LLM(model,
          tensor_parallel_size=2) (1 thread each, gloo on loopback), alternating, on the built-in model
          and SmolLM2-135M's Q4_1 GGUF.
Take a lock (flock) on a shared machine. Writes benchmarks/results/cluster_bench.json with the CPU
flags and the load average at start and end, and prints one table per part.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Iterator

from common import REPO, machine  # noqa: E402  (also puts the clone's root on sys.path)

from native_server.bench.loadgen import run_level_sync  # noqa: E402
from native_server.bench.report import format_table  # noqa: E402
from native_server.bench.stats import summarize  # noqa: E402
from native_server.bench.workload import Workload  # noqa: E402
from tests.server.server_harness import http_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "cluster_bench.json"
LOGS = REPO / "benchmarks" / ".cache" / "cluster"


def quiet_port() -> int:
    from tests.cluster.conftest import quiet_port as pick

    return pick()


@contextlib.contextmanager
def server(model: str, replicas: int | None, threads: int, *flags: str) -> Iterator[str]:
    """`ruvllm serve` (replicas None) or `ruvllm serve --replicas N` on 127.0.0.1; yields its URL."""
    port = quiet_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "RAY_NUM_CPUS": "2"}
    cluster = ["--replicas", str(replicas)] if replicas else []
    command = [sys.executable, "-m", "ruvllm_cli", "serve", model, "--port", str(port), "--device", "cpu",
               "--log-level", "warning", *cluster, *flags]
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"serve-{replicas or 0}-{port}.log"
    with http_process(command, f"http://127.0.0.1:{port}", "/health", log, env=env, startup_s=600,
                      stop_s=90) as _:
        yield f"http://127.0.0.1:{port}"


def throughput(url: str, concurrency: int, label: str) -> dict:
    workload = Workload(64, 64, seed=0)
    run_level_sync(url, workload.prompts(2, 4096, f"warm-{label}"), 8, 2)
    prompts = workload.prompts(concurrency * 2, 4096, label)
    result = summarize(run_level_sync(url, prompts, workload.gen_len, concurrency), concurrency)
    return {"out_tok_s": round(result.output_throughput, 1), "tpot_ms": round(result.tpot_ms.mean, 1),
            "ttft_ms_p50": round(result.ttft_ms.p50, 1), "errors": result.num_errors}


def part_replicas(model: str, rounds: int) -> list[dict]:
    configs = [("1 server, 2 threads", None, 2), ("1 replica, 1 thread", 1, 1), ("2 replicas, 1 thread each", 2, 1)]
    measured: dict[tuple[str, int], list[dict]] = {}
    for r in range(rounds):
        for name, replicas, threads in (configs if r % 2 == 0 else configs[::-1]):
            with server(model, replicas, threads, "--max-concurrent", "64") as url:
                for level in (16, 64):
                    out = throughput(url, level, f"{name}/c{level}/r{r}")
                    measured.setdefault((name, level), []).append(out)
                    print(f"round {r} {name} c={level}: {out}", flush=True)
    rows = []
    for level in (16, 64):
        base = statistics.median(m["out_tok_s"] for m in measured[(configs[0][0], level)])
        for name, _, _ in configs:
            runs = measured[(name, level)]
            tok = statistics.median(m["out_tok_s"] for m in runs)
            rows.append({"concurrency": level, "config": name, "out tok/s (median)": tok,
                         "x 1 server": round(tok / base, 2), "TPOT ms": statistics.median(m["tpot_ms"] for m in runs),
                         "errors": sum(m["errors"] for m in runs)})
    return rows


TOPICS = ["the sea", "a crown", "the night", "a rose", "the war", "a ghost", "the king", "a letter"]


async def conversations(url: str, users: int, turns: int, concurrency: int) -> None:
    import openai

    system = {"role": "system", "content": "You speak as a player in a comedy of Shakespeare, briefly. " * 3}
    limit = asyncio.Semaphore(concurrency)

    async def talk(client, i: int) -> None:
        messages = [system]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Tell me, friend {i}, of {TOPICS[(i + turn) % 8]}."})
            async with limit:
                reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=24,
                                                             temperature=0)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        await asyncio.gather(*(talk(client, i) for i in range(users)))


def cache_counters(url: str) -> tuple[float, float]:
    import httpx

    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith(("ruvllm_prefix_cache_hits_total ", "ruvllm_prefix_cache_queries_total ")):
            name, value = line.split()
            values[name] = float(value)
    return values["ruvllm_prefix_cache_hits_total"], values["ruvllm_prefix_cache_queries_total"]


def part_routing(model: str, users: int, turns: int) -> list[dict]:
    rows = []
    for routing in ("affinity", "random"):
        with server(model, 2, 1, "--max-concurrent", "16", "--routing", routing) as url:
            hits0, queries0 = cache_counters(url)
            start = time.perf_counter()
            asyncio.run(conversations(url, users, turns, 8))
            elapsed = time.perf_counter() - start
            hits, queries = cache_counters(url)
        rate = (hits - hits0) / max(queries - queries0, 1)
        rows.append({"routing": routing, "conversations": users, "turns": turns,
                     "prompt tokens cached / looked up": f"{int(hits - hits0)} / {int(queries - queries0)}",
                     "hit rate": round(rate, 3), "seconds": round(elapsed, 1)})
        print(rows[-1], flush=True)
    return rows


def part_tp(models: list[str], rounds: int, tokens: int) -> list[dict]:
    import torch

    from py_engine import LLM, SamplingParams

    rows = []
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for model in models:
        torch.set_num_threads(2)
        one = LLM(model)
        two = LLM(model, tensor_parallel_size=2)  # sets this process to 1 thread (its share of 2 cores)
        speeds: dict[str, list[float]] = {"TP=1, 2 threads": [], "TP=2, 1 thread each": []}
        try:
            for llm, threads in ((one, 2), (two, 1)):  # warm-up: kernel plans, caches
                torch.set_num_threads(threads)
                llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8))
            for r in range(rounds):
                order = [("TP=1, 2 threads", one, 2), ("TP=2, 1 thread each", two, 1)]
                for name, llm, threads in (order if r % 2 == 0 else order[::-1]):
                    torch.set_num_threads(threads)  # kernel_step gives the kernels' pool this many threads
                    backend = llm._new_backend()
                    logits = backend.prefill(llm.encode("Once upon a time"))
                    start = time.perf_counter()
                    for _ in range(tokens):
                        logits = backend.decode(int(logits.argmax()))
                    speeds[name].append(tokens / (time.perf_counter() - start))
                    print(f"{model} round {r} {name}: {speeds[name][-1]:.1f} tok/s", flush=True)
        finally:
            two.close()
        base = statistics.median(speeds["TP=1, 2 threads"])
        for name, values in speeds.items():
            rows.append({"model": model, "config": name, "decode tok/s (median)": round(statistics.median(values), 1),
                         "x TP=1": round(statistics.median(values) / base, 2),
                         "range": "%.1f-%.1f" % (min(values), max(values))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-shakespeare")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="replicas,routing,tp")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tp-models", default="tiny-shakespeare,smollm2-135m-instruct")
    parser.add_argument("--tp-tokens", type=int, default=128)
    args = parser.parse_args()

    parts = args.parts.split(",")
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine(), "model": args.model,
            "rounds": args.rounds, "note": "shared 2-core machine; load average at start and end"}
    out: dict = {"meta": meta}
    if "tp" in parts:
        out["tp"] = part_tp(args.tp_models.split(","), args.rounds + 1, args.tp_tokens)
    if "replicas" in parts:
        out["replicas"] = part_replicas(args.model, args.rounds)
    if "routing" in parts:
        out["routing"] = part_routing(args.model, args.users, args.turns)
    meta["loadavg_end"] = os.getloadavg()
    for part in ("replicas", "routing", "tp"):
        if part in out:
            print(f"\n{part}:\n" + format_table(out[part], [(k, k) for k in out[part][0]]))
    previous = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    RESULTS.write_text(json.dumps({**previous, **out}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
