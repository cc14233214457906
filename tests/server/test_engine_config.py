"""EngineConfig: one frozen config for the engine, the same flags on `ruvllm serve` and `ruvllm benchmark`."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from native_server.bench.cli import add_benchmark_parser
from native_server.engine.config import EngineConfig
from native_server.serve import add_serve_parser


def _parse(register, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_frozen_and_checked_once():
    config = EngineConfig(model="tiny-shakespeare", max_num_seqs=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 9  # type: ignore[misc]
    assert config.with_options(max_num_seqs=9).max_num_seqs == 9 and config.max_num_seqs == 8
    bad = {"max_num_seqs": 0, "block_size": -1, "gpu_memory_fraction": 1.5, "attention_backend": "cuda",
           "kv_cache_dtype": "int3", "dtype": "fp8", "max_model_len": 0}
    for field, value in bad.items():
        with pytest.raises(ValueError, match=field.replace("_", ".") if field != "attention_backend" else "backend"):
            EngineConfig(**{field: value})
    with pytest.raises(ValueError, match="xlora"):
        EngineConfig(xlora="x", lora_modules={"a": "b"})


def test_serve_and_benchmark_take_the_same_engine_flags():
    argv = ["--device", "cpu", "--dtype", "float32", "--block-size", "32", "--kv-cache-memory", "64M",
            "--max-num-batched-tokens", "256", "--no-prefix-caching", "--attention-backend", "torch",
            "--kv-cache-dtype", "int8", "--kv-hot-tokens", "64", "--quantization", "int4", "--max-context", "128",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    served = EngineConfig.from_cli_args(_parse(add_serve_parser, ["serve", "tiny-shakespeare", *argv,
                                                                  "--max-concurrent", "4"]))
    benched = EngineConfig.from_cli_args(_parse(add_benchmark_parser, ["benchmark", "tiny-shakespeare", *argv]),
                                         max_num_seqs=4)
    assert served.with_options(max_lora_rank=benched.max_lora_rank) == benched
    assert (served.block_size, served.kv_cache_memory, served.max_model_len, served.enable_prefix_caching) == (
        32, 64 << 20, 128, False)
    assert served.quantization.method == "int4" and served.kv_cache_dtype == "int8"
    assert served.speculative_config.method == "ngram" and served.speculative_config.num_speculative_tokens == 3


def test_the_speculative_config_is_parsed_once_and_checked():
    """vLLM's --speculative-config as JSON, a mapping, "ngram" or a draft model's name; a bad field fails here."""
    assert EngineConfig().speculative_config is None
    assert EngineConfig(speculative_config="ngram") == EngineConfig(speculative_config={"method": "ngram"})
    assert EngineConfig(speculative_config="draft-model").speculative_config.model == "draft-model"
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config='{"num_speculative_tokens": 99}')
    with pytest.raises(ValueError, match="lookahead"):
        EngineConfig(speculative_config={"lookahead": 2})


def test_serve_flags_reach_the_lora_fields():
    args = _parse(add_serve_parser, ["serve", "--lora-modules", "a=/x", "b=/y", "--max-loras", "3",
                                     "--served-model-name", "mine"])
    config = EngineConfig.from_cli_args(args)
    assert config.lora_modules == {"a": "/x", "b": "/y"} and config.max_loras == 3 and config.name == "mine"
    with pytest.raises(TypeError, match="no field"):
        EngineConfig.from_cli_args(args, max_concurrent=3)


def test_the_log_names_a_gguf_files_own_quantization():
    """A Q4_1 GGUF served without --quantization is not "quantization none" (its codes are what runs)."""
    from native_server.engine.llm_engine import _quantization
    from py_engine.hub import resolve_model
    from tests.importers.smollm2_file import smollm2_path

    smollm2_path()
    path = resolve_model("smollm2-135m-instruct")
    assert "Q4_1" in _quantization(EngineConfig(model=str(path)), path)
    assert _quantization(EngineConfig(quantization="int8"), path).startswith("int8")
