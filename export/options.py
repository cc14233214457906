"""What an export may be asked for, and the checks that refuse the rest before any work.

precision   fp32 | fp16 | int8 | int4 | int2   (int8/int4/int2: weights of linear layers only; int2 only for a
            model already quantized to 2 bits: RTN at export time is 4- or 8-bit)
block_size  32 | 64 | 128                quantization block along the input dimension
symmetric   True: no zero points (code 2**(bits-1) is zero); False: per-block zero points
quantization  none: int8/int4 weights are RTN-quantized here from the float model; a method (int4, int8,
            awq, gptq, or the layout of a pre-quantized checkpoint): the model's own QuantLinear codes,
            scales and zero points are packed as they are, layers it left float stay float
target      native: onnxruntime contrib ops, quantized weights run by MatMulNBits;
            web: the same fused ops, every weight in one data file beside the graph, quantized
                 ones as MatMulNBits codes with float16 scales where exact (export.web_weights),
                 which the page's own wasm kernels read too (export.web_engine);
            plain: standard ONNX operators only, for runtimes without contrib ops.
"""
from __future__ import annotations

from dataclasses import dataclass

from py_engine.config import ModelConfig

PRECISIONS = ("fp32", "fp16", "int8", "int4", "int2")
PRECISION_BITS = {"int8": 8, "int4": 4, "int2": 2}  # the quantized precisions, by MatMulNBits bits
BLOCK_SIZES = (32, 64, 128)
TARGETS = ("native", "web", "plain")
# Files of the export layout, by precision (transformers.js names; it has no 2-bit dtype, q2 follows q4).
FILE_NAMES = {"fp32": "model.onnx", "fp16": "model_fp16.onnx", "int8": "model_quantized.onnx",
              "int4": "model_q4.onnx", "int2": "model_q2.onnx"}


class ExportError(ValueError):
    """An export that cannot be done, with the reason and what is supported."""


@dataclass(frozen=True)
class ExportOptions:
    precision: str = "fp32"
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations (fastest on CPU), 0 = as the weights
    target: str = "native"
    quantize_lm_head: bool = True  # int4/int8: the LM head (and a tied embedding) quantized too
    quantization: str = "none"  # not none: export the model's already-quantized weights (see above)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ExportError(f"unsupported precision {self.precision!r}; choose from {', '.join(PRECISIONS)}")
        if self.block_size not in BLOCK_SIZES:
            raise ExportError(f"unsupported block size {self.block_size}; choose from "
                              f"{', '.join(map(str, BLOCK_SIZES))}")
        if self.target not in TARGETS:
            raise ExportError(f"unsupported target {self.target!r}; choose from {', '.join(TARGETS)}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ExportError(f"accuracy level must be 0-4 (MatMulNBits), got {self.accuracy_level}")
        if self.prequantized and not self.quantized:
            raise ExportError(f"a {self.quantization}-quantized model exports as int2, int4 or int8, "
                              f"not {self.precision}")
        if self.precision == "int2" and not self.prequantized:
            raise ExportError("int2 exports a model already quantized to 2 bits (--quantization gptq|awq --bits 2, "
                              "or a 2-bit checkpoint); RTN at export time quantizes to int4 or int8")
        if self.target == "plain" and self.quantized:
            raise ExportError(f"precision {self.precision} needs onnxruntime's MatMulNBits or 4-bit "
                              "DequantizeLinear; the plain target supports fp32 and fp16")

    @property
    def quantized(self) -> bool:
        return self.precision in PRECISION_BITS

    @property
    def prequantized(self) -> bool:
        """The weights come quantized from the model (QuantLinear), not from RTN at export time."""
        return self.quantization != "none"

    @property
    def bits(self) -> int:
        return PRECISION_BITS.get(self.precision, 32)

    @property
    def contrib_ops(self) -> bool:
        return self.target != "plain"

    @property
    def file_name(self) -> str:
        """The graph's file under onnx/: the transformers.js name, `_web` added for packed web weights.

        Float weights make the same graph for native and web (only quantized linears differ), and
        plain replaces native under the same name: only quantized web needs a name of its own, so
        both int4 graphs can sit in one folder (export.manifest says which runtime loads which).
        """
        name = FILE_NAMES[self.precision]
        return name.replace(".onnx", "_web.onnx") if self.quantized and self.target == "web" else name


def unsupported_bits(what: str, bits: int) -> str:
    """Why `bits`-bit weights have no export: MatMulNBits runs 2, 4 and 8 bits (onnxruntime 1.31's CPU kernel
    refuses 3: "Only 2b, 4b and 8b quantization is supported")."""
    return (f"{what} is {bits}-bit; the ONNX export packs 2-, 4- and 8-bit weights for MatMulNBits, the widths "
            "onnxruntime's kernel runs (1.31 refuses 3 bits)")


def check_supported(config: ModelConfig, options: ExportOptions) -> None:
    """Refuse what the exporter cannot reproduce exactly, before any weights are read."""
    rope = config.rope_parameters
    rot = int(config.head_dim * rope.partial_rotary_factor)
    if rot % 2:
        raise ExportError(f"rotary dimension {rot} is odd; rope needs channel pairs")
    if config.head_dim % 2:
        raise ExportError(f"head_dim {config.head_dim} is odd")
