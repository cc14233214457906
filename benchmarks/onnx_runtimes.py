"""Export variants x runtimes: which graph each onnxruntime runs best (issue 4).

    python benchmarks/onnx_runtimes.py --model tiny|tiny-shakespeare|mid|qwen0.5b [--threads 1 2]
        [--variants native-int4 web-int4 ...] [--runtimes node web python] [--prompt 32] [--decode 32]
        [--work DIR]

Exports each variant (target x precision) of one checkpoint into its own
folder, then times it in onnxruntime-node and onnxruntime-web's wasm backend
(benchmarks/onnx_js_runtimes.mjs, each run a fresh Node process) and in
onnxruntime in CPython (a fresh Python process): session creation, prefill of
32 tokens, 32 greedy decode steps with the KV cache fed back, peak RSS, and
whether the graph loads at all. Prints a table and writes
benchmarks/results/onnx_runtimes[_<model>].json. The JS runtimes come from
`npm ci --prefix tests/web/js`.

Models: tiny (tests/tiny_models.py's random qwen2: overhead only), the built-in
tiny-shakespeare, mid (random Qwen2, hidden 1024, 8 layers, 32k vocab: real
matmuls) and qwen0.5b (random weights in Qwen2.5-0.5B's shape).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)
VARIANTS = {"native-int4": ("int4", "native"), "web-int4": ("int4", "web"), "native-int8": ("int8", "native"),
            "web-int8": ("int8", "web"), "native-fp32": ("fp32", "native"), "plain-fp32": ("fp32", "plain"),
            "native-fp16": ("fp16", "native")}
MID = dict(model_type="qwen2", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=True,
           initializer_range=0.02)
PROMPT, DECODE = 32, 32

PY_RUNNER = r'''
import json, sys, time
import numpy as np, onnxruntime as ort
model, threads, prompt, decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
contract = json.load(open(model.rsplit("/onnx/", 1)[0] + "/ruvllm_contract.json"))
entry = contract["files"]["onnx/" + model.rsplit("/", 1)[1]]
kv = np.float16 if entry["kv_dtype"] == "float16" else np.float32
out = {"ok": False}
try:
    opts = ort.SessionOptions(); opts.intra_op_num_threads = threads; opts.inter_op_num_threads = 1
    for key, value in entry.get("session_options", {}).items():
        opts.add_session_config_entry(key, value)
    t = time.perf_counter(); sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    out["create_s"] = time.perf_counter() - t
    names = [o.name for o in sess.get_outputs()]
    def run(ids, start, past):
        total = start + len(ids)
        feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, total), np.int64),
                "position_ids": np.arange(start, total, dtype=np.int64)[None]}
        for i in range(contract["num_layers"]):
            for k in ("key", "value"):
                feed[f"past_key_values.{i}.{k}"] = past[f"present.{i}.{k}"] if past else np.zeros(
                    (1, contract["kv_heads"], 0, contract["head_dim"]), kv)
        return dict(zip(names, sess.run(None, feed)))
    ids = [(i * 7919 + 13) % contract["vocab_size"] for i in range(prompt)]
    t = time.perf_counter(); run(ids[:4], 0, None); out["warmup_s"] = time.perf_counter() - t
    t = time.perf_counter(); r = run(ids, 0, None); out["prefill_s"] = time.perf_counter() - t
    tokens = [int(r["logits"][0, -1].argmax())]
    t = time.perf_counter()
    for s in range(decode):
        r = run([tokens[-1]], prompt + s, r); tokens.append(int(r["logits"][0, -1].argmax()))
    out.update(decode_tok_s=decode / (time.perf_counter() - t), tokens=tokens, ok=True)
except Exception as e:
    out["error"] = str(e).splitlines()[0][:300]
out["peak_rss_mb"] = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
print(json.dumps(out))
'''


def checkpoint(name: str, work: Path) -> Path:
    """The model folder for `name` (built once under work/)."""
    if name == "tiny-shakespeare":
        return REPO / "py_engine" / "data" / "tiny-shakespeare"
    folder = work / name / "checkpoint"
    if (folder / "config.json").exists():
        return folder
    if name == "tiny":
        from tests.tiny_models import build_tiny_model
        return build_tiny_model(folder, "qwen2")
    if name == "mid":
        from tests.tiny_models import build_tiny_model
        return build_tiny_model(folder, **MID)
    if name == "qwen0.5b":
        from onnx_decode import make_checkpoint
        make_checkpoint(folder)
        return folder
    raise SystemExit(f"unknown model {name!r}")


def export_variant(ckpt: Path, out: Path, variant: str) -> tuple[Path, float]:
    from export.exporter import export_model
    from export.options import ExportOptions

    precision, target = VARIANTS[variant]
    options = ExportOptions(precision=precision, target=target)
    path = out / "onnx" / options.file_name
    if path.exists() and (out / "ruvllm_contract.json").exists():
        return path, float("nan")
    result = export_model(ckpt, out, options)
    return result.model_path, result.seconds


def run_js(models: list[Path], runtimes: list[str], threads: list[int], prompt: int, decode: int) -> list[dict]:
    cmd = ["node", str(REPO / "benchmarks" / "onnx_js_runtimes.mjs"), "--models", ",".join(map(str, models)),
           "--runtimes", ",".join(runtimes), "--threads", ",".join(map(str, threads)),
           "--prompt", str(prompt), "--decode", str(decode)]
    rows = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            rows.append(json.loads(line))
            print_row(rows[-1])
    return rows


def run_python(model: Path, threads: int, prompt: int, decode: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-c", PY_RUNNER, str(model), str(threads), str(prompt), str(decode)],
                          capture_output=True, text=True, env=env, timeout=3600)
    try:
        r = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        r = {"ok": False, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    return {"model": str(model), "runtime": "onnxruntime (CPython)", "threads": threads, **r}


def merged_rows(results: Path, rows: list[dict]) -> list[dict]:
    """Earlier rows of the same results file, replaced where this run measured the same (variant,
    runtime, threads): so a run over a few variants updates the table instead of truncating it."""
    def key(r):
        return r["variant"], r["runtime"], r["threads"]
    old = json.loads(results.read_text())["rows"] if results.exists() else []
    new = {key(r) for r in rows}
    return [r for r in old if key(r) not in new] + rows


def print_row(r: dict) -> None:
    name = f"{Path(r['model']).parent.parent.name}"
    if not r["ok"]:
        print(f"{name:12} {r['runtime']:22} {r['threads']:2}  FAILS: {r.get('error')}", flush=True)
        return
    print(f"{name:12} {r['runtime']:22} {r['threads']:2} {r['create_s']:8.2f} {r['prefill_s'] * 1000:10.1f} "
          f"{r['decode_tok_s']:9.1f} {r['peak_rss_mb']:8.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--runtimes", nargs="+", default=["node", "web", "python"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prefill tokens (default 32)")
    parser.add_argument("--decode", type=int, default=DECODE, help="greedy decode steps (default 32)")
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / ".cache" / "onnx_runtimes")
    parser.add_argument("--note", default="", help="what the numbers need to be read with (machine load, say)")
    args = parser.parse_args()
    ckpt = checkpoint(args.model, args.work)
    exports = {}
    for v in args.variants:
        path, seconds = export_variant(ckpt, args.work / args.model / v, v)
        exports[v] = {"path": path, "export_s": seconds, "size_mb": sum(
            f.stat().st_size for f in path.parent.glob(path.name + "*")) / 1e6}
        print(f"exported {v}: {exports[v]['size_mb']:.1f} MB", flush=True)
    print(f"{'variant':12} {'runtime':22} {'th':2} {'create s':>8} {'prefill ms':>10} {'decode/s':>9} {'RSS MB':>8}")
    js = [r for r in args.runtimes if r in ("node", "web")]
    rows = run_js([e["path"] for e in exports.values()], js, args.threads, args.prompt, args.decode) if js else []
    if "python" in args.runtimes:
        for e in exports.values():
            for t in args.threads:
                rows.append(run_python(e["path"], t, args.prompt, args.decode))
                print_row(rows[-1])
    by_path = {str(e["path"]): v for v, e in exports.items()}
    for r in rows:
        v = by_path[r.pop("model")]
        r.update(variant=v, size_mb=exports[v]["size_mb"], export_s=exports[v]["export_s"])
    suffix = "" if args.model == "tiny-shakespeare" else f"_{args.model}"
    results = REPO / "benchmarks" / "results" / f"onnx_runtimes{suffix}.json"
    config = json.loads((ckpt / "config.json").read_text())
    rows = merged_rows(results, rows)
    results.write_text(json.dumps({
        "note": args.note, "cpus": os.cpu_count(), "model": args.model, "shape": {k: config.get(k) for k in ("hidden_size", "intermediate_size",
                                                                   "num_hidden_layers", "vocab_size")},
        "prompt": args.prompt, "decode": args.decode, "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average": os.getloadavg(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
