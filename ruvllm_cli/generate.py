"""`ruvllm generate`: text from a prompt, streamed to the terminal; and the model and sampling options
`ruvllm chat` shares with it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from py_engine.adapters.config import add_lora_options, lora_from_args
from py_engine.adapters.xlora_config import add_xlora_options, xlora_from_args
from py_engine.sampling_params import SamplingParams

BUILTIN = "tiny-shakespeare"


def model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N, mps")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights' dtype (auto: the checkpoint's)")
    parser.add_argument("--cache-dir", metavar="DIR", help="model cache (default: $RUVLLM_CACHE_DIR or ~/.cache/ruvllm)")
    from py_engine.quant.config import add_quantization_options  # py_engine.quant's package imports torch
    add_quantization_options(parser)
    add_lora_options(parser)
    add_xlora_options(parser)
    from py_engine.models.kv_quant import add_kv_cache_options
    add_kv_cache_options(parser)
    parser.add_argument("--speculative", metavar="ngram|MODEL|JSON",
                        help="speculative decoding, which changes no output: ngram (prompt lookup), a draft model "
                             "(folder, alias or .gguf with the same vocabulary), or a JSON object with vLLM's "
                             "--speculative-config fields")
    parser.add_argument("--num-speculative-tokens", type=int, metavar="K",
                        help="tokens drafted per step (1-16; default 4)")


def speculative_from_args(args: argparse.Namespace) -> Any:
    """The LLM's speculative= value (a SpeculativeConfig or None); SpeculativeConfigError for a bad one."""
    from py_engine.speculative import SpeculativeConfig

    if args.speculative is None:
        if args.num_speculative_tokens is not None:
            raise SystemExit("error: --num-speculative-tokens needs --speculative")
        return None
    return SpeculativeConfig.parse(args.speculative, args.num_speculative_tokens)


def sampling_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default {max_tokens})")
    parser.add_argument("--temperature", type=float, help="0 is greedy (default: the model's generation_config)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens; 0 or -1 disables")
    parser.add_argument("--seed", type=int, help="seed of the sampler's random stream")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace, defaults: Any) -> SamplingParams:
    """Command-line values over the model's generation_config, validated by SamplingParams."""
    sampling = defaults.do_sample
    temperature = args.temperature if args.temperature is not None else (defaults.temperature if sampling else 0.0)
    top_p = args.top_p if args.top_p is not None else (defaults.top_p if sampling else 1.0)
    top_k = args.top_k if args.top_k is not None else (defaults.top_k if sampling else 0)
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=args.seed,
                          max_tokens=args.max_tokens, stop=tuple(args.stop))


def cmd_generate(args: argparse.Namespace) -> int:
    from py_engine.backends.torch import LLM
    from py_engine.quant.config import quant_config_from_args

    dtype = args.precision if args.backend == "onnx" and args.precision != "auto" else args.dtype
    loras, adapter = lora_from_args(args)
    xlora, non_granular = xlora_from_args(args)
    llm = LLM(args.model, dtype=dtype, device=args.device, cache_dir=args.cache_dir, backend=args.backend,
              quantization=quant_config_from_args(args), lora=loras, max_lora_rank=args.max_lora_rank,
              xlora=xlora, xlora_non_granular=non_granular, kv_cache_dtype=args.kv_cache_dtype,
              kv_hot_tokens=args.kv_hot_tokens, speculative=speculative_from_args(args))
    params = sampling_params(args, llm.generation_config)
    if args.grammar_file is not None:
        params = dataclasses.replace(params, structured_outputs=grammar_from_file(args.grammar_file))
    if args.json:
        if llm.xlora is not None:  # log the scalings behind each token
            llm.xlora.scalings_log = []
        out = llm.generate(args.prompt, params, lora=adapter)
        result = out.to_dict()
        if llm.xlora is not None:
            result["adapter_weights"] = llm.xlora.token_weights()[: len(out.token_ids)]
        print(json.dumps(result, ensure_ascii=False))
        return 0
    sys.stdout.write(args.prompt)
    for chunk in llm.stream(args.prompt, params, lora=adapter):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def grammar_from_file(path: str) -> Any:
    """A GBNF grammar file (llama.cpp's --grammar-file) as the output's constraint."""
    from py_engine.guided import StructuredOutputsParams
    from py_engine.guided.gbnf import MAX_GRAMMAR_CHARS

    with open(path, encoding="utf-8") as f:
        text = f.read(MAX_GRAMMAR_CHARS + 1)
    return StructuredOutputsParams(grammar=text)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    p.add_argument("prompt", nargs="?", default="", metavar="PROMPT", help="the prompt (empty: start from BOS)")
    p.add_argument("--model", "-m", default=BUILTIN, help=f"local dir, alias, cached repo id (default {BUILTIN})")
    sampling_options(p, max_tokens=128)
    model_options(p)
    p.add_argument("--grammar-file", metavar="FILE",
                   help="a llama.cpp GBNF grammar (root ::= ...) the output follows (docs/structured-outputs.md)")
    p.add_argument("--json", action="store_true",
                   help='print one object {"text", "prompt_token_ids", "token_ids", "finish_reason"}; with '
                        '--xlora also "adapter_weights": per generated token, each expert\'s weight; with '
                        '--speculative also "speculative": drafts, accepted tokens and acceptance per position')
    p.add_argument("--backend", choices=["torch", "onnx"], default="torch",
                   help="torch, or onnx: onnxruntime over an export folder (--model DIR from `ruvllm export`)")
    p.add_argument("--precision", choices=["auto", "fp32", "fp16", "int8", "int4"], default="auto",
                   help="onnx backend: which graph of the export folder (auto: fp32, else the one there)")
    p.set_defaults(func=cmd_generate)
