"""Past one process: replicas on Ray Serve and tensor parallelism, measured on this machine.

    python benchmarks/cluster_bench.py [--model tiny-shakespeare] [--rounds 2] [--parts tp,replicas,routing,kill]
                                      (tp_memory: the memory probes of tp alone)

replicas  output tok/s of streamed completions at 1, 8, 16 and 64 concurrent (--levels): one `ruvllm serve`
          with 2 threads and with 1 against `ruvllm serve --replicas 1` and `--replicas 2` (1 thread each; a
          local Ray with 2 CPUs). Rounds alternate the order of the four servers.
routing   the prefix-cache hit rate (prompt tokens found cached / looked up, summed over replicas) of a
          multi-turn chat workload (conversations whose every turn resends the whole history) through 2
          replicas with the affinity router against round-robin and random routing (`--routing ...`).
kill      32 concurrent streams through 2 replicas; once 4 have streamed a token one replica's process is
          SIGKILLed: requests lost before streaming (should be 0: re-sent to the other replica), streams cut
          (they end with an OpenAI error event), completions that differ from LLM's greedy text (should be 0),
          and the seconds until Serve runs 2 replicas again.
tp        single-sequence decode tok/s of LLM(model) with 2 threads against LLM(model,
          tensor_parallel_size=2) (1 thread each, gloo on loopback), alternating, on the built-in model
          and SmolLM2-135M's Q4_1 GGUF; and each rank's memory (benchmarks/cluster_tp.py).
On 2 cores nothing here can scale past 2x, and 2 replicas or 2 ranks compete with the load generator.
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
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Iterator

from common import REPO, machine  # noqa: E402  (also puts the clone's root on sys.path)

from native_server.bench.loadgen import run_level_sync  # noqa: E402
from native_server.bench.report import format_table  # noqa: E402
from native_server.bench.stats import summarize  # noqa: E402
from native_server.bench.workload import Workload  # noqa: E402
from cluster_tp import memory_rows, part_tp  # noqa: E402
from tests.server.server_harness import http_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "cluster_bench.json"
LOGS = REPO / "benchmarks" / ".cache" / "cluster"


def quiet_port() -> int:
    from tests.cluster.conftest import quiet_port as pick

    return pick()


@contextlib.contextmanager
def server(model: str, replicas: int | None, threads: int, *flags: str) -> Iterator[str]:
    """`ruvllm serve` (replicas None) or `ruvllm serve --replicas N` on 127.0.0.1; yields its URL."""
    with server_process(model, replicas, threads, *flags) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(model: str, replicas: int | None, threads: int, *flags: str) -> Iterator[tuple]:
    """(URL, the serve command's Popen); with replicas, once all of them run."""
    port = quiet_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "RAY_NUM_CPUS": "2"}
    cluster = ["--replicas", str(replicas)] if replicas else []
    command = [sys.executable, "-m", "ruvllm_cli", "serve", model, "--port", str(port), "--device", "cpu",
               "--log-level", "warning", *cluster, *flags]
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"serve-{replicas or 0}-{port}.log"
    with http_process(command, f"http://127.0.0.1:{port}", "/health", log, env=env, startup_s=600,
                      stop_s=90) as process:
        url = f"http://127.0.0.1:{port}"
        if replicas:
            from tests.cluster.conftest import wait_for_replicas

            wait_for_replicas(url, replicas, 600)  # /health answers once one replica lives
        yield url, process


def throughput(url: str, concurrency: int, label: str) -> dict:
    workload = Workload(64, 64, seed=0)
    run_level_sync(url, workload.prompts(2, 4096, f"warm-{label}"), 8, 2)
    prompts = workload.prompts(concurrency * 2, 4096, label)
    result = summarize(run_level_sync(url, prompts, workload.gen_len, concurrency), concurrency)
    return {"out_tok_s": round(result.output_throughput, 1), "tpot_ms": round(result.tpot_ms.mean, 1),
            "ttft_ms_p50": round(result.ttft_ms.p50, 1), "errors": result.num_errors}


def part_replicas(model: str, rounds: int, levels: list[int]) -> list[dict]:
    configs = [("1 server, 2 threads", None, 2), ("1 server, 1 thread", None, 1), ("1 replica, 1 thread", 1, 1),
               ("2 replicas, 1 thread each", 2, 1)]
    measured: dict[tuple[str, int], list[dict]] = {}
    for r in range(rounds):
        for name, replicas, threads in (configs if r % 2 == 0 else configs[::-1]):
            with server(model, replicas, threads, "--max-concurrent", "64") as url:
                for level in levels:
                    out = throughput(url, level, f"{name}/c{level}/r{r}")
                    measured.setdefault((name, level), []).append(out)
                    print(f"round {r} {name} c={level}: {out}", flush=True)
    rows = []
    for level in levels:
        base = statistics.median(m["out_tok_s"] for m in measured[(configs[0][0], level)])
        for name, _, _ in configs:
            runs = measured[(name, level)]
            tok = statistics.median(m["out_tok_s"] for m in runs)
            rows.append({"concurrency": level, "config": name, "out tok/s (median)": tok,
                         "x 1 server": round(tok / base, 2), "TPOT ms": statistics.median(m["tpot_ms"] for m in runs),
                         "errors": sum(m["errors"] for m in runs)})
    return rows


TOPICS = ["the sea", "a crown", "the night", "a rose", "the war", "a ghost", "the king", "a letter"]


async def conversations(url: str, model: str, users: int, turns: int, concurrency: int) -> None:
    import openai

    system = {"role": "system", "content": "You speak as a player in a comedy of Shakespeare, briefly. " * 3}
    limit = asyncio.Semaphore(concurrency)

    async def talk(client, i: int) -> None:
        messages = [system]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Tell me, friend {i}, of {TOPICS[(i + turn) % 8]}."})
            async with limit:
                reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=24,
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
    for routing in ("affinity", "round-robin", "random"):
        with server(model, 2, 1, "--max-concurrent", "16", "--routing", routing) as url:
            hits0, queries0 = cache_counters(url)
            start = time.perf_counter()
            asyncio.run(conversations(url, model, users, turns, 8))
            elapsed = time.perf_counter() - start
            hits, queries = cache_counters(url)
        rate = (hits - hits0) / max(queries - queries0, 1)
        rows.append({"routing": routing, "conversations": users, "turns": turns,
                     "prompt tokens cached / looked up": f"{int(hits - hits0)} / {int(queries - queries0)}",
                     "hit rate": round(rate, 3), "seconds": round(elapsed, 1)})
        print(rows[-1], flush=True)
    return rows


KILL_PROMPTS = [f"{name}:" for name in ("ROMEO", "JULIET", "KING HENRY", "HAMLET", "MENENIUS", "First Citizen",
                                        "GLOUCESTER", "BRUTUS")] * 4  # 32


async def _stream(client, model: str, prompt: str, tokens: int, started: list) -> str:
    text, marked = "", False
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        if text and not marked:
            started.append(prompt)
            marked = True
    return text


def part_kill(model: str, tokens: int) -> list[dict]:
    """A replica's process SIGKILLed under load (as a crash would): what each of 32 streams saw."""
    import signal

    import openai

    from py_engine import LLM, SamplingParams
    from tests.cluster.conftest import engine_replica_pids, wait_for_replicas

    llm = LLM(model)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    reference = {p: llm.generate(p, params).text for p in set(KILL_PROMPTS)}
    with server_process(model, 2, 1, "--max-concurrent", "4") as (url, process):
        victims = engine_replica_pids(process.pid)
        retries0 = metric(url, "ruvllm_cluster_retries_total")

        async def run():
            started: list[str] = []
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as c:
                tasks = [asyncio.ensure_future(_stream(c, model, p, tokens, started)) for p in KILL_PROMPTS]
                while len(started) < 4:
                    await asyncio.sleep(0.05)
                os.kill(victims[0], signal.SIGKILL)
                killed_at = time.monotonic()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                return results, set(started), time.monotonic() - killed_at

        results, started, drain_s = asyncio.run(run())
        back_s = wait_for_replicas(url, 2, 600)
        retries = metric(url, "ruvllm_cluster_retries_total") - retries0
    failed = [p for p, r in zip(KILL_PROMPTS, results) if isinstance(r, BaseException)]
    done = [(p, r) for p, r in zip(KILL_PROMPTS, results) if not isinstance(r, BaseException)]
    row = {"streams": len(KILL_PROMPTS), "completed": len(done),
           "completed != greedy text": sum(r != reference[p] for p, r in done),
           "cut after streaming began": sum(p in started for p in failed),
           "lost before streaming (want 0)": sum(p not in started for p in failed),
           "re-sent to the other replica": int(retries), "s to finish after the kill": round(drain_s, 1),
           "s from the kill to 2 replicas": round(drain_s + back_s, 1)}
    print(row, flush=True)
    return [row]


def metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def merged(out: dict) -> dict:
    """This run's parts over the file's; the meta of an earlier run whose parts are still there is kept in
    `earlier_runs` (each part's numbers stay beside the load they were measured under)."""
    previous = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    runs = previous.pop("earlier_runs", []) + ([previous.pop("meta")] if "meta" in previous else [])
    kept = {k: v for k, v in previous.items() if k not in out}
    earlier = [m for m in runs if any(p in kept or p + "_memory" in kept for p in m.get("parts", ["tp", "routing"]))]
    return {**out, **kept, **({"earlier_runs": earlier} if earlier else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-shakespeare")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="tp,replicas,routing,kill")
    parser.add_argument("--levels", default="1,8,16,64", help="concurrent clients of the replicas part")
    parser.add_argument("--kill-tokens", type=int, default=48)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tp-models", default="tiny-shakespeare,smollm2-135m-instruct")
    parser.add_argument("--tp-tokens", type=int, default=128)
    args = parser.parse_args()

    parts = args.parts.split(",")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    meta = {"uptime_start": uptime, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine(),
            "model": args.model, "rounds": args.rounds, "parts": parts,
            "note": "shared 2-core machine; load average at start and end"}
    out: dict = {"meta": meta}
    if "tp" in parts:
        out["tp"], out["tp_memory"] = part_tp(args.tp_models.split(","), args.rounds + 1, args.tp_tokens)
    elif "tp_memory" in parts:
        out["tp_memory"] = [row for model in args.tp_models.split(",") for row in memory_rows(model)]
    if "replicas" in parts:
        out["replicas"] = part_replicas(args.model, args.rounds, [int(n) for n in args.levels.split(",")])
    if "routing" in parts:
        out["routing"] = part_routing(args.model, args.users, args.turns)
    if "kill" in parts:
        out["kill"] = part_kill(args.model, args.kill_tokens)
    meta["loadavg_end"] = os.getloadavg()
    meta["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    for part in ("tp", "tp_memory", "replicas", "routing", "kill"):
        if part in out:
            print(f"\n{part}:\n" + format_table(out[part], [(k, k) for k in out[part][0]]))
    RESULTS.write_text(json.dumps(merged(out), indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
