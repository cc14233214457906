"""A Qwen2.5-1.5B-shape int4 model (random weights) in the page and in the npm package: it loads, decodes, fits.

    .venv/bin/python benchmarks/web_big.py [--tokens 8] [--threads 2]

Builds random Qwen2.5-1.5B-shape weights (bf16, Qwen2.5's own tokenizer from ../shared when present), exports
them int4 for the web (RTN, blocks of 32, the tied 151936 x 1536 table once), then runs a greedy completion
with the package's wasm kernels in Node (createEngine, runtime 'web') and in the demo page in headless Chromium,
recording load time, decode tok/s and peak memory (Node's process RSS; Chromium's renderer RSS, and after the
completion Chromium's own count, performance.measureUserAgentSpecificMemory), against the export's size. Before the kernels the web graph folded every weight to float32 at session start: 4 bytes a
parameter, past wasm's 4 GiB for this model. Writes benchmarks/results/web_big.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)

WORK = REPO / ".cache" / "web-big"
RESULTS = REPO / "benchmarks" / "results" / "web_big.json"
QWEN_TOKENIZER = REPO.parent / "shared" / "fixtures" / "tokenizers" / "qwen2.5"
CONFIG = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
              num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
              rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
              eos_token_id=151645, torch_dtype="bfloat16")
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def checkpoint() -> Path:
    folder = WORK / "qwen1.5b-checkpoint"
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_models import train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(CONFIG)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if QWEN_TOKENIZER.is_dir():
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(QWEN_TOKENIZER / f, folder / f)
    else:
        train_tokenizer(folder)
    return folder


def export(ckpt: Path) -> Path:
    from export.exporter import export_model
    from export.options import ExportOptions
    from py_engine.models import load_model

    out = WORK / "qwen1.5b-export"
    if not (out / "onnx" / "model_q4_web.onnx").exists():
        # bf16 in memory (3 GB; float32 would be 6, and the export quantizes one weight at a time)
        model, _ = load_model(ckpt, dtype="bfloat16")
        export_model(ckpt, out, ExportOptions(precision="int4", target="web"), model=model)
    return out


def node_run(out: Path, tokens: int, threads: int) -> dict:
    script = f"""
import {{ createEngine }} from {json.dumps(str(REPO / 'npm' / 'src' / 'index.js'))};
const t0 = performance.now();
const engine = await createEngine({{ model: {json.dumps(str(out))}, runtime: 'web', precision: 'int4', threads: {threads} }});
const loadMs = performance.now() - t0;
const r = await engine.completions.create({{ prompt: {json.dumps(PROMPT)}, max_tokens: {tokens}, temperature: 0,
  ignore_eos: true, return_token_ids: true }});
const s = engine.lastStats;
const out = {{ loadMs, runtime: engine.stats.runtime, tokens: r.choices[0].token_ids.length,
  decodeTokPerS: (s.completionTokens - 1) / (s.decodeMs / 1000), ttftMs: s.firstTokenMs }};
await engine.dispose();
process.stdout.write(JSON.stringify(out) + '\\n');
"""
    path = WORK / "node_run.mjs"
    path.write_text(script)
    start = time.time()
    done = subprocess.run(["/usr/bin/time", "-v", "node", str(path)], capture_output=True, text=True, timeout=3600,
                          cwd=REPO / "npm")
    peak = next((int(line.split(":")[1]) for line in done.stderr.splitlines() if "Maximum resident" in line), 0)
    if done.returncode:
        return {"error": done.stderr[-1500:], "peak_rss_mib": peak / 1024}
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"peak_rss_mib": round(peak / 1024, 1),
                                                                "seconds": round(time.time() - start, 1)}


def page_run(out: Path, tokens: int, threads: int) -> dict:
    from web_bench import RendererPeak

    from tests.web.web_harness import browser, static_server
    from web.build import build_dist

    dist = build_dist(WORK / "dist", {"qwen1.5b": out}, builtin=False)
    for f in ("bench.html", "bench.js"):
        shutil.copy(REPO / "benchmarks" / "web" / f, dist / f)
    # ForceEagerMeasureMemory: measureUserAgentSpecificMemory answers at once, not at the next GC (web_bench.py)
    with static_server(dist) as base, browser(WORK / "profile",
                                              extra_args=("--enable-blink-features=ForceEagerMeasureMemory",)) \
            as (context, _):
        page = context.new_page()
        page.goto(base + "bench.html")
        page.wait_for_function("document.getElementById('status').textContent === 'ready'")
        page.evaluate("async () => { for (const k of await caches.keys()) await caches.delete(k); }")
        with RendererPeak() as peak:
            try:
                row = page.evaluate("(a) => window.bench.ours(a)", {"model": "qwen1.5b", "precision": "int4",
                                    "threads": threads, "prompt": PROMPT, "tokens": tokens, "device": "wasm"})
            except Exception as error:
                row = {"error": str(error)[:1500]}
        if (row.get("uaMemory") or {}).get("bytes"):  # after the completion, the engine still loaded
            row["ua_memory_mib"] = round(row["uaMemory"]["bytes"] / 2**20, 1)
        return row | {"peak_renderer_rss_mib": round(peak.peak, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    t = time.time()
    out = export(checkpoint())
    files = [out / "onnx" / "model_q4_web.onnx"] + sorted((out / "onnx").glob("model_q4_web.onnx_data*"))
    size = sum(f.stat().st_size for f in files)
    print(f"export ready ({size / 2**20:.0f} MiB, {time.time() - t:.0f} s)", flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "config": CONFIG, "export_mib": round(size / 2**20, 1),
              "load_before": os.getloadavg()}
    result["node"] = node_run(out, args.tokens, args.threads)
    print("node", json.dumps(result["node"]), flush=True)
    result["page"] = page_run(out, args.tokens, args.threads)
    print("page", json.dumps(result["page"]), flush=True)
    result["load_after"] = os.getloadavg()
    for where, key in (("node", "peak_rss_mib"), ("page", "peak_renderer_rss_mib")):
        if result[where].get(key):
            result[where]["peak_vs_file"] = round(result[where][key] / result["export_mib"], 2)
    if result["page"].get("ua_memory_mib"):  # Chromium's own count of the page's JS and wasm memory
        result["page"]["ua_memory_vs_file"] = round(result["page"]["ua_memory_mib"] / result["export_mib"], 2)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
