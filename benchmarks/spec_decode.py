"""Speculative decoding on SmolLM2-135M-Instruct's Q4_1 GGUF: decode speed with and without it, and llama.cpp's.

    .venv/bin/python benchmarks/spec_decode.py                          # engine + server + llama-server, 3 rounds
    .venv/bin/python benchmarks/spec_decode.py --parts engine --rounds 5 --configs plain,ngram:4,ngram:6
    .venv/bin/python benchmarks/spec_decode.py --configs plain,ngram:4,draft:DIR   # a distilled draft too

Two task sets of chat prompts (greedy, temperature 0, max_tokens 128, each a fresh request): input-grounded ones
(summarize, quote, edit a given text; a JSON object echoing its input; a code edit), where the answer repeats
its prompt, and open chat. Parts, every one in paired rounds (each round runs every configuration, the order
rotating):
- engine: `LLM(..., speculative=...)` single stream on --threads threads, one fresh process a round holding one LLM
  per configuration, which take turns prompt by prompt; decode tok/s = (tokens - 1) / the
  time from the first token to the last, per prompt, summed over a set (total tokens / total time); the drafts'
  acceptance per position from generate's counts; every configuration's tokens must equal plain decoding's (the
  script fails otherwise);
- server: `ruvllm serve` with and without --speculative-config, 16 concurrent requests (both sets, cycled),
  output tokens / wall time of the batch, and the server process's CPU seconds for it (less swayed by the
  machine's other load); every configuration's server runs for the whole part, so each round's batches are
  neighbours in time (no server start between them);
- llama: llama.cpp's own `llama-server` (`make bench-anchors` builds it, -march=native) on the same file and prompts,
  plain and with `--spec-type ngram-simple` (its defaults, and a 3-gram drafting 4) (and --model-draft DRAFT.gguf when given), one request at a time:
  its reported decode rate (timings.predicted_per_second).
- invariance: the cost of batch invariance (one numeric path for a token, 93e4dc4): prefill and decode tok/s of
  the working tree against py_engine as of --before (93e4dc4^, when a prompt chunk of 32+ rows ran float
  activations and fp32 linears ran MKL's sgemm), alternating in each round, every run a fresh process: SmolLM2
  Q4_1 and the built-in model in fp32 and int8, a --prefill-tokens prompt then --max-tokens greedy tokens.
Configurations: `plain`, `ngram:K` (prompt lookup, K drafts a step), `draft:DIR[:K]` (a draft model folder).
Ratios are per round against plain, then their median. Prints tables; writes benchmarks/results/spec_decode.json
with the CPU flags and the load average before and after each part.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, llama_tool, machine  # noqa: E402  (benchmarks/common.py: also puts the clone on sys.path)

NAME = "smollm2-135m-instruct"
RESULTS = REPO / "benchmarks" / "results" / "spec_decode.json"

TEXT = ("The city council met on Tuesday evening to discuss the new public library. After two hours of debate, "
        "members agreed to open the building in March, to keep it open until nine o'clock on weekdays, and to "
        "hire four new librarians. The mayor said the library would be the heart of the neighborhood and thanked "
        "the volunteers who raised money for the children's reading room.")
TYPOS = TEXT.replace("debate", "debat").replace("weekdays", "weekdyas").replace("librarians", "librarans") \
    .replace("neighborhood", "neighbourhod").replace("volunteers", "volunters")
JSON_IN = ('{"id": 4711, "name": "Alice Martin", "email": "alice.martin@example.com", "city": "Lyon", '
           '"tags": ["admin", "editor"], "status": "pending", "score": 87.5}')
CODE = ("def average(values):\n    x = 0\n    for v in values:\n        x = x + v\n    return x / len(values)\n\n\n"
        "def report(values):\n    x = average(values)\n    print('average', x)\n    return x\n")
GROUNDED = [f"Copy the following text exactly:\n\n{TEXT}",
            f"Summarize the following text in three sentences, reusing its words:\n\n{TEXT}",
            f"Fix the spelling mistakes in this text and return the whole corrected text:\n\n{TYPOS}",
            f"Return this JSON object unchanged except that \"status\" becomes \"done\":\n\n{JSON_IN}",
            f"Rename the variable x to total in this Python code and return the whole code:\n\n{CODE}"]
CHAT = ["Tell me about the history of Rome.", "What are good habits for studying?",
        "Write a short story about a robot who learns to paint.", "Explain how rainbows form.",
        "Give me five tips for learning to cook."]
SETS = {"grounded": GROUNDED, "chat": CHAT}


def spec_config(config: str) -> dict | None:
    kind, _, rest = config.partition(":")
    if kind == "plain":
        return None
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(rest or 4)}
    if kind == "draft":
        path, k, quant = (rest.split(":") + ["", ""])[:3]
        return {"model": path, "num_speculative_tokens": int(k or 4), **({"quantization": quant} if quant else {})}
    raise SystemExit(f"unknown configuration {config!r}: plain, ngram:K or draft:MODEL[:K[:QUANT]]")


def engine_child(model: str, configs: list[str], threads: int, max_tokens: int, rotate: int) -> dict:
    """In a fresh process, one LLM per configuration: every prompt of both sets, greedy, timed from the first token
    to the last, the configurations taking turns prompt by prompt (the order rotating), so each prompt's runs are
    neighbours in time and a burst of load on the machine falls on all of them alike."""
    import torch

    torch.set_num_threads(threads)
    from py_engine import LLM, SamplingParams
    from py_engine.speculative import SpecStats

    llms = {config: LLM(model, speculative=spec_config(config)) for config in configs}
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for llm in llms.values():
        llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4))  # kernels built, caches allocated
    out = {config: {name: [] for name in SETS} for config in configs}
    turn = rotate
    for name, prompts in SETS.items():
        for question in prompts:
            turn += 1
            for config in configs[turn % len(configs):] + configs[:turn % len(configs)]:
                llm = llms[config]
                prompt = llm.chat_prompt([{"role": "user", "content": question}])
                before = None if llm.speculation is None else llm.speculation.stats.to_dict()
                start, stamps, tokens = time.perf_counter(), [], []
                for chunk in llm.stream(prompt, params, add_special_tokens=False):
                    if chunk.token_id is not None:
                        stamps.append(time.perf_counter())
                        tokens.append(chunk.token_id)
                spec = None if before is None else SpecStats.since(before, llm.speculation.stats).to_dict()
                out[config][name].append({"tokens": tokens, "ttft_s": stamps[0] - start,
                                          "decode_s": stamps[-1] - stamps[0], "speculative": spec})
    return out


def invariance_child(source: str, model: str, quantization: str, threads: int, prompt: int, new: int) -> dict:
    """In a fresh process, py_engine from `source`: one untimed warm-up, then a timed prefill and greedy decode."""
    import torch

    sys.path.insert(0, source)  # the --before checkout ahead of this clone
    torch.set_num_threads(threads)
    from py_engine.backends.torch import LLM

    llm = LLM(model, device="cpu", quantization=None if quantization == "none" else quantization)
    text = (REPO / "py_engine" / "data" / "tiny-shakespeare" / "validation.txt").read_text(encoding="utf-8")
    prompt = min(prompt, llm.max_context - new - 1)  # the built-in model's context is 256
    ids = llm.tokenizer.encode(text[: prompt * 16], add_special_tokens=False)[:prompt]
    backend = llm._new_backend()
    backend.argmax(backend.prefill(ids[:40]))  # warm-up: kernels built, caches allocated (a 32+ row chunk)
    backend = llm._new_backend()
    t0 = time.perf_counter()
    tokens = [backend.argmax(backend.prefill(ids))]
    t1 = time.perf_counter()
    while len(tokens) < new:
        tokens.append(backend.argmax(backend.decode(tokens[-1])))
    t2 = time.perf_counter()
    return {"prompt_tokens": len(ids), "prefill_tps": len(ids) / (t1 - t0), "decode_tps": (new - 1) / (t2 - t1),
            "tokens": tokens}


INVARIANCE_MODELS = [(NAME, "none"), ("tiny-shakespeare", "none"), ("tiny-shakespeare", "int8")]


def invariance_part(before: str, rounds: int, threads: int, prompt: int, new: int) -> dict:
    from benchmarks.decode_engines import source_tree

    trees = {"main": str(REPO), "before": str(source_tree(before))}
    runs = []
    for r in range(rounds):
        for model, quant in INVARIANCE_MODELS:
            for tree in (["main", "before"] if r % 2 == 0 else ["before", "main"]):
                got = run_child(["invariance", trees[tree], model, quant, str(threads), str(prompt), str(new)],
                                threads)
                runs.append({"round": r, "tree": tree, "model": model, "quantization": quant,
                             "loadavg": os.getloadavg()[0], **got})
                print(f"invariance round {r} {model}:{quant} {tree:6s} prefill {got['prefill_tps']:7.1f} "
                      f"decode {got['decode_tps']:6.1f} tok/s", flush=True)
    summary = {}
    print("\n| model | prefill main / before (tok/s) | x | decode main / before (tok/s) | x |")
    print("| --- | --- | --- | --- | --- |")
    for model, quant in INVARIANCE_MODELS:
        mine = [x for x in runs if (x["model"], x["quantization"]) == (model, quant)]
        pair = {(x["round"], x["tree"]): x for x in mine}
        row = {}
        for metric in ("prefill_tps", "decode_tps"):
            row[metric] = {t: statistics.median(x[metric] for x in mine if x["tree"] == t) for t in trees}
            row[metric]["x_before"] = statistics.median(pair[(k, "main")][metric] / pair[(k, "before")][metric]
                                                        for k in range(rounds))
        row["same_tokens"] = all(pair[(k, "main")]["tokens"] == pair[(k, "before")]["tokens"] for k in range(rounds))
        summary[f"{model}:{quant}"] = row
        p, d = row["prefill_tps"], row["decode_tps"]
        print(f"| {model} {quant} | {p['main']:.0f} / {p['before']:.0f} | x{p['x_before']:.2f} | "
              f"{d['main']:.1f} / {d['before']:.1f} | x{d['x_before']:.2f} |")
    return {"before": before, "prefill_tokens": prompt, "runs": [{k: v for k, v in x.items() if k != "tokens"}
                                                                 for x in runs], "summary": summary}


def run_child(args: list[str], threads: int, timeout: float = 3600) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rate(rows: list[dict]) -> float:
    """Decode tok/s of a set: its tokens after the first over the time they took."""
    return sum(len(r["tokens"]) - 1 for r in rows) / sum(r["decode_s"] for r in rows)


def acceptance(rows: list[dict]) -> dict | None:
    stats = [r["speculative"] for r in rows if r["speculative"]]
    if not stats:
        return None
    drafted = sum(s["num_draft_tokens"] for s in stats)
    accepted = sum(s["num_accepted_tokens"] for s in stats)
    steps = sum(s["num_drafts"] for s in stats)
    width = max(len(s["accepted_per_position"]) for s in stats)
    per_pos = [sum(s["accepted_per_position"][i] for s in stats if i < len(s["accepted_per_position"]))
               for i in range(width)]
    return {"draft_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": accepted / drafted if drafted else 0,
            "verify_steps": steps, "accepted_per_position": per_pos,
            "per_position_rate": [n / steps if steps else 0 for n in per_pos]}


def engine_part(model: str, configs: list[str], rounds: int, threads: int, max_tokens: int) -> dict:
    runs = []
    for r in range(rounds):
        got = run_child(["engine", model, ",".join(configs), str(threads), str(max_tokens), str(r)], threads)
        for config in configs:
            runs.append({"round": r, "config": config, "loadavg": os.getloadavg()[0], "sets": got[config]})
            print(f"engine round {r} {config:16s} " + "  ".join(f"{s} {rate(got[config][s]):6.1f} tok/s"
                                                               for s in SETS), flush=True)
    plain = {r["round"]: r for r in runs if r["config"] == "plain"}
    for run in runs:  # speculation changes no token: the script stops if it ever did
        for s in SETS:
            for a, b in zip(run["sets"][s], plain[run["round"]]["sets"][s]):
                if a["tokens"] != b["tokens"]:
                    raise SystemExit(f"{run['config']} changed a greedy output in set {s}")
    summary = {}
    for config in configs:
        mine = {r["round"]: r for r in runs if r["config"] == config}
        summary[config] = {s: {"decode_tps": statistics.median(rate(m["sets"][s]) for m in mine.values()),
                               "x_plain": statistics.median(rate(m["sets"][s]) / rate(plain[k]["sets"][s])
                                                            for k, m in mine.items()),
                               "acceptance": acceptance([row for m in mine.values() for row in m["sets"][s]])}
                           for s in SETS}
    print("\n| configuration | grounded tok/s | x plain | acceptance, by position | chat tok/s | x plain "
          "| acceptance, by position |")
    print("| --- | --- | --- | --- | --- | --- | --- |")

    def acc(a: dict | None) -> str:
        return f"{a['acceptance_rate']:.2f}: " + " ".join(f"{p:.2f}" for p in a["per_position_rate"]) if a else "-"
    for config, s in summary.items():
        print(f"| {config} | {s['grounded']['decode_tps']:.1f} | x{s['grounded']['x_plain']:.2f} | "
              f"{acc(s['grounded']['acceptance'])} | {s['chat']['decode_tps']:.1f} | x{s['chat']['x_plain']:.2f} | "
              f"{acc(s['chat']['acceptance'])} |")
    return {"runs": runs, "summary": summary}


def server_batch(url: str, max_tokens: int, concurrency: int) -> dict:
    import openai

    questions = [q for i in range(concurrency) for q in [(GROUNDED + CHAT)[i % (len(GROUNDED) + len(CHAT))]]]

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1800)
        async with client:
            return await asyncio.gather(*(client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0)
                for q in questions))
    start = time.perf_counter()
    outs = asyncio.run(run())
    wall = time.perf_counter() - start
    tokens = sum(o.usage.completion_tokens for o in outs)
    return {"wall_s": wall, "completion_tokens": tokens, "out_tps": tokens / wall,
            "texts": [o.choices[0].message.content for o in outs]}


def server_part(configs: list[str], rounds: int, threads: int, max_tokens: int, concurrency: int, logs: Path) -> dict:
    """Every configuration's server up at once (started and warmed before any batch is timed), then rounds of
    one batch each, the order rotating: neighbouring batches share the machine's load, no server start between."""
    from contextlib import ExitStack

    from tests.server.server_harness import running_server

    runs = []
    with ExitStack() as stack:
        servers = {}
        for config in configs:
            spec = spec_config(config)
            extra = [] if spec is None else ["--speculative-config", json.dumps(spec)]
            servers[config] = stack.enter_context(
                running_server(NAME, "--max-concurrent", str(concurrency), *extra, log_dir=logs, threads=threads))
            server_batch(servers[config].url, 8, 2)  # warm-up: kernels built
        for r in range(rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for config in order:
                server = servers[config]
                before, cpu = server.metrics(), cpu_seconds(server.process.pid)
                got = server_batch(server.url, max_tokens, concurrency)
                got["server_cpu_s"] = cpu_seconds(server.process.pid) - cpu  # less swayed by others' load than wall
                metrics = server.metrics()
                for key, name in (("accepted", "accepted"), ("drafted", "draft")):
                    total = f"ruvllm_spec_decode_num_{name}_tokens_total"
                    got[key] = None if total not in metrics else metrics[total] - before.get(total, 0)
                runs.append({"round": r, "config": config, "loadavg": os.getloadavg()[0], **got})
                print(f"server round {r} {config:16s} c={concurrency} {got['out_tps']:6.1f} tok/s, "
                      f"{got['server_cpu_s']:.2f} CPU s (drafted {got['drafted']})", flush=True)
    plain = {r["round"]: r for r in runs if r["config"] == "plain"}
    summary = {c: {"out_tps": statistics.median(r["out_tps"] for r in runs if r["config"] == c),
                   "x_plain": statistics.median(r["out_tps"] / plain[r["round"]]["out_tps"]
                                                for r in runs if r["config"] == c),
                   "cpu_x_plain": statistics.median(plain[r["round"]]["server_cpu_s"] / r["server_cpu_s"]
                                                    for r in runs if r["config"] == c)} for c in configs}
    for c, s in summary.items():
        print(f"server {c}: {s['out_tps']:.1f} tok/s, x{s['x_plain']:.2f} of plain at c={concurrency} "
              f"(CPU seconds: x{s['cpu_x_plain']:.2f})")
    return {"runs": [{k: v for k, v in r.items() if k != "texts"} for r in runs], "summary": summary}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process (every thread) has used: /proc/PID/stat's utime and stime."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def llama_part(rounds: int, threads: int, max_tokens: int, draft: Path | None, logs: Path) -> dict:
    from benchmarks.smollm2_speed import gguf_path
    from tests.server.server_harness import free_port, http_process

    import httpx

    gguf = gguf_path()
    # ngram-simple as llama.cpp ships it (a 12-token n-gram, drafts up to 48) and sized as ruvllm's ngram:4
    modes = {"plain": [], "ngram-simple": ["--spec-type", "ngram-simple"],
             "ngram-simple:n3m4": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                   "--spec-ngram-simple-size-m", "4"]}
    if draft is not None:
        modes["draft"] = ["--model-draft", str(draft), "--spec-draft-n-max", "4"]
    runs = []
    for r in range(rounds):
        for mode, extra in modes.items():
            port = free_port()
            command = [str(llama_tool("llama-server")), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t",
                       str(threads), "-np", "1", "--poll", "0", *extra]
            env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
            with http_process(command, f"http://127.0.0.1:{port}", "/health", logs / f"llama-{port}.log",
                              "llama-server", env=env):
                sets = {}
                for name, prompts in SETS.items():
                    done = []
                    for q in prompts:
                        body = {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                                "temperature": 0, "cache_prompt": False}
                        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                           timeout=1800).json()
                        t = reply["timings"]
                        done.append({"tokens": t["predicted_n"], "decode_s": t["predicted_ms"] / 1000,
                                     "draft_n": t.get("draft_n"), "draft_accepted": t.get("draft_n_accepted")})
                    sets[name] = done
            runs.append({"round": r, "mode": mode, "loadavg": os.getloadavg()[0], "sets": sets})
            print(f"llama-server round {r} {mode:13s} " + "  ".join(
                f"{s} {sum(x['tokens'] for x in v) / sum(x['decode_s'] for x in v):6.1f} tok/s" for s, v in sets.items()),
                flush=True)
    summary = {}
    for mode in modes:
        mine = {r["round"]: r for r in runs if r["mode"] == mode}
        plain = {r["round"]: r for r in runs if r["mode"] == "plain"}
        tps = lambda rows: sum(x["tokens"] for x in rows) / sum(x["decode_s"] for x in rows)  # noqa: E731
        summary[mode] = {s: {"decode_tps": statistics.median(tps(m["sets"][s]) for m in mine.values()),
                             "x_plain": statistics.median(tps(m["sets"][s]) / tps(plain[k]["sets"][s])
                                                          for k, m in mine.items())} for s in SETS}
        print(f"llama-server {mode}: " + ", ".join(f"{s} {v['decode_tps']:.1f} tok/s x{v['x_plain']:.2f}"
                                                  for s, v in summary[mode].items()))
    return {"runs": runs, "summary": summary}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        if sys.argv[2] == "invariance":
            source, model, quant, threads, prompt, new = sys.argv[3:]
            print(json.dumps(invariance_child(source, model, quant, int(threads), int(prompt), int(new))))
            return 0
        _, _, kind, model, configs, threads, max_tokens, rotate = sys.argv
        print(json.dumps(engine_child(model, configs.split(","), int(threads), int(max_tokens), int(rotate))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="engine,server,llama")
    p.add_argument("--model", default=NAME, help="the engine part's target (the server and llama parts: SmolLM2)")
    p.add_argument("--configs", default="plain,ngram:4")
    p.add_argument("--server-configs", default="plain,ngram:4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--before", default="93e4dc4^", help="the revision the invariance part compares with")
    p.add_argument("--prefill-tokens", type=int, default=256, help="the invariance part's prompt length")
    p.add_argument("--llama-draft", type=Path, help="a draft GGUF for llama-server --model-draft")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--note", default="", help="recorded in the JSON (e.g. whether bench.lock was held)")
    args = p.parse_args()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "spec_decode_logs"
    logs.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model, "threads": args.threads,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "configs": args.configs, "note": args.note,
            **machine()}
    result = {"meta": meta}
    for part in parts:
        load = os.getloadavg()
        if part == "engine":
            result["engine"] = engine_part(args.model, args.configs.split(","), args.rounds, args.threads,
                                           args.max_tokens)
        elif part == "server":
            result["server"] = server_part(args.server_configs.split(","), args.rounds, args.threads, args.max_tokens,
                                           args.concurrency, logs)
        elif part == "llama":
            result["llama"] = llama_part(args.rounds, args.threads, args.max_tokens, args.llama_draft, logs)
        elif part == "invariance":
            result["invariance"] = invariance_part(args.before, args.rounds, args.threads, args.prefill_tokens,
                                                   args.max_tokens)
        else:
            raise SystemExit(f"unknown part {part!r}")
        result[part]["loadavg"] = {"before": load, "after": os.getloadavg()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # each part as it ends: a later one may fail
    meta["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
