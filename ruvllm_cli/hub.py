"""`ruvllm download`, `ruvllm list` and `ruvllm info`: the model-management commands.

`add_parser` registers them on `ruvllm_cli.main`'s parser. Each command
returns an exit code and lets ValueError / OSError reach that parser's error
handler, which prints one line. Data (tables, JSON, the downloaded path) goes
to stdout; progress bars and status lines go to stderr, so
`MODEL_DIR=$(ruvllm download qwen)` works.

`python -m ruvllm_cli.hub ...` runs these commands alone, with the same
error handling, for tests and for use before `ruvllm_cli.main` exists.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from py_engine.hub import resolve as hub


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `download`, `list` and `info`; each sets `func(args) -> int`."""
    p = subparsers.add_parser(
        "download", help="download a model from the Hugging Face Hub",
        description="Download a model's safetensors weights, configs and tokenizer files into the ruvllm cache. "
                    "Prints the model's directory on stdout.")
    p.add_argument("model", metavar="MODEL", help="an alias (see `ruvllm list`) or a Hugging Face repo id, org/name")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.add_argument("--force", action="store_true", help="download again even if the model is already here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_cache_dir(p)
    p.set_defaults(func=cmd_download)

    p = subparsers.add_parser("list", help="list model aliases, the built-in model and downloaded models",
                              description="List model aliases, the built-in model and downloaded models.")
    p.add_argument("--downloaded", action="store_true", help="only the models on this machine")
    p.add_argument("--long", action="store_true", help="add repo, revision, size on disk and path")
    _add_cache_dir(p)
    p.set_defaults(func=cmd_list)

    p = subparsers.add_parser(
        "info", help="show a model's architecture, size and location (no MODEL: this machine's CPU kernels)",
        description="Show a model's architecture, parameter count, dtype, context length, size on disk and path. "
                    "Without MODEL, the CPU kernels this machine runs: the variant picked from the CPU's "
                    "features (RUVLLM_KERNEL_VARIANT forces one), those it could run, and the CPU's SIMD flags.")
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="a local directory, an alias, a downloaded org/name repo id, or tiny-shakespeare")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_cache_dir(p)
    p.set_defaults(func=cmd_info)


def _add_cache_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", metavar="DIR",
                   help="model cache (default: $RUVLLM_CACHE_DIR, else ~/.cache/ruvllm)")


def cmd_download(args: argparse.Namespace) -> int:
    from py_engine.hub.download import download

    done = download(args.model, revision=args.revision, force=args.force,
                    cache_dir=args.cache_dir, progress=not args.quiet)
    if done.fetched:
        _status(f"downloaded {done.repo} ({done.revision}): {len(done.files)} files, "
                f"{hub.format_size(hub.disk_size(done.path))}")
    else:
        _status(f"{done.repo} ({done.revision}) is already downloaded; --force downloads it again")
    print(done.path)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    entries = [e for e in hub.list_models(args.cache_dir) if e.path is not None or not args.downloaded]
    headers = ["NAME", "PARAMS", "STATUS"]
    if args.long:
        headers += ["REPO", "REVISION", "SIZE", "PATH"]
    headers.append("DESCRIPTION")
    rows = []
    for e in entries:
        row = [e.name, e.params, e.status]
        if args.long:
            size = hub.format_size(hub.disk_size(e.path)) if e.path is not None else "-"
            row += [e.repo or "-", e.revision or "-", size, str(e.path) if e.path is not None else "-"]
        rows.append(row + [e.description])
    if not rows:
        _status(f"no models downloaded to {hub.cache_root(args.cache_dir) / 'models'}; "
                "`ruvllm list` shows the aliases and `ruvllm download MODEL` fetches one")
        return 0
    print(format_table(headers, rows))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    if args.model is None:
        return _kernels_info(args.json)
    info = hub.describe(args.model, cache_dir=args.cache_dir)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(format_table(None, [[key, value] for key, value in _info_lines(info)]))
    return 0


def _kernels_info(as_json: bool) -> int:
    from py_engine.kernels import kernels_report  # torch: only for this form

    report = kernels_report()
    if as_json:
        print(json.dumps({"cpu_kernels": report}, indent=2))
        return 0
    rows = [["kernel variant", report["variant"] or "none (plain torch)"],
            ["variants this CPU runs", ", ".join(report["available"]) or "none"],
            ["forced by RUVLLM_KERNEL_VARIANT", report["forced"] or "no"],
            ["CPU SIMD flags", " ".join(report["cpu_flags"])]]
    print(format_table(None, rows))
    return 0


def _info_lines(info: dict[str, Any]) -> list[tuple[str, str]]:
    arch = f"{', '.join(info['architectures'])} ({info['model_type']})" if info["architectures"] else info["model_type"]
    if info["supported"]:
        exact, short = f"{info['parameters']:,}", hub.format_count(info["parameters"])
        params = exact if exact == short else f"{exact} ({short})"
    else:
        params = f"unknown: {info['note']}"
    lines = [("name", info["name"])]
    if info["repo"]:
        revision = f" ({info['revision']})" if info["revision"] else ""
        lines.append(("repo", info["repo"] + revision))
    lines += [
        ("architecture", str(arch or "?")),
        ("supported", "yes" if info["supported"] else "no"),
        ("parameters", params),
        ("dtype", info["dtype"] or "?"),
        ("context length", str(info["context_length"] or "?")),
        ("quantization", info.get("quantization") or "none (float weights)"),
        ("disk size", f"{hub.format_size(info['disk_size'])} in {len(info['files'])} "
                      f"file{'' if len(info['files']) == 1 else 's'}"),
        ("path", info["path"]),
    ]
    return lines


def format_table(headers: Sequence[str] | None, rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns two spaces apart."""
    table = ([list(headers)] if headers else []) + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


def _status(line: str) -> None:
    print(line, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """These three commands alone, with the one-line error handling of `ruvllm`."""
    parser = argparse.ArgumentParser(prog="ruvllm")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks")
    add_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        if args.verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
