"""Write `genai_config.json`, onnxruntime-genai's description of an exported decoder.

onnxruntime-genai reads the model folder (this export folder: tokenizer files
at the top, the graph under onnx/) and drives the graph itself. Our graph
concatenates past and new keys (the Optimum contract), so
`past_present_share_buffer` is false. The file names the graph of the
precision written last, in the target genai runs best (export.manifest:
MatMulNBits, not the web variant); re-export the precision you want genai to
run, or edit `decoder.filename`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from py_engine.config import GenerationConfig, ModelConfig

from . import contract as C
from .options import ExportOptions

GENAI_FILE = "genai_config.json"


def genai_config(out_dir: Path, config: ModelConfig, options: ExportOptions,
                 filename: str | None = None) -> dict[str, Any]:
    gen = GenerationConfig()
    if (out_dir / "generation_config.json").exists():
        gen = GenerationConfig.from_file(out_dir)
    eos = list(gen.eos_token_id or config.eos_token_id)
    pad = gen.pad_token_id if gen.pad_token_id is not None else config.pad_token_id
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename or f"onnx/{options.file_name}",
        "head_size": config.head_dim, "hidden_size": config.hidden_size,
        "inputs": {"input_ids": C.INPUT_IDS, "attention_mask": C.ATTENTION_MASK, "position_ids": C.POSITION_IDS,
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": C.LOGITS, "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
        "num_attention_heads": config.num_attention_heads, "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads}
    bos = gen.bos_token_id if gen.bos_token_id is not None else config.bos_token_id
    model = {"bos_token_id": bos if bos is not None else (eos[0] if eos else 0),  # genai needs a number
             "context_length": config.max_position_embeddings, "decoder": decoder,
             "eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": pad if pad is not None else
             (eos[0] if eos else 0), "type": config.model_type, "vocab_size": config.vocab_size}
    search = {"diversity_penalty": 0.0, "do_sample": gen.do_sample, "early_stopping": True, "length_penalty": 1.0,
              "max_length": config.max_position_embeddings, "min_length": 0, "no_repeat_ngram_size": 0,
              "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": False,
              "repetition_penalty": gen.repetition_penalty, "temperature": gen.temperature, "top_k": gen.top_k,
              "top_p": gen.top_p}
    return {"model": model, "search": search}


def write_genai_config(out_dir: Path, config: ModelConfig, options: ExportOptions,
                       filename: str | None = None) -> None:
    text = json.dumps(genai_config(out_dir, config, options, filename), indent=4)
    (out_dir / GENAI_FILE).write_text(text + "\n", encoding="utf-8")
