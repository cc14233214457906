"""What a training run leaves behind: the Hugging Face model folder and the log.

The folder (`py_engine/data/tiny-shakespeare/`) ships as package data, so everything
in it counts against the 20 MB budget: fp32 safetensors, tokenizer, generation
config, the held-out text and the model card.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from training import model_card

__all__ = ["load_tokenizer", "save", "write_log"]

# Sampling by default: greedy decoding of a model this small loops on a phrase
# within a few lines; T=0.8 with top-p 0.95 keeps the text varied but on-topic.
# top_k is written out (50, transformers' default) so no reader has to guess it.
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 50}


def load_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """The tokenizer train_tokenizer.py wrote into `folder`."""
    if not (folder / "tokenizer.json").exists():
        raise SystemExit(f"{folder}/tokenizer.json is missing: run `python -m training.train_tokenizer` first")
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def write_log(path: Path, log: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")


def _plot(path: Path, log: dict) -> None:
    """A PNG of the train/val curves next to the log, when matplotlib is installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in log["train"]], [r["loss"] for r in log["train"]], lw=0.5, label="train (batch)")
    ax.plot([r["step"] for r in log["val"]], [r["loss"] for r in log["val"]], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="tiny-shakespeare")
    ax.legend()
    fig.savefig(path.with_suffix(".png"), dpi=100, bbox_inches="tight")


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace,
         log: dict, val_text: str) -> None:
    """Write the model folder (weights, configs, validation.txt, card) and the log."""
    out: Path = args.out
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
        **GENERATION_DEFAULTS,
    )
    model.save_pretrained(str(out))  # config.json, generation_config.json, model.safetensors
    (out / "validation.txt").write_text(val_text, encoding="utf-8")
    write_log(args.log, log)  # the numbers are safe before sampling starts
    log["samples"] = model_card.samples(model, tokenizer, seed=args.seed)
    log["chat_check"] = model_card.chat_stop_rate(model, tokenizer, seed=args.seed)
    write_log(args.log, log)
    _plot(args.log, log)
    model_card.write(out, model, log)
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({total / 1e6:.2f} MB)")


def _main() -> None:
    """Re-write the model card and samples from a saved model and its log."""
    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = LlamaForCausalLM.from_pretrained(str(args.out))
    log = json.loads(args.log.read_text(encoding="utf-8"))
    tokenizer = load_tokenizer(args.out)
    log["samples"] = model_card.samples(model, tokenizer, seed=int(log["args"]["seed"]))
    log["chat_check"] = model_card.chat_stop_rate(model, tokenizer, seed=int(log["args"]["seed"]))
    write_log(args.log, log)
    model_card.write(args.out, model, log)


if __name__ == "__main__":
    _main()
