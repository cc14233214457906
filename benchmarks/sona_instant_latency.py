"""The instant update's latency alone: correction received -> the next request can use it.

    python benchmarks/sona_instant_latency.py --model smollm2-135m-instruct   # under the machine's bench lock

For `--facts` invented facts (sona_task.py), one correction each in a fresh session:
Sona.learn (embed the question, the frozen pass, the MicroLoRA's steps, store) and
pattern_adapter (the fold the server publishes). Reports wall time and this thread's
CPU time (time.thread_time: what the update costs when the machine is shared, as this
2-core one usually is), p50 / p90 / max, and the steps taken. The first update
(warm-up: allocations, the chat template's prefix keys and values) is reported apart.
Writes benchmarks/results/sona_instant_latency_<model>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from common import REPO, machine  # noqa: E402  (benchmarks/common.py: also puts the clone on sys.path)
from sona_gate_bench import percentiles, user  # noqa: E402
from sona_task import facts  # noqa: E402


def main() -> None:
    import torch

    from py_engine.learning import Sona, SonaConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-shakespeare")
    p.add_argument("--facts", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--config", default="{}", help="JSON of SonaConfig fields")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine(),
            "loadavg_start": os.getloadavg()}
    sona = Sona.load(args.model, SonaConfig(**{"consolidate_every": 0, **json.loads(args.config)}))
    rows = []
    for i, fact in enumerate(facts(args.facts + 1, 0)):
        ids = sona.tokenizer.encode(sona._render(user(fact.question)), add_special_tokens=False)
        record = {"id": f"fb-{i}", "session": f"s{i}", "rating": -1, "correction": fact.reply,
                  "prompt": {"token_ids": ids, "messages": user(fact.question)}}
        wall, cpu = time.perf_counter(), time.thread_time()
        update = sona.learn(record)
        sona.pattern_adapter(update.pattern)
        rows.append({"wall_ms": 1000 * (time.perf_counter() - wall), "cpu_ms": 1000 * (time.thread_time() - cpu),
                     "steps": update.stats.steps if update.stats else 0})
    meta["loadavg_end"] = os.getloadavg()
    warm, rows = rows[0], rows[1:]
    result = {"meta": meta, "model": args.model, "config": json.loads(args.config), "first_update": warm,
              **{k: percentiles([r[k] for r in rows]) for k in ("wall_ms", "cpu_ms", "steps")}}
    name = Path(args.model).name if Path(args.model).exists() else args.model
    out = args.out or REPO / "benchmarks" / "results" / f"sona_instant_latency_{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("| instant update | p50 | p90 | max |\n| --- | --- | --- | --- |")
    for k in ("wall_ms", "cpu_ms", "steps"):
        print(f"| {k} | {result[k]['p50']} | {result[k]['p90']} | {result[k]['max']} |")
    print(f"first update: {warm}; load {meta['loadavg_start'][0]:.1f} -> {meta['loadavg_end'][0]:.1f}; wrote {out.name}")


if __name__ == "__main__":
    main()
