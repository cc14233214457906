"""`ruvllm eval ppl MODEL`: sliding-window perplexity of a model (optionally quantized at load time).

    ruvllm eval ppl tiny-shakespeare --quantization int4 --max-tokens 20000 --json

The text is `--text-file`, else the model folder's own held-out `validation.txt` (the built-in model
ships one; `ruvllm quantize` copies it), else an error. It is tokenized with the model's tokenizer,
special tokens added (the built-in model's BOS first, as its card's figures were measured), and cut to
`--max-tokens`. The window is the model's context (capped at 4096, `--window` to change) and the
stride half of it; the method is py_engine.models.evaluate's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from py_engine.adapters.config import add_lora_options, lora_from_args
from py_engine.models.kv_quant import add_kv_cache_options, dense_kv_config
from py_engine.quant.config import add_quantization_options, quant_config_from_args

MAX_DEFAULT_WINDOW = 4096  # long-context models: a window past this costs far more than it tells


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model (perplexity)")
    evals = p.add_subparsers(dest="eval_command", metavar="EVAL", required=True)
    q = evals.add_parser("ppl", help="sliding-window perplexity on a text")
    q.add_argument("model", nargs="?", default="tiny-shakespeare", metavar="MODEL",
                   help="local dir, alias or cached repo id (default tiny-shakespeare)")
    q.add_argument("--text-file", metavar="FILE", help="text to score (default: the model folder's validation.txt)")
    q.add_argument("--max-tokens", type=_positive, metavar="N", help="score only the first N tokens (default: all)")
    q.add_argument("--window", type=_positive, metavar="N",
                   help=f"tokens per forward pass (default: the model's context, at most {MAX_DEFAULT_WINDOW})")
    q.add_argument("--stride", type=_positive, metavar="N", help="tokens between window starts (default: window/2)")
    q.add_argument("--json", action="store_true", help="print one JSON object with a perplexity key")
    q.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N, mps")
    q.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' dtype (auto: the checkpoint's)")
    q.add_argument("--cache-dir", metavar="DIR", help="model cache (default: $RUVLLM_CACHE_DIR or ~/.cache/ruvllm)")
    add_quantization_options(q)
    add_lora_options(q)
    add_kv_cache_options(q)
    q.set_defaults(func=run_eval_ppl)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def eval_text_path(model_dir: Path, text_file: str | None) -> Path:
    path = Path(text_file) if text_file else model_dir / "validation.txt"
    if not path.is_file():
        if text_file:
            raise FileNotFoundError(f"text file {text_file} does not exist")
        raise FileNotFoundError(f"no --text-file given and {model_dir} has no validation.txt; pass --text-file FILE")
    return path


def encode_text(tokenizer, text: str, max_tokens: int | None) -> list[int]:
    """Token ids of the text (special tokens added), cut to max_tokens; long texts are encoded in part."""
    if max_tokens is not None and len(text) > max_tokens * 16:  # BPE tokens hold far fewer than 16 characters
        ids = tokenizer.encode(text[: max_tokens * 16], add_special_tokens=True)
        if len(ids) > max_tokens:
            return ids[:max_tokens]
    ids = tokenizer.encode(text, add_special_tokens=True)
    return ids[:max_tokens] if max_tokens is not None else ids


def run_eval_ppl(args: argparse.Namespace) -> int:
    from py_engine.backends.torch import pick_device
    from py_engine.models.evaluate import perplexity
    from py_engine.hub import resolve_model
    from py_engine.quant.hf_format import read_quantization
    from py_engine.quant.load import load_quantized
    from py_engine.tokenizer import Tokenizer

    qconfig = quant_config_from_args(args)  # bad combinations fail before anything loads
    loras, adapter = lora_from_args(args)
    kv_quant = dense_kv_config(args.kv_cache_dtype, args.kv_hot_tokens)
    path = resolve_model(args.model, args.cache_dir)
    text_path = eval_text_path(path, args.text_file)
    start = time.perf_counter()
    model, config, _ = load_quantized(path, qconfig, dtype=args.dtype, device=pick_device(args.device))
    if loras:  # unmerged, as generate runs them; --adapter picks the one scored
        from py_engine.adapters import LoraManager
        manager = LoraManager(model, max_rank=args.max_lora_rank)
        for name, lora_path in loras.items():
            manager.add(name, lora_path)
        manager.set_adapter_mix(adapter)
    load_seconds = time.perf_counter() - start
    ids = encode_text(Tokenizer.from_pretrained(path), text_path.read_text(encoding="utf-8"), args.max_tokens)
    kv_quant.check(config.max_position_embeddings)
    window = args.window or min(config.max_position_embeddings, MAX_DEFAULT_WINDOW)
    if window > config.max_position_embeddings:
        raise ValueError(f"--window {window} is longer than the model's context {config.max_position_embeddings}")
    stride = args.stride or max(window // 2, 1)
    if stride > window:
        raise ValueError(f"--stride {stride} is longer than the window {window}")
    if len(ids) < 2:
        raise ValueError(f"{text_path} holds {len(ids)} token(s); perplexity needs at least 2")
    result = perplexity(model, ids, window, stride, progress=_progress() if not args.json else None,
                        kv_quant=kv_quant)
    checkpoint = read_quantization(path)  # a pre-quantized checkpoint is described by its own config
    quantization = checkpoint.describe() if checkpoint is not None else qconfig.describe()
    kv = "auto" if not kv_quant.enabled else f"{kv_quant.dtype}, {kv_quant.hot_tokens} hot tokens"
    out = result.to_dict() | {"quantization": quantization, "kv_cache": kv, "model": str(path), "adapter": adapter,
                              "text_file": str(text_path),
                              "load_seconds": round(load_seconds, 3)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"perplexity {result.perplexity:.4f} (loss {result.loss:.4f} nats/token) over {result.tokens} tokens "
              f"of {text_path.name}; window {window}, stride {stride}, quantization {quantization}, KV cache {kv}, "
              f"{result.seconds:.1f} s")
    return 0


def _progress():
    """A windows-done counter on stderr when it is a terminal."""
    if not sys.stderr.isatty():
        return None

    def report(done: int, total: int) -> None:
        sys.stderr.write(f"\rwindows {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return report
