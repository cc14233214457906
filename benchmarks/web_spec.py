"""Prompt lookup speculation in the npm package (issue 32's browser/npm part): decode speed with it off and on.

    flock /tmp/ruvllm-bench.lock .venv/bin/python benchmarks/web_spec.py [--rounds 2] [--max-tokens 96] [--threads 2]
    flock /tmp/ruvllm-bench.lock .venv/bin/python benchmarks/web_spec.py --where chromium    # the page's runtime

SmolLM2-135M-Instruct's Q4_1 GGUF exported int4 for the web (benchmarks/web_bench.py's export, kept in
.cache/web-bench), run by the npm package in Node (benchmarks/web/spec_bench.mjs: Pyodide for the tokenizer,
template, loop and prompt lookup; the forward pass on the package's wasm kernels), or with --where chromium in
headless Chromium as the page runs it (a Web Worker engine; relaxed SIMD kernels where Node 20 has only
SIMD128; a page built into .cache/web-bench/spec-dist), both through benchmarks/web/spec_core.js, on
spec_decode.py's two chat
sets: grounded prompts (the answer repeats the prompt) and open chat; greedy, max_tokens tokens. One engine
created with speculative {method: 'ngram', num_speculative_tokens: K} runs every prompt twice, with the request's
`speculative` false and true, the order alternating, in --rounds rounds. Decode tok/s per set = (tokens - 1)
summed / (first token to last, wall) summed; the ratio on/off per round, then its median. The tokens with and
without speculation must be equal (the script fails otherwise). First, the step costs: ms of one pass of
1 (decode), 2, 3, 5, 9 rows (verify) on the kernels alone, interleaved, median. Prints tables; writes
benchmarks/results/web_spec.json (web_spec_chromium.json) with the CPU flags and the load average before and
after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from common import REPO, machine  # noqa: E402  (also puts the clone's root on sys.path)

RESULTS = REPO / "benchmarks" / "results" / "web_spec.json"
DRIVER = REPO / "benchmarks" / "web" / "spec_bench.mjs"
WORK = REPO / ".cache" / "web-bench"
IN_PAGE = """async (spec) => {
    const here = (path) => new URL(path, location.href);
    const { createEngine } = await import('./ruvllm/index.js');
    const { WasmBackend } = await import('./ruvllm/wasm_backend.js');
    const { specBench } = await import('./spec_core.js');
    const model = here('models/smollm2/');
    const contract = await (await fetch(new URL('ruvllm_contract.json', model))).json();
    const engineOptions = { model: model.href, worker: true, device: 'wasm', pyodideURL: here('pyodide/').href,
      wasmPaths: here('ort/').href, ortURL: here('ort/ort.wasm.min.mjs').href, wheelsURL: here('wheels/').href,
      workerURL: here('ruvllm/worker.js').href };
    return await specBench(spec, { createEngine, WasmBackend, model, contract, engineOptions,
      log: (line) => console.log(line) });
}"""


def run_node(spec: dict) -> dict:
    spec_file = WORK / "spec_bench.json"
    spec_file.write_text(json.dumps(spec))
    done = subprocess.run(["node", str(DRIVER), str(spec_file)], stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"spec_bench.mjs failed ({done.returncode})")
    return json.loads(done.stdout)


def run_chromium(spec: dict, export) -> dict:
    """The page built with this checkout's runtime and the export, served as `ruvllm serve` serves it."""
    import shutil

    from tests.web.web_harness import browser, static_server
    from web.build import build_dist

    dist = build_dist(WORK / "spec-dist", {"smollm2": export}, builtin=False)
    shutil.copy(REPO / "benchmarks" / "web" / "spec_core.js", dist / "spec_core.js")
    profile = WORK / "spec-profile"
    shutil.rmtree(profile, ignore_errors=True)
    with static_server(dist) as base, browser(profile) as (context, _):
        page = context.new_page()
        page.set_default_timeout(0)
        page.on("console", lambda m: print(m.text, flush=True))
        page.goto(f"{base}?autoload=0")
        page.wait_for_function("document.body.dataset.status !== undefined")
        return page.evaluate(IN_PAGE, spec)


def rate(runs: list[dict]) -> float:
    return sum(r["tokens"] - 1 for r in runs) / (sum(r["decode_ms"] for r in runs) / 1000)


def summarize(runs: list[dict], rounds: int) -> dict:
    out = {}
    for name in sorted({r["set"] for r in runs}):
        per_round, on_all = [], []
        for k in range(rounds):
            pick = [r for r in runs if r["set"] == name and r["round"] == k]
            off, on = [r for r in pick if not r["on"]], [r for r in pick if r["on"]]
            per_round.append({"off_tok_s": rate(off), "on_tok_s": rate(on), "ratio": rate(on) / rate(off)})
            on_all += on
        drafted = sum((r["speculative"] or {}).get("num_draft_tokens", 0) for r in on_all)
        kept = sum((r["speculative"] or {}).get("num_accepted_tokens", 0) for r in on_all)
        out[name] = {"rounds": per_round, "ratio_median": statistics.median(p["ratio"] for p in per_round),
                     "off_tok_s_median": statistics.median(p["off_tok_s"] for p in per_round),
                     "on_tok_s_median": statistics.median(p["on_tok_s"] for p in per_round),
                     "draft_tokens": drafted, "accepted": kept, "acceptance": kept / drafted if drafted else None,
                     "tokens_per_pass": sum(r["tokens"] for r in on_all) / sum(r["forward_passes"] for r in on_all)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--where", choices=("node", "chromium"), default="node")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompts", type=int, default=5, help="prompts of each set")
    parser.add_argument("--cost-reps", type=int, default=15, help="passes timed per row count (step costs)")
    args = parser.parse_args()
    from benchmarks.spec_decode import CHAT, GROUNDED
    from benchmarks.web_bench import export_smollm2
    from web.wheels import build_wheels

    export, _ = export_smollm2()
    build_wheels(REPO / "npm" / "wheels")  # the package's py_engine wheel from this checkout
    info = machine()
    info["uptime_before"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    speculative = {"method": "ngram", "num_speculative_tokens": args.k}
    spec = {"model": str(export), "precision": "int4", "threads": args.threads, "rounds": args.rounds,
            "cost_reps": args.cost_reps,
            "max_tokens": args.max_tokens, "speculative": speculative,
            "sets": {"grounded": GROUNDED[:args.prompts], "chat": CHAT[:args.prompts]}}
    started = time.time()
    got = run_node(spec) if args.where == "node" else run_chromium(spec, export)
    info["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    info["loadavg_end"] = os.getloadavg()
    runs = got["runs"]
    for r in runs:  # speculation changes no token
        twin = next(t for t in runs if (t["round"], t["set"], t["prompt"]) == (r["round"], r["set"], r["prompt"])
                    and t["on"] != r["on"])
        if r["token_ids"] != twin["token_ids"]:
            raise SystemExit(f"tokens differ with speculation: {r['set']} prompt {r['prompt']} round {r['round']}")
    table = summarize(runs, args.rounds)
    print(f"\nSmolLM2 int4 web export, {args.where} ({got['kernels']}), {args.rounds} rounds, "
          f"{args.max_tokens} tokens, ngram k={args.k} ({time.time() - started:.0f} s)")
    print(f"{'set':10} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>8} {'acceptance':>11} {'tokens/pass':>12}")
    for name, row in table.items():
        acc = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "-"
        print(f"{name:10} {row['off_tok_s_median']:10.1f} {row['on_tok_s_median']:10.1f} "
              f"x{row['ratio_median']:7.2f} {acc:>11} {row['tokens_per_pass']:12.2f}")
    steps = got["step_ms"]
    print("ms of one pass by rows (1: decode; n: verify of the pending token + n-1 drafts): "
          + ", ".join(f"{n}: {ms:.1f} (x{ms / steps['1']:.2f})" for n, ms in steps.items()))
    print(f"load: {info['uptime_before']} -> {info['uptime_after']}")
    results = RESULTS if args.where == "node" else RESULTS.with_name("web_spec_chromium.json")
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({"machine": info, "args": vars(args), "runtime": got["load"]["runtime"],
                                   "speculative": got["load"]["speculative"], "sets": table,
                                   "step_ms_by_rows": got["step_ms"], "kernels": got["kernels"],
                                   "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]},
                                  indent=1))
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
