"""`ruvllm export MODEL --out DIR [--precision ...] [--quantization ...]`: the export subcommand.

Options are validated (ExportOptions, check_supported) before any weight is
read, so a bad request fails in a second with one line that says why.

Two ways to quantized weights: `--precision int4|int8` (with --block-size and
--symmetric/--asymmetric) RTN-quantizes the float weights while writing the
graph; `--quantization int4|int8|awq|gptq` (with --bits, --group-size and the
calibration flags) quantizes the model with py_engine's method first and packs
its codes, scales and zero points as they are; a pre-quantized (GPTQ/AWQ)
checkpoint exports its own. Either way the graph is int8, int4 or int2 by the bits.
"""
from __future__ import annotations

import argparse
import sys
import time

from py_engine.quant.config import add_quantization_options, quant_config_from_args

from .options import BLOCK_SIZES, PRECISION_BITS, PRECISIONS, TARGETS, ExportError, ExportOptions, unsupported_bits


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="export a model to ONNX (onnxruntime, -web, -genai, transformers.js)")
    p.add_argument("model", metavar="MODEL", help="local dir, alias or cached repo id")
    p.add_argument("--out", required=True, metavar="DIR", help="export folder (created; onnx/ inside)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="weights (default fp32; with --quantization or a quantized checkpoint: by its bits)")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES,
                   help="int4/int8 RTN block along the input dimension (default 32)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=None,
                     help="no zero points (default)")
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false", help="per-block zero points")
    p.add_argument("--accuracy-level", type=int, default=4, choices=range(5), metavar="N",
                   help="MatMulNBits accuracy_level: 4 computes with int8 activations (fastest on CPU), "
                        "0 in the activations' float type (default 4)")
    p.add_argument("--target", choices=("auto",) + TARGETS, default="auto",
                   help="native: MatMulNBits kernels (fastest in onnxruntime, -node, -genai); web: 2/4/8-bit weights "
                        "stored packed, dequantized once at session start (fastest in onnxruntime-web's wasm); "
                        "plain: standard ONNX ops only; auto (default): native, plus web for int2/int4/int8, and "
                        "ruvllm_contract.json says which file each runtime loads")
    p.add_argument("--cache-dir", metavar="DIR", help="model cache (default: $RUVLLM_CACHE_DIR or ~/.cache/ruvllm)")
    p.add_argument("--lora", metavar="PATH",
                   help="a peft LoRA adapter folder, merged into the weights before they are quantized and written")
    add_quantization_options(p)
    p.set_defaults(func=run_export)
    return p


def run_export(args: argparse.Namespace) -> int:
    from py_engine.config import ModelConfig
    from py_engine.hub import resolve_model
    from py_engine.quant.load import load_quantized

    from .exporter import export_model
    from .options import check_supported

    qconfig = quant_config_from_args(args)
    path = resolve_model(args.model, args.cache_dir)
    method, precision, block_size, symmetric = export_quantization(args, qconfig, path)
    targets = auto_targets(precision) if args.target == "auto" else (args.target,)
    all_options = [ExportOptions(precision=precision, block_size=block_size, symmetric=symmetric,
                                 accuracy_level=args.accuracy_level, target=t, quantization=method) for t in targets]
    for options in all_options:
        check_supported(ModelConfig.from_file(path), options)
    model = None
    if qconfig.enabled or args.lora:  # merge the adapter and quantize once for every target
        model, _, _ = load_quantized(path, qconfig, dtype="float32", device="cpu", progress=True, lora=args.lora)
    for options in all_options:
        bar = ProgressBar(f"export {options.precision} {options.target}")
        result = export_model(path, args.out, options, progress=bar, model=model)
        bar.close()
        print(f"wrote {result.model_path} ({result.size_bytes / 1e6:.1f} MB in {len(result.files)} file(s), "
              f"{result.seconds:.1f} s)")
    return 0


def export_quantization(args: argparse.Namespace, qconfig, path) -> tuple[str, str, int, bool]:
    """(quantization, precision, block_size, symmetric) for ExportOptions, with clear errors on conflicts."""
    from py_engine.quant.hf_format import read_quantization

    pre = read_quantization(path)
    if not qconfig.enabled and pre is None:  # float model: RTN at export time, as before
        return "none", args.precision or "fp32", args.block_size or 32, True if args.symmetric is None else args.symmetric
    if qconfig.method == "smoothquant":
        raise ExportError("smoothquant quantizes activations too (W8A8), which MatMulNBits does not; export "
                          "--quantization int8 for int8 weights")
    method, bits = (qconfig.method, qconfig.bits) if qconfig.enabled else (f"{pre.method} checkpoint", pre.default.bits)
    precision = next((p for p, b in PRECISION_BITS.items() if b == bits), None)
    if precision is None:
        raise ExportError(unsupported_bits(method, bits))
    if args.precision not in (None, precision):
        raise ExportError(f"--precision {args.precision} contradicts the {bits}-bit {method} weights; leave it out")
    if args.block_size is not None or args.symmetric is not None:
        raise ExportError("--block-size and --symmetric/--asymmetric set RTN at export time; the quantized model "
                          "keeps its own groups (--group-size) and zero points")
    return method, precision, 32, True


def auto_targets(precision: str) -> tuple[str, ...]:
    """Native for every runtime with fast MatMulNBits; quantized weights also as web for onnxruntime-web."""
    return ("native", "web") if precision in PRECISION_BITS else ("native",)


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
