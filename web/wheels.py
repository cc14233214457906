"""The pure-Python wheels Pyodide installs: py_engine's shared layer, jinja2, markupsafe.

    python -m web.wheels --out npm/wheels     # build + fetch; prints the files, writes index.json

The py_engine wheel holds ring 0 only (the modules reachable from RING0_ROOTS,
never torch code), written directly with zipfile so the build needs nothing
beyond the standard library. jinja2 and markupsafe come from PyPI at build
time (`pip download`; markupsafe built from its sdist with no C compiler, which
gives its pure-Python fallback) and are cached in .cache/wheels, so a later
build, the tests and the runtime are offline.
"""
from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "py_engine"
CACHE = REPO / ".cache" / "wheels"
# What the browser runtime uses; everything they import from py_engine comes along.
RING0_ROOTS = ("py_engine", "py_engine.config", "py_engine.tokenizer", "py_engine.chat", "py_engine.sampling",
               "py_engine.sampling_params", "py_engine.stopping", "py_engine.generate",
               # structured outputs: py_engine.guided loads its names lazily, so its modules are named here
               "py_engine.guided.guide", "py_engine.guided.tools",
               # prompt lookup speculation (the wasm kernels verify drafts)
               "py_engine.speculative")
# Imported lazily by ring-0 modules but never needed in Pyodide (they need torch or numpy), with what is below them.
RING1 = {"py_engine.backends", "py_engine.models", "py_engine.kernels", "py_engine.quant", "py_engine.cpu",
         "py_engine.importers", "py_engine.hub.download"}
JINJA2 = "jinja2==3.1.6"
MARKUPSAFE = "markupsafe==3.0.3"
PY_VERSION = "3.14"  # Pyodide 314's Python


def version() -> str:
    for line in (PACKAGE / "version.py").read_text(encoding="utf-8").splitlines():
        if line.startswith("__version__"):
            return line.split("=")[1].strip().strip("\"'")
    raise RuntimeError("py_engine/version.py has no __version__")


def module_file(module: str, root: Path = REPO) -> Path | None:
    """The source file of a dotted module name under root (a package's __init__.py), or None."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(module: str, root: Path = REPO) -> set[str]:
    """Modules under root that `module` imports anywhere (function-level imports included), by dotted name.

    `from a import b` counts a.b when that is a module, else a; parent packages that
    the import system runs first are not counted (they are imported, not imported from)."""
    path = module_file(module, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if module_file(sub, root) else target)
    return {m for m in found if module_file(m, root) is not None}


def _in(module: str, packages: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def ring0_modules() -> list[str]:
    """The closure of RING0_ROOTS over py_engine imports, minus ring 1, with every package above them."""
    todo, seen = list(RING0_ROOTS), set()
    while todo:
        name = todo.pop()
        if name in seen or _in(name, RING1) or not _in(name, {"py_engine"}):
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + sorted(imported_modules(name))
    return sorted(seen)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_py_engine_wheel(out_dir: Path) -> Path:
    """py_engine-<version>-py3-none-any.whl holding ring 0; reproducible (fixed timestamps)."""
    ver = version()
    dist_info = f"py_engine-{ver}.dist-info"
    paths = [module_file(m) for m in ring0_modules()]
    files = {p.relative_to(REPO).as_posix(): p.read_bytes() for p in paths}
    files[f"{dist_info}/METADATA"] = (f"Metadata-Version: 2.1\nName: py_engine\nVersion: {ver}\n"
                                      f"Summary: ruvllm's shared layer (ring 0)\nRequires-Dist: jinja2\n").encode()
    files[f"{dist_info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: ruvllm web.wheels\n"
                                   b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    record = [_record_line(n, d) for n, d in files.items()] + [f"{dist_info}/RECORD,,"]
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"py_engine-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, data)
    return path


def _pip(*args: str, cwd: Path | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True, cwd=cwd)


def fetch_dependency_wheels(cache: Path = CACHE) -> list[Path]:
    """jinja2 and pure markupsafe wheels, from the cache or (once) from PyPI."""
    cache.mkdir(parents=True, exist_ok=True)
    if not list(cache.glob("jinja2-*-py3-none-any.whl")):
        _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", PY_VERSION,
             "-d", str(cache), JINJA2)
    if not list(cache.glob("markupsafe-*-py3-none-any.whl")):
        with tempfile.TemporaryDirectory() as tmp:
            _pip("download", "--no-deps", "--no-binary=:all:", "-d", tmp, MARKUPSAFE)
            sdist = next(Path(tmp).glob("markupsafe-*.tar.gz"))
            env = {**os.environ, "CC": "/bin/false"}  # no compiler: the speedups are skipped
            subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel",
                            "--no-deps", "--no-build-isolation", "-w", str(cache), str(sdist)],
                           check=True, env=env)
    wheels = sorted(cache.glob("jinja2-*-py3-none-any.whl")) + sorted(cache.glob("markupsafe-*-py3-none-any.whl"))
    if len(wheels) != 2:
        raise RuntimeError(f"expected one jinja2 and one pure markupsafe wheel in {cache}, found {wheels}")
    return wheels


def build_wheels(out_dir: Path) -> list[Path]:
    """All three wheels in out_dir; the order is the install order (markupsafe before jinja2)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("*.whl"), out_dir / "index.json"]:
        old.unlink(missing_ok=True)
    deps = fetch_dependency_wheels()
    wheels = [Path(shutil.copy2(w, out_dir)) for w in reversed(deps)] + [build_py_engine_wheel(out_dir)]
    # The JS runtime unpacks them in this order (index.json), so jinja2 finds markupsafe installed.
    (out_dir / "index.json").write_text(json.dumps([w.name for w in wheels]) + "\n", encoding="utf-8")
    return wheels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m web.wheels", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the wheels")
    args = parser.parse_args(argv)
    for path in build_wheels(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
