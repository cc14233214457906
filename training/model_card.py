"""The model card (README.md next to the weights) and the samples it shows.

The card's YAML front matter carries the final validation metrics in Hugging Face's
`model-index` form, so tests and the project README read the numbers, not prose.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["PROMPTS", "chat_stop_rate", "samples", "write"]

# (label, prompt or chat messages, sample?) - the first is `make run`'s prompt.
PROMPTS: list[tuple[str, str | list[dict[str, str]], bool]] = [
    ("sampled", "ROMEO:", True),
    ("sampled", "HAMLET.\nTo be, or not to be", True),
    ("sampled", "Of Mans First Disobedience,", True),
    ("greedy", "KING HENRY.\n", False),
    ("chat, sampled", [{"role": "user", "content": "What light through yonder window breaks?"}], True),
    ("chat, sampled", [{"role": "user", "content": "Good morrow, my lord."}], True),
]
MAX_NEW_TOKENS = 80
# User lines for the chat check: does a sampled reply end with <|im_end|>?
CHAT_CHECK = ["What light through yonder window breaks?", "Good morrow, my lord.", "How now, what news?",
              "Wilt thou be gone?", "Who's there?", "I love thee.", "Where is the king?", "What say you?"]
CHAT_CHECK_TOKENS = 120


def samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int) -> list[dict[str, str]]:
    """Continuations of PROMPTS with the shipped generation config, seeded per prompt."""
    model.eval()
    out = []
    for i, (label, prompt, sample) in enumerate(PROMPTS):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            shown = prompt
        else:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            shown = tokenizer.decode(ids[0], skip_special_tokens=False)
        torch.manual_seed(seed + i)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=sample)
        text = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
        out.append({"label": label, "prompt": shown, "completion": text})
    return out


def chat_stop_rate(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int) -> dict[str, float]:
    """Sample a reply to each CHAT_CHECK line twice; how many end with an eos id in time."""
    model.eval()
    stopped, lengths = 0, []
    for i, line in enumerate(CHAT_CHECK * 2):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": line}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        torch.manual_seed(seed + i)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CHAT_CHECK_TOKENS)
        new = gen[0, ids.shape[1]:].tolist()
        stopped += new[-1] in model.generation_config.eos_token_id
        lengths.append(len(new))
    return {"replies": len(lengths), "stopped": stopped, "median_tokens": sorted(lengths)[len(lengths) // 2]}


def _front_matter(metrics: dict) -> str:
    return "\n".join([
        "---", "license: mit", "language: en", "library_name: transformers", "pipeline_tag: text-generation",
        "tags: [llama, tiny, shakespeare, ruvllm]",
        "model-index:", "- name: tiny-shakespeare", "  results:", "  - task: {type: text-generation}",
        "    dataset: {name: Shakespeare held-out works (validation.txt), type: text}",
        "    metrics:",
        f"    - {{name: validation loss (nats/token), type: loss, value: {metrics['loss']:.4f}}}",
        f"    - {{name: validation perplexity (per token), type: perplexity, value: {metrics['perplexity']:.2f}}}",
        f"    - {{name: bits per byte, type: bpb, value: {metrics['bits_per_byte']:.4f}}}",
        f"    - {{name: per-character perplexity, type: char_perplexity, value: {metrics['char_perplexity']:.4f}}}",
        "---", "",
    ])


def _sample_section(log: dict) -> list[str]:
    lines = []
    for s in log.get("samples", []):
        lines += [f"**{s['label']}** - prompt `{json.dumps(s['prompt'])[1:-1]}`", "", "```text",
                  s["prompt"] + s["completion"], "```", ""]
    return lines


def write(out: Path, model: LlamaForCausalLM, log: dict) -> None:
    """README.md for the model folder, from the run's log (args, metrics, samples)."""
    template = (Path(__file__).parent / "model_card.md").read_text(encoding="utf-8")
    c, a, m = model.config, log["args"], log["final_val"]
    tokens = a["steps"] * a["batch_size"] * a["context"]
    files = {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file() and f.name != "README.md"}
    fields = {
        "params": f"{log['parameters']:,}", "params_m": f"{log['parameters'] / 1e6:.2f}",
        "layers": c.num_hidden_layers, "hidden": c.hidden_size, "intermediate": c.intermediate_size,
        "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
        "head_dim": c.hidden_size // c.num_attention_heads, "vocab": c.vocab_size, "context": c.max_position_embeddings,
        "steps": a["steps"], "batch_size": a["batch_size"], "tokens": f"{tokens:,}", "tokens_m": f"{tokens / 1e6:.1f}",
        "epochs": f"{tokens / log['train_tokens']:.2f}", "tok_per_param": f"{tokens / log['parameters']:.1f}",
        "train_tokens": f"{log['train_tokens']:,}", "val_tokens": f"{m['tokens']:,}",
        "val_bytes": f"{m['bytes']:,}", "lr": a["lr"], "warmup": a["warmup"], "min_lr_ratio": a["min_lr_ratio"],
        "weight_decay": a["weight_decay"], "seed": a["seed"], "chat_fraction": a["chat_fraction"],
        "threads": a["threads"], "minutes": f"{log['train_seconds'] / 60:.0f}",
        "tok_s": f"{log['tokens_per_second']:.0f}", "torch": log["torch"],
        "train_loss": f"{_final_train_loss(log):.3f}", "loss": f"{m['loss']:.4f}", "ppl": f"{m['perplexity']:.2f}",
        "bpb": f"{m['bits_per_byte']:.4f}", "char_ppl": f"{m['char_perplexity']:.4f}",
        "val_curve": ", ".join(f"{v['step']}: {v['loss']:.3f}" for v in log["val"]),
        "files": "\n".join(f"| `{name}` | {_size(size)} |" for name, size in files.items()),
        "total_mb": f"{sum(files.values()) / 1e6:.2f}",
        "samples": "\n".join(_sample_section(log)),
        "chat_replies": log["chat_check"]["replies"], "chat_stopped": log["chat_check"]["stopped"],
        "chat_median": log["chat_check"]["median_tokens"], "chat_limit": CHAT_CHECK_TOKENS,
    }
    (out / "README.md").write_text(_front_matter(m) + template.format(**fields), encoding="utf-8")


def _size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def _final_train_loss(log: dict) -> float:
    """Mean batch loss over the last 50 steps (a single batch is noisy)."""
    tail = log["train"][-50:]
    return sum(r["loss"] for r in tail) / len(tail)
