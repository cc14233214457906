"""What to quantize and how: one `QuantConfig`, passed from the CLI or the Python API down to
the quantizers, the kernels, the checkpoint writer and the exporter.

    QuantConfig.from_options("int4")                      # RTN, 4 bits, groups of 128, zero points
    QuantConfig.from_options("gptq", bits=4, group_size=32)
    QuantConfig.from_options("smoothquant", alpha=0.5)    # W8A8

Methods:
- `none`: the checkpoint's float weights.
- `int8`: RTN, 8-bit per output channel, symmetric (weight-only).
- `int4`: RTN, 4-bit in groups along the input dimension (zero points unless symmetric).
- `awq`: activation-aware per-channel scaling searched on calibration activations, then 4-bit groups.
- `gptq`: Hessian-based error compensation column by column (optionally in act-order), 4-bit groups.
- `smoothquant`: activation outliers migrated into the weights (strength `alpha`), then int8
  weights per channel and int8 activations per token (W8A8).

Defaults follow the papers' and Hugging Face's quantization configs: 4-bit methods use groups
of 128 (a layer whose input is not a whole number of groups gets a shorter last group); AWQ and
int4 keep zero points, GPTQ is symmetric. The LM head (and so a tied embedding's table) is
quantized to int8 per channel under every method unless `lm_head_bits` is None, as llama.cpp keeps
its output matrix at higher precision than the body.

Stdlib only: this module is imported by the CLI before torch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

METHODS = ("none", "int8", "int4", "awq", "gptq", "smoothquant")
_DEFAULT_BITS = {"int8": 8, "int4": 4, "awq": 4, "gptq": 4, "smoothquant": 8}
_ALLOWED_BITS = {"int8": (8,), "int4": (4, 8), "awq": (2, 3, 4), "gptq": (2, 3, 4, 8), "smoothquant": (8,)}
_DEFAULT_GROUP = {"int8": None, "int4": 128, "awq": 128, "gptq": 128, "smoothquant": None}
_DEFAULT_SYMMETRIC = {"int8": True, "int4": False, "awq": False, "gptq": True, "smoothquant": True}
CALIBRATION_METHODS = ("awq", "gptq", "smoothquant")


class QuantConfigError(ValueError):
    """An impossible quantization request, with what is allowed."""


@dataclass(frozen=True)
class QuantConfig:
    method: str = "none"
    bits: int = 16  # 16 means float (method none)
    group_size: int | None = None  # None: one group per output channel
    symmetric: bool = True
    lm_head_bits: int | None = 8  # None: the LM head stays float
    alpha: float = 0.5  # SmoothQuant's migration strength
    act_order: bool = False  # GPTQ: quantize columns in order of decreasing Hessian diagonal
    damp_percent: float = 0.01  # GPTQ: damping added to the Hessian's diagonal, relative to its mean
    calibration_file: str | None = None  # None: the model's calibration.txt, else its own corpus
    calibration_samples: int = 128
    calibration_seq_len: int = 512  # clamped to the model's context
    seed: int = 0

    @classmethod
    def from_options(cls, method: str | None = "none", *, bits: int | None = None,
                     group_size: int | None = None, symmetric: bool | None = None, **kwargs) -> "QuantConfig":
        """A config from CLI-style options; unset values take the method's defaults."""
        method = (method or "none").lower()
        if method not in METHODS:
            raise QuantConfigError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")
        if method == "none":
            return cls(**kwargs)
        config = cls(method=method,
                     bits=_DEFAULT_BITS[method] if bits is None else bits,
                     group_size=_DEFAULT_GROUP[method] if group_size is None else group_size,
                     symmetric=_DEFAULT_SYMMETRIC[method] if symmetric is None else symmetric,
                     **kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise QuantConfigError(f"unknown quantization {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.method == "none":
            return
        if self.bits not in _ALLOWED_BITS[self.method]:
            allowed = ", ".join(map(str, _ALLOWED_BITS[self.method]))
            raise QuantConfigError(f"{self.method} supports bits {allowed}, not {self.bits}")
        if self.group_size is not None and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            raise QuantConfigError(f"group size must be a power of two >= 16 (or none), not {self.group_size}")
        if self.method in ("int8", "smoothquant") and self.group_size is not None:
            raise QuantConfigError(f"{self.method} quantizes per output channel; --group-size does not apply")
        if self.method == "smoothquant" and not 0.0 <= self.alpha <= 1.0:
            raise QuantConfigError(f"SmoothQuant's alpha must be in [0, 1], not {self.alpha}")
        if self.lm_head_bits not in (None, 4, 8):
            raise QuantConfigError(f"lm_head_bits must be 4, 8 or None, not {self.lm_head_bits}")
        if self.calibration_samples < 1 or self.calibration_seq_len < 8:
            raise QuantConfigError("calibration needs at least 1 sample of at least 8 tokens")
        if self.calibration_file is not None and not Path(self.calibration_file).is_file():
            raise QuantConfigError(f"calibration file {self.calibration_file} does not exist")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def needs_calibration(self) -> bool:
        return self.method in CALIBRATION_METHODS

    def with_(self, **changes) -> "QuantConfig":
        out = replace(self, **changes)
        out.validate()
        return out

    def describe(self) -> str:
        """'gptq 4-bit g128 sym' — for logs and tables."""
        if not self.enabled:
            return "none"
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        extra = f" alpha={self.alpha}" if self.method == "smoothquant" else ""
        extra += " act-order" if self.act_order else ""
        if self.lm_head_bits != 8:
            extra += f" head={'float' if self.lm_head_bits is None else f'{self.lm_head_bits}-bit'}"
        return f"{self.method} {self.bits}-bit {group} {'sym' if self.symmetric else 'asym'}{extra}"


def add_quantization_options(parser, calibration: bool = True) -> None:
    """The --quantization family of flags, for every command that loads a model."""
    parser.add_argument("--quantization", "-q", default="none", choices=METHODS,
                        help="in-situ quantization at load time (default none)")
    parser.add_argument("--bits", type=int, help="weight bits (default: 8 for int8/smoothquant, 4 otherwise)")
    parser.add_argument("--group-size", type=int,
                        help="group along the input dimension for 4-bit methods (default 128)")
    add_lm_head_option(parser)
    if calibration:
        parser.add_argument("--calibration-file", metavar="FILE",
                            help="text to calibrate AWQ/GPTQ/SmoothQuant on (default: the model's corpus)")
        parser.add_argument("--calibration-samples", type=int, default=128, metavar="N",
                            help="calibration sequences (default 128)")


def quant_config_from_args(args) -> QuantConfig:
    """QuantConfig from parsed add_quantization_options flags (a clear error on bad combinations)."""
    extra = {}
    if getattr(args, "calibration_file", None):
        extra["calibration_file"] = args.calibration_file
    if getattr(args, "calibration_samples", None) is not None:
        extra["calibration_samples"] = args.calibration_samples
    extra.update(lm_head_option(args))
    return QuantConfig.from_options(getattr(args, "quantization", "none"), bits=getattr(args, "bits", None),
                                    group_size=getattr(args, "group_size", None), **extra)


def add_lm_head_option(parser) -> None:
    """--lm-head-bits, for the commands that quantize at load and for `ruvllm quantize`."""
    parser.add_argument("--lm-head-bits", choices=("8", "4", "none"), default="8",
                        help="the LM head (and a tied embedding's table): int8 per channel (default), 4-bit in "
                             "groups (faster: llama.cpp's Q4_0 keeps it at 6 bits), or float")


def lm_head_option(args) -> dict:
    """QuantConfig keywords for a parsed --lm-head-bits: {} for the default int8 head."""
    head = getattr(args, "lm_head_bits", "8")
    return {} if head == "8" else {"lm_head_bits": None if head == "none" else int(head)}
