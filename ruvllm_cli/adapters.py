"""`ruvllm merge-lora MODEL ADAPTER --out DIR`: a model folder with a peft LoRA adapter merged in."""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("merge-lora", help="write MODEL with a peft LoRA adapter merged into its weights")
    p.add_argument("model", metavar="MODEL", help="local dir, alias, cached repo id or .gguf file")
    p.add_argument("adapter", metavar="ADAPTER", help="peft adapter folder (adapter_config.json + adapter_model.*)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (created)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' dtype (auto: the checkpoint's)")
    p.add_argument("--cache-dir", metavar="DIR", help="model cache (default: $RUVLLM_CACHE_DIR or ~/.cache/ruvllm)")
    p.set_defaults(func=run_merge_lora)


def run_merge_lora(args: argparse.Namespace) -> int:
    from py_engine.adapters import write_merged
    from py_engine.hub import resolve_model

    out = write_merged(resolve_model(args.model, args.cache_dir), args.adapter, args.out, dtype=args.dtype)
    print(f"wrote {out} ({args.adapter} merged into {args.model})")
    return 0
