"""The I/O contract of an exported decoder, written down once.

Every runtime that loads a ruvllm export (onnxruntime in CPython, our web and
npm packages, transformers.js, onnxruntime-genai) relies on these names and
shapes, which follow Optimum and onnxruntime-genai:

    input_ids                    int64   [batch, sequence]
    attention_mask               int64   [batch, total_sequence]   1 = real token
    position_ids                 int64   [batch, sequence]         rope positions
    past_key_values.{i}.key      kv      [batch, kv_heads, past_sequence, head_dim]
    past_key_values.{i}.value    kv      [batch, kv_heads, past_sequence, head_dim]
  ->
    logits                       float32 [batch, sequence, vocab]
    present.{i}.key / .value     kv      [batch, kv_heads, total_sequence, head_dim]

kv_heads, head_dim and vocab are numbers, never symbolic, so runtimes can
allocate caches from the graph alone. The cache is slot-aligned: slot s of
past/present holds the token at attention_mask column s, and
total_sequence = past_sequence + sequence. The first call passes past
tensors with past_sequence = 0. `contract_json` is the same contract as JSON
for web/ and npm/ (written to `ruvllm_contract.json` in an export).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from py_engine.config import ModelConfig

FORMAT_VERSION = 1
CONTRACT_FILE = "ruvllm_contract.json"

INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS = "input_ids", "attention_mask", "position_ids", "logits"
BATCH, SEQUENCE, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"

# metadata_props keys
META_FORMAT = "ruvllm.format_version"
META_CONFIG_HASH = "ruvllm.config_sha256"
META_PRECISION = "ruvllm.precision"
META_VARIANT = "ruvllm.variant"
META_CONTRACT = "ruvllm.contract"


def past_key(layer: int) -> str:
    return f"past_key_values.{layer}.key"


def past_value(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key(layer: int) -> str:
    return f"present.{layer}.key"


def present_value(layer: int) -> str:
    return f"present.{layer}.value"


def config_hash(config_json: bytes) -> str:
    """sha256 of the source config.json bytes, to tell which checkpoint a graph came from."""
    return hashlib.sha256(config_json).hexdigest()


@dataclass(frozen=True)
class IOContract:
    """Names, dtypes and shapes of one exported decoder's inputs and outputs."""

    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str = "float32"  # "float16" for fp16 exports

    @classmethod
    def for_config(cls, config: ModelConfig, kv_dtype: str = "float32") -> "IOContract":
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                   config.vocab_size, kv_dtype)

    def inputs(self) -> list[tuple[str, str, list[int | str]]]:
        kv = [BATCH, self.kv_heads, PAST, self.head_dim]
        specs = [(INPUT_IDS, "int64", [BATCH, SEQUENCE]), (ATTENTION_MASK, "int64", [BATCH, TOTAL]),
                 (POSITION_IDS, "int64", [BATCH, SEQUENCE])]
        for i in range(self.num_layers):
            specs += [(past_key(i), self.kv_dtype, kv), (past_value(i), self.kv_dtype, kv)]
        return specs

    def outputs(self) -> list[tuple[str, str, list[int | str]]]:
        kv = [BATCH, self.kv_heads, TOTAL, self.head_dim]
        specs = [(LOGITS, "float32", [BATCH, SEQUENCE, self.vocab_size])]
        for i in range(self.num_layers):
            specs += [(present_key(i), self.kv_dtype, kv), (present_value(i), self.kv_dtype, kv)]
        return specs

    def to_dict(self) -> dict[str, Any]:
        def spec(items):
            return [{"name": n, "dtype": d, "shape": s} for n, d, s in items]
        return {"format_version": FORMAT_VERSION, "num_layers": self.num_layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "vocab_size": self.vocab_size, "kv_dtype": self.kv_dtype,
                "past_key": "past_key_values.{i}.key", "past_value": "past_key_values.{i}.value",
                "present_key": "present.{i}.key", "present_value": "present.{i}.value",
                "inputs": spec(self.inputs()), "outputs": spec(self.outputs())}


def contract_json(contract: IOContract) -> str:
    return json.dumps(contract.to_dict(), indent=1)
