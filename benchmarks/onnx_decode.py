"""Decode and prefill speed, file size and peak RSS of ruvllm's ONNX exports vs onnxruntime-genai's builder.

    python benchmarks/onnx_decode.py [--work DIR] [--precisions fp32 int8 int4] [--threads 2]

On a random-weight model with Qwen2.5-0.5B's shape (the same checkpoint for
both exporters): our fp32 / int8 / int4 exports run in onnxruntime (CPython,
through py_engine's OnnxBackend) and, since they carry a genai_config.json,
in onnxruntime-genai too; the builder's exports
(`python -m onnxruntime_genai.models.builder -i DIR -o OUT -p int4 -e cpu`)
run in onnxruntime-genai. Each measurement is a fresh process, so peak RSS is
its own. Prints a table and writes benchmarks/results/onnx_decode.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)
CONFIG = REPO.parent / "shared" / "fixtures" / "configs" / "qwen2.5-0.5b-instruct" / "config.json"
PROMPT, DECODE = 128, 64


def make_checkpoint(folder: Path) -> None:
    """Random Qwen2.5-0.5B-shape weights (bf16, like the real checkpoint) and a small tokenizer."""
    if (folder / "model.safetensors").exists():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_models import train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(CONFIG.read_text())
    cfg.pop("_name_or_path", None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    train_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))


def export_ours(ckpt: Path, out: Path, precision: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ruvllm_cli", "export", str(ckpt), "--out", str(out),
                    "--precision", precision], check=True, cwd=REPO)
    return time.perf_counter() - start


def export_builder(ckpt: Path, out: Path, precision: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
                    "-p", precision, "-e", "cpu", "-c", str(out / "cache")], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.rmtree(out / "cache", ignore_errors=True)
    return time.perf_counter() - start


def set_genai_threads(folder: Path, threads: int, filename: str | None = None) -> None:
    path = folder / "genai_config.json"
    cfg = json.loads(path.read_text())
    cfg["model"]["decoder"]["session_options"].update(intra_op_num_threads=threads, inter_op_num_threads=1)
    if filename:
        cfg["model"]["decoder"]["filename"] = filename
    path.write_text(json.dumps(cfg, indent=2))


RUNNER = r'''
import json, sys, time
kind, folder, precision, threads, prompt_len, decode = sys.argv[1:7]
threads, prompt_len, decode = int(threads), int(prompt_len), int(decode)
ids = [(i * 7919) % 150000 + 10 for i in range(prompt_len)]
if kind == "ours":
    from py_engine.backends.onnx import OnnxModel
    t0 = time.perf_counter(); backend = OnnxModel(folder, precision, "cpu", threads).backend(4096)
    load = time.perf_counter() - t0
    backend.prefill(ids[:8])  # warm-up
    t0 = time.perf_counter(); logits = backend.prefill(ids); prefill = time.perf_counter() - t0
    token = backend.argmax(logits)
    t0 = time.perf_counter()
    for _ in range(decode):
        token = backend.argmax(backend.decode(token))
    dec = time.perf_counter() - t0
else:
    import onnxruntime_genai as og
    t0 = time.perf_counter(); model = og.Model(folder); load = time.perf_counter() - t0
    def run(n_prompt, n_new):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=n_prompt + n_new, do_sample=False)
        g = og.Generator(model, params)
        t0 = time.perf_counter(); g.append_tokens(ids[:n_prompt]); g.generate_next_token()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n_new - 1):
            g.generate_next_token()
        return first, time.perf_counter() - t0
    run(8, 2)  # warm-up
    prefill, dec = run(prompt_len, decode + 1)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"load_s": load, "prefill_tok_s": prompt_len / prefill, "decode_tok_s": decode / dec,
                  "peak_rss_mb": hwm / 1024}))
'''


def measure(kind: str, folder: Path, precision: str, threads: int) -> dict:
    """Run one measurement in a fresh process. Its peak RSS is VmHWM, read in the child: the rusage
    maxrss of a child also counts the parent's high-water mark inherited through fork."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, kind, str(folder), precision, str(threads),
                             str(PROMPT), str(DECODE)], stdout=subprocess.PIPE, env=env, cwd=REPO)
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{kind} {precision} failed")
    return json.loads(out.decode().strip().splitlines()[-1])


def onnx_size(folder: Path, stem: str) -> int:
    return sum(f.stat().st_size for f in (folder / "onnx").glob(f"{stem}*")) if (folder / "onnx").exists() else \
        sum(f.stat().st_size for f in folder.glob(f"{stem}*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / ".cache" / "onnx_bench")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int8", "int4"])
    parser.add_argument("--builder", nargs="*", default=["int4", "fp32"], help="builder precisions to compare")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ckpt = args.work / "checkpoint"
    make_checkpoint(ckpt)
    from export.options import FILE_NAMES

    rows = []
    for p in args.precisions:
        out = args.work / "ours"
        seconds = export_ours(ckpt, out, p)
        set_genai_threads(out, args.threads, f"onnx/{FILE_NAMES[p]}")
        size = onnx_size(out, FILE_NAMES[p])
        rows.append({"exporter": "ruvllm", "runtime": "onnxruntime", "precision": p, "export_s": seconds,
                     "size_mb": size / 1e6, **measure("ours", out, p, args.threads)})
        rows.append({"exporter": "ruvllm", "runtime": "onnxruntime-genai", "precision": p, "export_s": seconds,
                     "size_mb": size / 1e6, **measure("genai", out, p, args.threads)})
        print(rows[-2], rows[-1], flush=True)
    for p in args.builder:
        out = args.work / f"builder_{p}"
        seconds = export_builder(ckpt, out, p)
        set_genai_threads(out, args.threads)
        size = sum(f.stat().st_size for f in out.glob("model.onnx*"))
        rows.append({"exporter": "genai builder", "runtime": "onnxruntime-genai", "precision": p, "export_s": seconds,
                     "size_mb": size / 1e6, **measure("genai", out, p, args.threads)})
        print(rows[-1], flush=True)
    print_table(rows)
    results = REPO / "benchmarks" / "results" / "onnx_decode.json"
    results.write_text(json.dumps({"threads": args.threads, "prompt": PROMPT, "decode": DECODE, "rows": rows},
                                  indent=1) + "\n")


def print_table(rows: list[dict]) -> None:
    head = f"{'exporter':14} {'runtime':18} {'prec':5} {'decode tok/s':>12} {'prefill tok/s':>13} " \
           f"{'size MB':>8} {'RSS MB':>7} {'export s':>8}"
    print(head)
    for r in rows:
        print(f"{r['exporter']:14} {r['runtime']:18} {r['precision']:5} {r['decode_tok_s']:12.1f} "
              f"{r['prefill_tok_s']:13.1f} {r['size_mb']:8.0f} {r['peak_rss_mb']:7.0f} {r['export_s']:8.1f}")


if __name__ == "__main__":
    main()
