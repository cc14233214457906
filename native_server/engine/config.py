"""`EngineConfig`: every setting of the engine in one frozen dataclass, checked once, from code or the CLI.

    config = EngineConfig(model="tiny-shakespeare", device="cpu", max_num_seqs=16)
    engine = LLMEngine(config)                       # or LLMEngine("tiny-shakespeare", device="cpu", ...)

    EngineConfig.add_cli_args(parser)                # `ruvllm serve`, `ruvllm benchmark`, the benchmarks
    config = EngineConfig.from_cli_args(args)

As vLLM's EngineArgs: one place names each option, its default and its
bound; `serve`, `benchmark` and the benchmark scripts that build an engine
take the same flags from here, so an option means one thing everywhere.
Values the engine derives (the device, the context limit, the KV cache's
blocks) come from functions of this config, never written back into it.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from native_server.engine.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from py_engine.hub import BUILTIN_MODEL
from py_engine.models.kv_quant import DEFAULT_HOT_TOKENS, KV_CACHE_DTYPES, add_kv_cache_options
from py_engine.quant.config import QuantConfig, add_quantization_options, quant_config_from_args
from py_engine.speculative.config import SpeculativeConfig

ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")  # engine/attention's BACKENDS, without importing torch
DTYPES = ("auto", "float32", "bfloat16", "float16")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512M', '1.5GiB', '64MB' (K/M/G/T are powers of 1024, as for memory)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 536870912, 512M, 2GiB)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """What LLMEngine runs and how; see each field. Invalid values raise ValueError naming the option."""

    model: str = BUILTIN_MODEL  # a folder, a .gguf file, an alias or a downloaded repo id
    served_model_name: str | None = None  # the name requests and outputs use (default: model)
    dtype: str = "auto"  # the weights' dtype (auto: the checkpoint's)
    device: str = "auto"  # auto (cuda, then mps, then cpu), cpu, cuda, cuda:N, mps
    cache_dir: str | None = None  # where models are found (default: $RUVLLM_CACHE_DIR or ~/.cache/ruvllm)
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for the KV cache (None: kv_cache.memory_budget's default)
    gpu_memory_fraction: float = 0.9  # share of a GPU's memory the engine may use without kv_cache_memory
    max_num_seqs: int = 64  # sequences in the running batch (`--max-concurrent`)
    max_num_batched_tokens: int | None = None  # tokens in one forward pass (None: per device, llm_engine)
    max_model_len: int | None = None  # context length (None: the model's; `--max-context`)
    max_queue: int = 1024  # requests waiting; beyond it add_request raises QueueFullError
    enable_prefix_caching: bool = True
    quantization: str | QuantConfig | None = None  # in-situ quantization at load (py_engine.quant)
    optimize: bool = True  # the CPU transforms (fused projections, C kernels)
    attention_backend: str = "auto"  # engine/attention: auto, torch, triton, cpu
    cuda_graphs: bool = True  # capture decode steps on CUDA (`--enforce-eager` turns them off)
    lora_modules: Mapping[str, str] = field(default_factory=dict)  # adapter name -> peft folder, loaded at start
    enable_lora: bool = False  # adapters may be loaded later even when none is given now
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    xlora: str | None = None  # a peft X-LoRA folder applied to every request
    kv_cache_dtype: str = "auto"  # auto, fp16, bf16, or int8 / int4 (the two-tier cache)
    kv_hot_tokens: int = DEFAULT_HOT_TOKENS  # with int8 / int4: the recent tokens kept in the model's dtype
    tensor_parallel_size: int = 1  # processes the model is sharded over (engine/parallel.py), by KV head
    # speculative decoding, which changes no output (engine/speculative.py): a SpeculativeConfig, or what
    # SpeculativeConfig.parse takes ("ngram", a draft model's name, vLLM's fields as a mapping or JSON); None: off
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", dict(self.lora_modules or {}))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        for name in ("block_size", "max_num_seqs", "max_queue", "max_loras", "max_lora_rank", "kv_hot_tokens",
                     "tensor_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("kv_cache_memory", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {self.attention_backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.xlora is not None and (self.lora_modules or self.enable_lora):
            raise ValueError("--xlora applies its own LoRA experts to every request: it cannot be combined with "
                             "--lora-modules or --enable-runtime-lora")
        if self.xlora is not None and self.tensor_parallel_size != 1:
            raise ValueError("--xlora cannot be combined with --tensor-parallel-size")
        if self.xlora is not None and self.kv_cache_dtype in ("int8", "int4"):
            raise ValueError("--kv-cache-dtype int8/int4 cannot be combined with --xlora (its scaling pass keeps "
                             "a second cache)")

    @property
    def name(self) -> str:
        """The model's name in requests and outputs."""
        return self.served_model_name or self.model

    def with_options(self, **changes: Any) -> "EngineConfig":
        """A copy with some fields changed (checked again)."""
        return replace(self, **changes)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, lora: bool = True) -> Any:
        """The engine's flags on a command (serve, benchmark); returns the LoRA group for the command's own
        adapter flags. lora=False leaves the adapter flags to the command (benchmark takes `--lora NAME=PATH`
        as generate does) and returns None."""
        g = parser.add_argument_group("engine")
        g.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N, mps")
        g.add_argument("--dtype", default="auto", choices=DTYPES, help="weights' dtype (auto: the checkpoint's)")
        g.add_argument("--cache-dir", metavar="DIR", help="model cache (default: $RUVLLM_CACHE_DIR or ~/.cache/ruvllm)")
        g.add_argument("--max-concurrent", type=positive, default=64, metavar="N",
                       help="most sequences in the running batch (default 64)")
        g.add_argument("--max-queue", type=positive, default=1024, metavar="N",
                       help="most requests waiting; beyond it new ones are refused (a 503 on the server; default 1024)")
        g.add_argument("--max-context", type=positive, metavar="N",
                       help="context length in tokens (default: the model's max_position_embeddings)")
        g.add_argument("--max-num-batched-tokens", type=positive, metavar="N",
                       help="most tokens in one forward pass; longer prompts are prefilled in chunks (default 512 on "
                            "CPU, 2048 on GPUs)")
        g.add_argument("--block-size", type=positive, default=16, metavar="N", help="tokens per KV block (default 16)")
        g.add_argument("--kv-cache-memory", type=parse_size, metavar="BYTES",
                       help="memory for the KV cache, e.g. 512M (default: on the CPU up to 1 GiB, no more than "
                            "--max-concurrent full-length sequences fill; on a GPU what --gpu-memory-fraction leaves)")
        g.add_argument("--no-prefix-caching", action="store_true",
                       help="do not reuse the KV blocks of prompt prefixes computed before (for A/B measurements)")
        g.add_argument("--gpu-memory-fraction", type=float, default=0.9, metavar="F",
                       help="share of GPU memory the engine may use when --kv-cache-memory is not given (default 0.9)")
        g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                       help="paged attention kernels: triton (CUDA), cpu (decode rows in the C kernels), torch (any "
                            "device; the only one on MPS), auto (triton on CUDA when it imports, cpu on the CPU when "
                            "the kernels load, else torch; default)")
        g.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs for decode steps (they need the triton backend)")
        g.add_argument("--tensor-parallel-size", "-tp", type=positive, default=1, metavar="N",
                       help="shard the model over N processes on this machine (gloo on the CPU, one rank per NUMA "
                            "node where there are several; NCCL on CUDA, one GPU per rank); heads are split by KV head")
        add_quantization_options(g)
        add_kv_cache_options(g, paged=True)
        g.add_argument("--speculative-config", metavar="JSON",
                       help='speculative decoding, which changes no output: vLLM\'s fields, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or \'{"model": "DRAFT", '
                            '"num_speculative_tokens": 4}\'; also disable_by_batch_size and acceptance_floor '
                            '(py_engine/speculative/config.py); "ngram" alone works too')
        if not lora:
            return None
        a = parser.add_argument_group("LoRA adapters (native_server/engine/lora.py)")
        a.add_argument("--lora-modules", nargs="+", action="append", metavar="NAME=PATH",
                       help="peft LoRA adapters to serve; a request's `model` picks one by NAME (repeatable)")
        a.add_argument("--max-loras", type=positive, default=DEFAULT_MAX_LORAS, metavar="N",
                       help=f"most adapters loaded at once (default {DEFAULT_MAX_LORAS})")
        a.add_argument("--max-lora-rank", type=positive, default=DEFAULT_MAX_LORA_RANK, metavar="R",
                       help=f"refuse adapters of rank above R (default {DEFAULT_MAX_LORA_RANK})")
        a.add_argument("--xlora", metavar="DIR",
                       help="apply a peft X-LoRA folder to every request (a learned per-token mix of its LoRA "
                            "experts); not with the options above")
        return a

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineConfig":
        """The config add_cli_args' flags describe (with `model`, and for serve `served_model_name`, from args);
        overrides set fields the command decides itself."""
        from native_server.engine.lora import parse_lora_modules

        values = dict(model=args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir,
                      block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                      gpu_memory_fraction=args.gpu_memory_fraction, max_num_seqs=args.max_concurrent,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_context,
                      max_queue=args.max_queue, enable_prefix_caching=not args.no_prefix_caching,
                      quantization=quant_config_from_args(args), attention_backend=args.attention_backend,
                      cuda_graphs=not args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
                      kv_hot_tokens=args.kv_hot_tokens, max_lora_rank=args.max_lora_rank,
                      tensor_parallel_size=args.tensor_parallel_size,
                      speculative_config=getattr(args, "speculative_config", None))
        if hasattr(args, "lora_modules"):
            values.update(lora_modules=parse_lora_modules(args.lora_modules), max_loras=args.max_loras,
                          xlora=args.xlora)
        if getattr(args, "served_model_name", None):
            values["served_model_name"] = args.served_model_name
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"EngineConfig has no field {', '.join(sorted(unknown))}")
        return cls(**{**values, **overrides})
