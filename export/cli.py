"""`ruvllm export MODEL --out DIR [--precision ...]`: the export subcommand.

Options are validated (ExportOptions, check_supported) before any weight is
read, so a bad request fails in a second with one line that says why.
"""
from __future__ import annotations

import argparse
import sys
import time

from .options import BLOCK_SIZES, PRECISIONS, TARGETS, ExportOptions


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="export a model to ONNX (onnxruntime, -web, -genai, transformers.js)")
    p.add_argument("model", metavar="MODEL", help="local dir, alias or cached repo id")
    p.add_argument("--out", required=True, metavar="DIR", help="export folder (created; onnx/ inside)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="weights (default fp32)")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=32,
                   help="int4/int8 quantization block along the input dimension (default 32)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=True,
                     help="no zero points (default)")
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false", help="per-block zero points")
    p.add_argument("--accuracy-level", type=int, default=4, choices=range(5), metavar="N",
                   help="MatMulNBits accuracy_level: 4 computes with int8 activations (fastest on CPU), "
                        "0 in the activations' float type (default 4)")
    p.add_argument("--target", choices=("auto",) + TARGETS, default="auto",
                   help="native: MatMulNBits kernels (fastest in onnxruntime, -node, -genai); web: 4/8-bit weights "
                        "stored packed, dequantized once at session start (fastest in onnxruntime-web's wasm); "
                        "plain: standard ONNX ops only; auto (default): native, plus web for int4/int8, and "
                        "ruvllm_contract.json says which file each runtime loads")
    p.add_argument("--cache-dir", metavar="DIR", help="model cache (default: $RUVLLM_CACHE_DIR or ~/.cache/ruvllm)")
    p.set_defaults(func=run_export)
    return p


def run_export(args: argparse.Namespace) -> int:
    from py_engine.config import ModelConfig
    from py_engine.hub import resolve_model

    from .exporter import export_model
    from .options import check_supported

    targets = auto_targets(args.precision) if args.target == "auto" else (args.target,)
    all_options = [ExportOptions(precision=args.precision, block_size=args.block_size, symmetric=args.symmetric,
                                 accuracy_level=args.accuracy_level, target=t) for t in targets]
    path = resolve_model(args.model, args.cache_dir)
    for options in all_options:
        check_supported(ModelConfig.from_file(path), options)
    for options in all_options:
        bar = ProgressBar(f"export {options.precision} {options.target}")
        result = export_model(path, args.out, options, progress=bar)
        bar.close()
        print(f"wrote {result.model_path} ({result.size_bytes / 1e6:.1f} MB in {len(result.files)} file(s), "
              f"{result.seconds:.1f} s)")
    return 0


def auto_targets(precision: str) -> tuple[str, ...]:
    """Native for every runtime with fast MatMulNBits; int4/int8 also as web for onnxruntime-web."""
    return ("native", "web") if precision in ("int4", "int8") else ("native",)


class ProgressBar:
    """A one-line bar on stderr, redrawn as layers are written (plain lines when not a terminal)."""

    def __init__(self, label: str, width: int = 30) -> None:
        self.label, self.width, self.start = label, width, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        filled = int(self.width * done / max(total, 1))
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] layer {done}/{total} "
                f"{time.perf_counter() - self.start:.1f}s")
        if self.tty:
            sys.stderr.write("\r" + line)
        elif done == total:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
