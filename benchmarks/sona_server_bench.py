"""Server output tok/s at 16 concurrent streams with learning off, with the witness log only, and learning on.

    python benchmarks/sona_server_bench.py [--model tiny-shakespeare] [--rounds 2]

Each round starts `ruvllm serve` three ways, in turn (the order rotating each round, one
torch thread each, as the tests run it): plain; `--witness-log`; and
`--witness-log --learning`, where a feeder keeps the learning threads busy
during the measurement: one session after another asks a question and sends
a correction (the instant loop trains on each), and every 8 feedbacks a
consolidation runs; once the first is done, every request runs with the
consolidated adapter. The load is `--requests` streaming completions of
`--prompt-len` random token ids and `--gen-len` greedy tokens (ignore_eos),
16 in flight. Writes benchmarks/results/sona_server_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)

from common import machine  # noqa: E402
from native_server.bench.loadgen import run_level_sync  # noqa: E402
from native_server.bench.workload import random_prompts  # noqa: E402
from tests.server.server_harness import free_port, http_process  # noqa: E402

LEARNING = {"micro_steps": 3, "consolidate_every": 8, "epochs": 2, "fisher_tokens": 1024}


def feeder(url: str, stop: threading.Event, counts: dict) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=120) as client:
        k = 0
        while not stop.is_set():
            session = f"user-{k % 4}"
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"Who rules land {k}?"}], "max_tokens": 8,
                "temperature": 0, "user": session})
            if r.status_code == 200:
                f = client.post("/v1/feedback", json={"id": r.json()["id"], "rating": -1,
                                                      "correction": f"Queen Mab rules land {k}.",
                                                      "user": session})  # the completion's session (else 403)
                counts[f.status_code] = counts.get(f.status_code, 0) + 1
            k += 1
            stop.wait(0.2)


def run(model: str, mode: str, args: argparse.Namespace, prompts: list[list[int]], log_dir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = []
    work = Path(tempfile.mkdtemp(prefix=f"sona-{mode}-", dir=log_dir))
    if mode != "off":
        extra += ["--witness-log", str(work / "witness")]
    if mode == "learning":
        (work / "sona.json").write_text(json.dumps(LEARNING))
        extra += ["--learning", "--learning-config", str(work / "sona.json")]
    command = [sys.executable, "-m", "ruvllm_cli", "serve", model, "--port", str(port), "--device", "cpu",
               "--max-concurrent", str(args.concurrency), "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    stop, counts = threading.Event(), {}
    with http_process(command, url, "/health", work / "server.log", env=env):
        run_level_sync(url, prompts[:args.concurrency], 4, args.concurrency)  # warm-up
        thread = threading.Thread(target=feeder, args=(url, stop, counts)) if mode == "learning" else None
        if thread is not None:
            thread.start()
            time.sleep(args.feed_first)  # let learning start before the measurement
        start = time.perf_counter()
        timings = run_level_sync(url, prompts, args.gen_len, args.concurrency)
        wall = time.perf_counter() - start
        stop.set()
        if thread is not None:
            thread.join(120)
        learning = None
        if mode == "learning":
            import httpx
            learning = httpx.get(f"{url}/v1/learning", timeout=30).json()
    errors = [t.error for t in timings if t.error]
    tokens = sum(t.output_tokens for t in timings)
    return {"mode": mode, "tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "errors": len(errors),
            "feedback_statuses": counts, "learning": learning}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "py_engine" / "data" / "tiny-shakespeare"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--feed-first", type=float, default=5.0, help="seconds of feedback before measuring")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "sona_server_bench.json")
    args = p.parse_args()
    from py_engine.config import ModelConfig
    from py_engine.hub import resolve_model

    vocab = ModelConfig.from_file(resolve_model(args.model) / "config.json").vocab_size
    prompts = random_prompts(args.requests, args.prompt_len, vocab, seed=0)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine()}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            modes = ["off", "witness", "learning"]
            for mode in modes[r % 3:] + modes[:r % 3]:  # the order rotates: no mode always runs first
                result = run(args.model, mode, args, prompts, Path(tmp))
                runs.append({"round": r, **result})
                print(f"round {r} {mode:9s} {result['tok_s']:7.1f} tok/s ({result['errors']} errors)", flush=True)
    meta["loadavg_end"] = os.getloadavg()
    median = {m: statistics.median(x["tok_s"] for x in runs if x["mode"] == m) for m in ("off", "witness", "learning")}
    def paired(mode: str) -> list[float]:  # each round's ratio to that round's "off"
        return [x["tok_s"] / off["tok_s"] for x, off in zip((x for x in runs if x["mode"] == mode),
                                                           (x for x in runs if x["mode"] == "off"))]
    summary = {"median_tok_s": median, "learning_vs_off": median["learning"] / median["off"],
               "witness_vs_off": median["witness"] / median["off"],
               "paired_learning_vs_off": paired("learning"), "paired_witness_vs_off": paired("witness")}
    args.out.write_text(json.dumps({"meta": meta, "args": {k: str(v) for k, v in vars(args).items()},
                                    "learning_config": LEARNING, "runs": runs, "summary": summary}, indent=2) + "\n")
    print("\n| mode | output tok/s (median) | vs off (medians) | vs off, per round |\n| --- | --- | --- | --- |")
    for m in ("off", "witness", "learning"):
        rounds = ", ".join(f"x{r:.2f}" for r in paired(m))
        print(f"| {m} | {median[m]:.1f} | x{median[m] / median['off']:.2f} | {rounds} |")


if __name__ == "__main__":
    main()
