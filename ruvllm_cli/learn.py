"""`ruvllm learn ...`: the learning loops from a witness log, offline.

    ruvllm learn finetune --log logs/ --out tuned/ [--model M]      # every weight, on the log's feedback
    ruvllm learn distill --log logs/ --out small/ [--layers N]       # a smaller student of base + adapter
    ruvllm learn consolidate --log logs/ [--model M] [--ewc-lambda L] # logs/adapters/sona-vN, now current
    ruvllm learn rollback --log logs/ VERSION                        # 0: the base model
    ruvllm learn versions --log logs/
    ruvllm learn distill-draft TARGET --layers N --out DIR           # a draft for speculative decoding

LOG is the folder `ruvllm serve --witness-log` writes. The folders finetune
and distill write load in every command (`ruvllm generate --model tuned/`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from py_engine.hub import BUILTIN_MODEL


def _progress(label: str):
    def show(done: int, total: int, loss: float) -> None:
        if sys.stderr.isatty() or done == total:
            end = "\n" if done == total else ""
            print(f"\r{label}: step {done}/{total}, loss {loss:.4f}", end=end, file=sys.stderr, flush=True)
    return show


def add_parser(sub) -> None:
    p = sub.add_parser("learn", help="learn from a witness log: fine-tune, distil, consolidate, roll back")
    learn = p.add_subparsers(dest="learn_command", metavar="LOOP", required=True)

    def common(q: argparse.ArgumentParser, model: bool = True) -> None:
        q.add_argument("--log", required=True, type=Path, metavar="DIR", help="the server's --witness-log folder")
        if model:
            q.add_argument("--model", default=BUILTIN_MODEL, metavar="MODEL",
                           help=f"the base model the log was served with (default {BUILTIN_MODEL})")
            q.add_argument("--cache-dir", metavar="DIR", help="model cache (default: $RUVLLM_CACHE_DIR)")
            q.add_argument("--seed", type=int, default=0)

    f = learn.add_parser("finetune", help="train every weight on the log's feedback; write a model folder")
    common(f)
    f.add_argument("--out", required=True, metavar="DIR", help="model folder to write")
    f.add_argument("--epochs", type=int, default=3)
    f.add_argument("--lr", type=float, default=1e-4)
    f.add_argument("--batch-size", type=int, default=8)
    f.set_defaults(func=run_finetune)

    d = learn.add_parser("distill", help="distil a smaller student from the base + the current adapter")
    common(d)
    d.add_argument("--out", required=True, metavar="DIR", help="model folder to write")
    d.add_argument("--layers", type=int, metavar="N", help="decoder layers of the student (default: half)")
    d.add_argument("--epochs", type=int, default=2)
    d.add_argument("--lr", type=float, default=5e-4)
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--temperature", type=float, default=2.0)
    d.add_argument("--text-tokens", type=int, default=16384,
                   help="tokens of the model folder's validation.txt to distil on besides the log (default 16384)")
    d.set_defaults(func=run_distill)

    c = learn.add_parser("consolidate", help="train one LoRA on all logged feedback (EWC); save the next version")
    common(c)
    c.add_argument("--ewc-lambda", type=float, help="EWC strength (default: the config's; 0 turns it off)")
    c.add_argument("--config", type=Path, metavar="JSON", help="SonaConfig fields as a JSON object")
    c.set_defaults(func=run_consolidate)

    r = learn.add_parser("rollback", help="make an earlier consolidated version current (0: the base model)")
    common(r, model=False)
    r.add_argument("version", type=int, metavar="VERSION")
    r.set_defaults(func=run_rollback)

    s = learn.add_parser("distill-draft", help="distil a small draft model for speculative decoding from the "
                                               "target's own answers; measure its acceptance")
    s.add_argument("target", metavar="TARGET", help="the model the draft will draft for (name, folder or GGUF)")
    s.add_argument("--out", required=True, metavar="DIR", help="model folder to write (new or empty)")
    s.add_argument("--layers", type=int, default=2, metavar="N", help="decoder layers of the draft (default 2)")
    s.add_argument("--prompts", type=Path, metavar="JSONL",
                   help='prompts, one JSON object a line: {"messages": [...]} or {"prompt": "..."} '
                        "(default: built-in instructions through the chat template, see --data)")
    s.add_argument("--data", choices=("chat", "text"), default="chat",
                   help="without --prompts: built-in chat instructions, or windows of the folder's validation.txt")
    s.add_argument("--num-prompts", type=int, default=96)
    s.add_argument("--eval-prompts", type=int, default=12, help="held out to measure acceptance on (default 12)")
    s.add_argument("--max-tokens", type=int, default=96, help="tokens of each target answer (default 96)")
    s.add_argument("--epochs", type=int, default=3)
    s.add_argument("--lr", type=float, default=3e-4)
    s.add_argument("--batch-size", type=int, default=4)
    s.add_argument("--num-speculative-tokens", type=int, default=4, help="k of the acceptance measurement")
    s.add_argument("--cache-dir", metavar="DIR", help="model cache (default: $RUVLLM_CACHE_DIR)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=run_distill_draft)

    v = learn.add_parser("versions", help="list the consolidated versions")
    common(v, model=False)
    v.set_defaults(func=run_versions)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("epochs", "batch_size", "layers", "text_tokens"):
        value = getattr(args, name, None)
        if value is not None and value < (0 if name == "text_tokens" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("lr", "temperature"):
        value = getattr(args, name, None)
        if value is not None and not 0 < value < 1e3:
            raise ValueError(f"--{name} must be in (0, 1000), got {value}")


def run_finetune(args: argparse.Namespace) -> int:
    from py_engine.learning.deep import finetune

    _check_args(args)
    start = time.perf_counter()
    out = finetune(args.model, args.log, args.out, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                   seed=args.seed, cache_dir=args.cache_dir, progress=_progress("finetune"))
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


def run_distill(args: argparse.Namespace) -> int:
    from py_engine.learning.deep import distill

    _check_args(args)
    start = time.perf_counter()
    out = distill(args.model, args.log, args.out, layers=args.layers, epochs=args.epochs, lr=args.lr,
                  batch_size=args.batch_size, temperature=args.temperature, text_tokens=args.text_tokens,
                  seed=args.seed, cache_dir=args.cache_dir, progress=_progress("distill"))
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


def run_consolidate(args: argparse.Namespace) -> int:
    from py_engine.learning import Sona, SonaConfig
    from py_engine.learning.deep import log_records

    config = SonaConfig.from_dict(json.loads(args.config.read_text(encoding="utf-8"))) if args.config else SonaConfig()
    sona = Sona.load(args.model, config, folder=args.log, cache_dir=args.cache_dir)
    records = [r for r in log_records(args.log, "feedback") if sona.example(r) is not None]
    if not records:
        raise ValueError(f"--log {args.log}: no feedback to learn from (corrections or ratings of 1)")
    sona.replay = records
    result = sona.consolidate(args.ewc_lambda)
    print(f"sona-v{result.version}: {result.examples} examples, loss {result.stats.first_loss:.4f} -> "
          f"{result.stats.last_loss:.4f}, {result.seconds:.1f} s (Fisher {result.fisher_seconds:.1f} s); now current")
    return 0


def run_rollback(args: argparse.Namespace) -> int:
    from py_engine.learning.store import AdapterStore

    store = AdapterStore(args.log / "adapters")
    store.rollback(args.version)
    print(f"current: {'the base model' if not args.version else f'sona-v{args.version}'}")
    return 0


def run_versions(args: argparse.Namespace) -> int:
    from py_engine.learning.store import AdapterStore

    store = AdapterStore(args.log / "adapters")
    current = store.current()
    for v in store.versions():
        info = store.info(v)
        mark = "*" if v == current else " "
        print(f"{mark} sona-v{v}  {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(info['created']))}  "
              f"{info.get('examples', '?')} examples  ewc {info.get('ewc_lambda', '?')}")
    if current is None:
        print("* the base model (no consolidated adapter)")
    return 0


def run_distill_draft(args: argparse.Namespace) -> int:
    from py_engine.learning.draft import DraftSettings, distill_draft

    settings = DraftSettings(layers=args.layers, max_tokens=args.max_tokens, num_prompts=args.num_prompts,
                             eval_prompts=args.eval_prompts, epochs=args.epochs, lr=args.lr,
                             batch_size=args.batch_size, num_speculative_tokens=args.num_speculative_tokens,
                             data=args.data, seed=args.seed)
    report = distill_draft(args.target, args.out, settings, prompts_file=args.prompts, cache_dir=args.cache_dir,
                           progress=_progress)
    seconds = report["seconds"]
    print(f"wrote {args.out}: layers {report['kept_layers']} of the target, trained on {report['train_prompts']} "
          f"answers ({report['train_answer_tokens']} tokens); " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()))
    for name in ("acceptance_untrained", "acceptance"):
        a = report.get(name)
        if a and a["num_draft_tokens"]:
            label = "before training" if name.endswith("untrained") else "distilled"
            print(f"{label}: acceptance {a['acceptance_rate']:.3f} on {report['held_out_prompts']} held-out prompts, "
                  f"{a['mean_acceptance_length']:.2f} tokens a verify step at k={settings.num_speculative_tokens}, "
                  "by position " + " ".join(f"{x:.2f}" for x in a["per_position_rate"]))
    return 0
