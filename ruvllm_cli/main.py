"""The `ruvllm` command line: generate, chat, download, list, info, import-llama2c, import-gguf, serve,
benchmark, export, quantize, eval, merge-lora, learn.

This package sits above the rings: every subcommand is registered by the
module that owns it, through its `add_parser(subparsers)` (this package's
command groups, export, native_server, and web where it is installed). This
file only builds the parser and turns expected failures (unknown model, bad
option, broken file) into one `error: ...` line and a non-zero exit.
`--verbose` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import export
import native_server
from py_engine import __version__
from ruvllm_cli import adapters, chat, evaluate, generate, hub, importers, learn, quantize


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ruvllm", description="ruvllm: one LLM engine for browser, npm and server.")
    parser.add_argument("--version", action="version", version=f"ruvllm {__version__}")
    _common(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in (generate, chat, hub, export, native_server, quantize, evaluate, importers, adapters, learn):
        group.add_parser(sub)
    try:  # web/ lives beside py_engine in a checkout; an installed wheel may lack it
        import web
    except ImportError:
        web = None
    if web is not None:
        web.add_parser(sub)

    for action in sub.choices.values():
        if "--verbose" not in action._option_string_actions:
            _common(action)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed (serve --replicas hands it to replicas)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except (ValueError, OSError, ImportError, RuntimeError) as e:
        if args.verbose:
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
