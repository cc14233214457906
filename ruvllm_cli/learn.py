"""`ruvllm learn ...`: the learning loops from a witness log, offline.

    ruvllm learn finetune --log logs/ --out tuned/ [--model M]      # every weight, on the log's feedback
    ruvllm learn distill --log logs/ --out small/ [--layers N]       # a smaller student of base + adapter
    ruvllm learn consolidate --log logs/ [--model M] [--ewc-lambda L] # logs/adapters/sona-vN, now current
    ruvllm learn rollback --log logs/ VERSION                        # 0: the base model
    ruvllm learn versions --log logs/

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
