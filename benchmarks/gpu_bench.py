"""The GPU path measured: kernel bandwidth against the GPU's own ceiling, and the server against transformers.

    python benchmarks/gpu_bench.py [--parts copy attention quant server] [--levels 1,16,64]

On one CUDA GPU (nothing here runs without one):
  copy       the bandwidth ceiling: a 2 GiB device-to-device copy, bytes read + written (METHOD.md).
  attention  paged decode (Triton, split-KV) at 4k context, Llama-3-8B's attention shape (32 query
             heads, 8 KV heads, head_dim 128, bf16, 16-token blocks), batches of 1-64: bytes of K and V
             read per second against the copy ceiling; beside it the torch oracle (gather + SDPA) and
             SDPA on a dense cache (no paging: the peer's ceiling). Plus one 2k-token causal prefill,
             TFLOP/s against dense SDPA. Caches are rotated so no timing runs out of the 50 MB L2.
  quant      weight-only matmul, Llama-3-8B's MLP shapes, int4 g128 and int8 per channel, 1 and 16
             rows: Triton against torch's _weight_int4pack_mm / _weight_int8pack_mm and bf16 cuBLAS.
  server     `ruvllm serve` (bf16, Qwen2.5-0.5B's shape, random weights, Qwen2.5's tokenizer) at
             each concurrency over streaming HTTP (native_server.bench.loadgen), for the Triton
             backend with CUDA graphs, without them, and the torch backend; against transformers'
             batched generate (bf16, SDPA, dynamic cache) on the same weights and GPU, one batch of
             `concurrency` prompts. 128-token prompts, 128 greedy tokens, EOS ignored.
Kernel times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph: no launch
gaps, as in the server's decode graphs); `*_eager_ms` are do_bench medians of eager calls. Writes
benchmarks/results/gpu_bench.json and prints the tables.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)

RESULTS = REPO / "benchmarks" / "results" / "gpu_bench.json"
L2_BYTES = 50 * 2**20
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def median_ms(fn: Callable[[], Any]) -> float:
    """Eager calls, CUDA events: includes the host's launch overhead where the GPU outruns it."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_ms(fn: Callable[[], Any]) -> float:
    """Replays of a CUDA graph of many calls (METHOD.md): the GPU's time without launch gaps, as the
    server's decode graphs run them."""
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))


def rotations(bytes_per_set: int) -> int:
    """Input sets to cycle through so the working set is 4x the L2."""
    return max(1, -(-4 * L2_BYTES // max(bytes_per_set, 1)))


def cycling(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    state = {"i": 0}

    def call() -> Any:
        state["i"] += 1
        return fns[state["i"] % len(fns)]()
    return call


# --- ceilings ---------------------------------------------------------------------------------------------
def copy_bandwidth() -> dict[str, Any]:
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB of random data, never zeros
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return {"bytes": 2 * src.nbytes, "ms": ms, "gb_s": 2 * src.nbytes / ms / 1e6}


# --- attention ------------------------------------------------------------------------------------------
def decode_case(batch: int, context: int) -> dict[str, Any]:
    from native_server.engine.attention import PagedMetadata, TorchPagedAttention, decode_kv_positions
    from native_server.engine.attention.triton import TritonPagedAttention
    from py_engine.models import AttentionSpec

    per_set = 2 * batch * context * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    sets, nb = rotations(per_set), -(-context // BLOCK)
    caches = [torch.randn(sets * batch * nb, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
              for _ in range(2)]
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    spec, lens = AttentionSpec(HEAD_DIM ** -0.5), torch.full((batch,), context)

    def meta(i: int) -> PagedMetadata:
        tables = torch.randperm(batch * nb, device="cuda").view(batch, nb) + i * batch * nb  # scattered blocks
        return PagedMetadata(torch.zeros(batch, dtype=torch.long, device="cuda"), lens.cuda() - 1,
                             list(range(batch + 1)), [context] * batch, tables, torch.arange(batch, device="cuda"),
                             torch.arange(batch, device="cuda"), decode_kv_positions(lens, BLOCK).cuda(), [])
    triton_backend, oracle = TritonPagedAttention(), TorchPagedAttention()
    metas = [triton_backend.prepare(meta(i)) for i in range(sets)]
    row: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": per_set}
    calls = cycling([lambda m=m: triton_backend.attend(q, *caches, m, spec) for m in metas])
    ms = graph_ms(calls)
    row.update(triton_ms=ms, triton_gb_s=per_set / ms / 1e6, triton_eager_ms=median_ms(calls))
    row["splits_ms"] = {}
    for splits in (1, 4, 8, 16, 32) if batch <= 4 else ():
        fixed = [dataclasses.replace(m, kernel_inputs=dataclasses.replace(m.kernel_inputs, splits=splits))
                 for m in metas]
        row["splits_ms"][splits] = graph_ms(cycling([lambda m=m: triton_backend.attend(q, *caches, m, spec)
                                                     for m in fixed]))
    if batch * context <= 16 * 4096:  # the oracle's gather copies every context: skip the largest
        plain = [meta(i) for i in range(sets)]
        ms = graph_ms(cycling([lambda m=m: oracle.attend(q, *caches, m, spec) for m in plain]))
        row.update(torch_ms=ms, torch_gb_s=per_set / ms / 1e6)
    dense = [torch.randn(batch, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
             for _ in range(min(sets, 8) * 2)]
    qd = q[:, :, None]
    sdpa = [lambda k=dense[2 * i], v=dense[2 * i + 1]: torch.nn.functional.scaled_dot_product_attention(
        qd, k, v, enable_gqa=True) for i in range(len(dense) // 2)]
    ms = graph_ms(cycling(sdpa))
    row.update(sdpa_dense_ms=ms, sdpa_dense_gb_s=per_set / ms / 1e6)
    return row


def prefill_case(tokens: int) -> dict[str, Any]:
    from py_engine.gpu.paged_attention import paged_attention, prefill_block_tokens, query_blocks

    nb = tokens // BLOCK
    kc, vc = (torch.randn(nb, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    tables = torch.randperm(nb, device="cuda")[None]
    bq = prefill_block_tokens(HEADS // KV_HEADS)
    blocks = torch.tensor(query_blocks([(0, 0, 0, tokens)], bq), dtype=torch.int32, device="cuda")
    flops = 4 * tokens * tokens * HEAD_DIM * HEADS / 2  # causal: half of QK^T and PV
    ms = graph_ms(lambda: paged_attention(out, q, kc, vc, tables, blocks, HEAD_DIM ** -0.5, None, None,
                                          decode=False))
    k = kc.view(1, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = vc.view(1, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
    qd = q.transpose(0, 1)[None]
    sdpa_ms = graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qd, k, v, is_causal=True,
                                                                                enable_gqa=True))
    return {"tokens": tokens, "triton_ms": ms, "triton_tflop_s": flops / ms / 1e9, "sdpa_dense_ms": sdpa_ms,
            "sdpa_dense_tflop_s": flops / sdpa_ms / 1e9}


def attention(copy_gb_s: float) -> dict[str, Any]:
    rows = [decode_case(b, 4096) for b in (1, 4, 16, 64)]
    for row in rows:
        row["triton_of_copy"] = row["triton_gb_s"] / copy_gb_s
    return {"decode": rows, "prefill": [prefill_case(2048)]}


# --- quantized matmuls ----------------------------------------------------------------------------------
def quant(copy_gb_s: float) -> list[dict[str, Any]]:
    from py_engine.gpu.quant_matmul import quant_matmul
    from py_engine.quant.kernels import PackedWeight
    from py_engine.quant.linear import torch_cuda_layout
    from py_engine.quant.rtn import quantize_rtn

    rows = []
    for (n, k), (bits, group, sym) in [((14336, 4096), (4, 128, False)), ((4096, 14336), (4, 128, False)),
                                       ((14336, 4096), (8, None, True)), ((4096, 14336), (8, None, True))]:
        weight = torch.randn(n, k) * 0.02
        packed = PackedWeight.pack(quantize_rtn(weight, bits, group, sym)).to("cuda")
        sets = rotations(packed.nbytes)
        copies = [packed] + [PackedWeight(*(t.clone() if isinstance(t, torch.Tensor) else t for t in (
            packed.codes, packed.scales, packed.zero_points, packed.mins, packed.bits, packed.block_size,
            packed.in_features, packed.symmetric, packed.spg))) for _ in range(sets - 1)]
        layout = torch_cuda_layout(packed)
        dense = weight.to("cuda", torch.bfloat16)
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"n": n, "k": k, "bits": bits, "group": group or k, "rows": m, "weight_bytes": packed.nbytes}
            ms = graph_ms(cycling([lambda p=p: quant_matmul(x, p) for p in copies]))
            row.update(triton_ms=ms, triton_gb_s=packed.nbytes / ms / 1e6, triton_of_copy=packed.nbytes / ms / 1e6
                       / copy_gb_s, triton_eager_ms=median_ms(cycling([lambda p=p: quant_matmul(x, p)
                                                                        for p in copies])))
            for name, options in {"gemv": {"kernel": "gemv"}, "mma": {"kernel": "mma"},
                                  "mma_split1": {"kernel": "mma", "split_k": 1}}.items():
                if name != "gemv" or m == 1:
                    row[f"{name}_ms"] = graph_ms(cycling([lambda p=p: quant_matmul(x, p, **options) for p in copies]))
            if layout is not None:
                kind, w, extra = layout
                fn = ((lambda: torch.ops.aten._weight_int8pack_mm(x, w, extra.to(x.dtype))) if kind == "int8" else
                      (lambda: torch.ops.aten._weight_int4pack_mm(x, w, group, extra)))
                row["torch_ms"] = graph_ms(fn)  # one weight copy: cache-assisted, a bound in torch's favour
            row["bf16_cublas_ms"] = graph_ms(lambda: torch.nn.functional.linear(x, dense))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# --- the server against transformers --------------------------------------------------------------------
PROMPT_LEN = GEN_LEN = 128
VARIANTS = {"triton+graphs": [], "triton-eager": ["--enforce-eager"], "torch": ["--attention-backend", "torch"]}


def model_folder() -> Path:
    """Qwen2.5-0.5B's shape, seeded random weights in bf16, Qwen2.5's tokenizer (from ../shared, or a
    copy beside this checkout under benchmarks/.cache/qwen2.5-tokenizer)."""
    from decode_engines import SEED, model_config
    from server_bench import QWEN_TOKENIZER, TOKENIZER_FILES

    folder = REPO / "benchmarks" / ".cache" / "qwen2.5-0.5b-random-bf16"
    if not (folder / "model.safetensors").is_file():
        import transformers

        config = model_config()
        torch.manual_seed(SEED)
        with torch.device("cuda"):
            hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config),
                                                               dtype=torch.bfloat16)
        hf.save_pretrained(folder)
        del hf
    tokenizer = QWEN_TOKENIZER if QWEN_TOKENIZER.is_dir() else REPO / "benchmarks" / ".cache" / "qwen2.5-tokenizer"
    for name in TOKENIZER_FILES:
        (folder / name).write_bytes((tokenizer / name).read_bytes())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return folder


def serve_levels(folder: Path, flags: list[str], levels: list[int], logs: Path, name: str) -> dict[str, Any]:
    from native_server.bench.loadgen import run_level_sync
    from native_server.bench.stats import summarize
    from native_server.bench.workload import Workload
    from server_bench import _free_port, running

    port = _free_port()
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(folder), "--port", str(port), "--device", "cuda",
               "--dtype", "bfloat16", "--max-concurrent", str(max(levels)), "--log-level", "info", *flags]
    workload, vocab, rows = Workload(PROMPT_LEN, GEN_LEN), 151000, []
    start = time.perf_counter()
    with running(command, port, "/health", logs / f"{name}.log", name, cwd=REPO) as (url, _):
        ready = time.perf_counter() - start
        run_level_sync(url, workload.prompts(4, vocab, "warmup"), 16, 4)
        for level in levels:  # a short run first: eager decode compiles a kernel per split count
            run_level_sync(url, workload.prompts(level, vocab, f"warm{level}"), 8, level)
            result = summarize(run_level_sync(url, workload.prompts(2 * level, vocab, f"c{level}"), GEN_LEN, level),
                               level)
            rows.append({"concurrency": level, **{k: v for k, v in result.to_dict().items()
                                                   if k in ("num_requests", "num_errors", "output_throughput")},
                         "ttft_ms_p50": result.ttft_ms.p50, "itl_ms_p50": result.itl_ms.p50})
            print(name, json.dumps(rows[-1]), flush=True)
    return {"startup_s": ready, "rows": rows}


def hf_generate(folder: Path, levels: list[int]) -> dict[str, Any]:
    import transformers
    from native_server.bench.workload import Workload

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").cuda().eval()
    rows = []
    for level in levels:
        ids = torch.tensor(Workload(PROMPT_LEN, GEN_LEN).prompts(level, 151000, f"hf{level}"), device="cuda")
        kwargs = dict(do_sample=False, max_new_tokens=GEN_LEN, min_new_tokens=GEN_LEN, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))
        model.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        new = (out.shape[1] - PROMPT_LEN) * level
        rows.append({"concurrency": level, "output_throughput": new / seconds, "seconds": seconds})
        print("transformers", json.dumps(rows[-1]), flush=True)
    del model
    torch.cuda.empty_cache()
    return {"rows": rows}


def server(levels: list[int], variants: list[str]) -> dict[str, Any]:
    folder = model_folder()
    logs = REPO / "benchmarks" / ".cache" / "logs" / "gpu_bench"
    logs.mkdir(parents=True, exist_ok=True)
    out = {"model": "Qwen2.5-0.5B shape, random bf16 weights", "prompt_len": PROMPT_LEN, "gen_len": GEN_LEN,
           "transformers": hf_generate(folder, levels)}
    for name in variants:
        out[name] = serve_levels(folder, VARIANTS[name], levels, logs, name)
    return out


def meta() -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "date": time.strftime("%F %T")}


def summary(report: dict[str, Any]) -> None:
    if "copy" in report:
        print(f"copy ceiling: {report['copy']['gb_s']:.0f} GB/s (read + write)")
    for row in report.get("attention", {}).get("decode", []):
        print("decode b={batch:<3} ctx={context}: triton {triton_gb_s:7.0f} GB/s ({pct:4.0%} of copy)  torch "
              "{torch:>7}  sdpa-dense {sdpa_dense_gb_s:7.0f} GB/s".format(
                  **row, pct=row.get("triton_of_copy", 0), torch=f"{row['torch_gb_s']:.0f}" if "torch_gb_s" in row
                  else "-"))
    for row in report.get("attention", {}).get("prefill", []):
        print("prefill {tokens} tokens: triton {triton_tflop_s:.0f} TFLOP/s, sdpa-dense {sdpa_dense_tflop_s:.0f}"
              .format(**row))
    for row in report.get("quant", []):
        print("int{bits} g{group} {n}x{k} rows={rows}: triton {triton_ms:.3f} ms ({triton_gb_s:.0f} GB/s) torch "
              "{t} ms  bf16 {bf16_cublas_ms:.3f} ms".format(**row, t=f"{row['torch_ms']:.3f}" if "torch_ms" in row
                                                           else "-"))
    srv = report.get("server", {})
    for name in ["transformers", *VARIANTS]:
        if name in srv:
            rates = "  ".join(f"c={r['concurrency']}: {r['output_throughput']:7.0f}" for r in srv[name]["rows"])
            print(f"{name:>14} out tok/s  {rates}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["copy", "attention", "quant", "server"])
    parser.add_argument("--levels", default="1,16,64")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    report: dict[str, Any] = json.loads(args.output.read_text()) if args.output.exists() else {}
    report["meta"] = meta()
    copy_gb_s = report.get("copy", {}).get("gb_s")
    for part in args.parts:
        print(f"== {part}", flush=True)
        if part == "copy" or copy_gb_s is None:
            report["copy"] = copy_bandwidth()
            copy_gb_s = report["copy"]["gb_s"]
        if part == "attention":
            report["attention"] = attention(copy_gb_s)
        elif part == "quant":
            report["quant"] = quant(copy_gb_s)
        elif part == "server":
            report["server"] = server([int(x) for x in args.levels.split(",")], args.variants)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2, default=str))
    summary(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
